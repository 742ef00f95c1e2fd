"""What a serve-engine holds on its GPU while a colocated trainer steps: SGLang's memory routes measured.

One process serves the paged engine through serve-engine's routes (`EngineServer`, in-process over aiohttp's test
client) at a shape of bench/shapes.py with random bf16 weights built on the GPU, and reports the GPU memory — torch's
view (`memory_allocated`, `memory_reserved`) and the driver's (`mem_get_info`: the device's used bytes; `nvidia-smi`'s
per-process and whole-GPU figures) — at each phase of a colocated step:

  loaded          model on the GPU, K/V pool allocated, nothing generated
  generated       after a batch of greedy requests (CUDA graphs captured at the sizes the batch needed)
  released        after POST /release_memory_occupation
  probed          after GET /health_generate while released (the engine pool's watcher probes every 5 s)
  resumed         after POST /resume_memory_occupation, one request (its greedy tokens must equal those before the
                  release) and the batch again

  python bench/engine_release.py --shape qwen3-8b [--requests 32 --tokens 128 --cycles 2] [--out FILE.json]

Run it against an older engine (its files copied over) to compare: the routes are the same.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from shapes import random_model  # noqa: E402

GB = 1e9


def memory(label: str, t0: float) -> dict:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    row = {"phase": label, "allocated_gb": torch.cuda.memory_allocated() / GB,
           "reserved_gb": torch.cuda.memory_reserved() / GB, "device_used_gb": (total - free) / GB,
           "t_s": round(time.perf_counter() - t0, 2)}
    try:
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20).stdout.split("\n")
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout.split()
        row["smi_process_gb"] = sum(float(a.split(",")[1]) for a in apps if a.strip()) * 2**20 / GB
        row["smi_gpu_gb"] = float(gpu[0]) * 2**20 / GB
    except (OSError, IndexError, ValueError, subprocess.TimeoutExpired) as e:
        row["smi"] = f"unavailable: {e}"
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    return row


async def main(args) -> dict:
    from aiohttp.test_utils import TestClient, TestServer
    from slime_env.agents.engine_server import EngineServer
    from slime_env.agents.transformers_policy import TransformersPolicy

    t0 = time.perf_counter()
    base = memory("empty", t0)
    model, tok = random_model(args.shape, layers=args.layers, device="cuda")
    policy = TransformersPolicy(model, tok, max_batch_size=args.requests, paged=True,
                                paged_options={"kv_memory_fraction": args.mem_fraction,
                                               "max_model_len": args.max_model_len})
    rows = [base, memory("loaded", t0)]
    prompts = [[1000 + 7 * i + j for j in range(args.prompt)] for i in range(args.requests)]
    params = {"temperature": 0.0, "max_new_tokens": args.tokens, "ignore_eos": True}
    async with TestClient(TestServer(EngineServer(policy, args.shape).app())) as http:
        async def batch() -> list[list[int]]:
            answers = await asyncio.gather(*(http.post("/generate", json={"input_ids": p, "sampling_params": params})
                                             for p in prompts))
            return [(await a.json())["output_ids"] for a in answers]

        async def one() -> list[int]:  # alone: the same steps before and after (a batch's may round apart in bf16)
            r = await http.post("/generate", json={"input_ids": prompts[0], "sampling_params": params})
            return (await r.json())["output_ids"]

        first_batch = await batch()
        first = await one()
        rows.append(memory("generated", t0))
        timings = []
        for cycle in range(args.cycles):  # the first release pins its host buffers; later ones reuse them
            t = time.perf_counter()
            assert (await http.post("/release_memory_occupation", json={})).status == 200
            release_s = time.perf_counter() - t
            rows.append(memory(f"released#{cycle + 1}", t0))
            t = time.perf_counter()
            probe = await http.get("/health_generate")
            probe_s = time.perf_counter() - t
            rows.append(memory(f"probed#{cycle + 1}", t0))
            t = time.perf_counter()
            assert (await http.post("/resume_memory_occupation", json={})).status == 200
            resume_s = time.perf_counter() - t
            timings.append({"release_s": round(release_s, 3), "probe_s": round(probe_s, 4), "probe": probe.status,
                            "resume_s": round(resume_s, 3)})
        second = await one()
        second_batch = await batch()
        rows.append(memory("resumed", t0))
    policy.close()
    same = first == second
    batch_same = sum(a == b for a, b in zip(first_batch, second_batch))
    out = {"shape": args.shape, "layers": args.layers, "requests": args.requests, "tokens": args.tokens,
           "mem_fraction": args.mem_fraction, "rows": rows, "cycles": timings, "same_tokens_after_resume": same,
           "batch_rows_same_after_resume": f"{batch_same}/{len(prompts)}",
           "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}), flush=True)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--mem-fraction", type=float, default=0.4, help="serve-engine's default")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--cycles", type=int, default=1, help="release/resume cycles before the check")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result = asyncio.run(main(args))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
