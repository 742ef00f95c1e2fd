"""The embedded engine on one GPU: the paged engine beside today's continuous engine and HF `generate`, same run.

Three engines on the same model (SmolLM2-135M-Instruct in bfloat16; `--shape NAME` gives random bf16 weights at a
shape of bench/shapes.py with SmolLM2's tokenizer — `--random` is `--shape smollm2-135m`, the same model's shape —
which generate at the same speed as trained ones: every turn's length is fixed, `ignore_eos`):
- `old`: `TransformersPolicy(paged=False)`, the continuous engine of `slime_env.agents.engine` (left-padded K/V buffers,
  packed eager steps, per-session prefix cache);
- `hf`: Hugging Face `generate` with a static cache (`cache_implementation="static"`, which transformers compiles
  with `torch.compile(mode="reduce-overhead")`), one batch per turn — what a user would write instead; each turn
  runs to the longest turn's length and keeps each row's own length (the same tokens go into the next turn);
  timed on a second pass, after a first pass that compiled it (compile time reported apart);
- `paged`: `TransformersPolicy()` on CUDA, the paged engine (`slime_env.agents.paged_engine`), timed after a first pass
  that captured its CUDA graphs (warm-up time reported apart, like HF's compile).

Workloads: **multi-turn** — `--episodes` (256) concurrent episodes of `--turns` (4) turns, each turn's length drawn
per episode and turn from 16-64 tokens, then a ~15-token observation; every turn's prompt extends the last (the
prefix cache's case); and **single-turn** — `--prompts` (1,024) prompts of 30-100 tokens, 256 new tokens each.
A third workload, **decode** (`--workload decode`): `--decode-batches` (1, 4, 8) sequences decoding `--new-tokens`
each after `--decode-context` prompt tokens; ms per decode step beside the step's bandwidth floor (weights + K/V
read, over the H200's 4.8 TB/s), and with `--profile` the step's time by kind of kernel (`kernel_breakdown`).
Reported: generated tokens/s, time to the first token of turn 3 of a ~1,900-token episode (idle engine), peak GPU
memory, and for the paged engine its decode steps as a fraction of the memory-bandwidth ceiling (weights + the
K/V the step reads, over the device's copy bandwidth measured here).

    python bench/engine_gpu.py [--workload multi single] [--engines old hf paged] [--random | --shape NAME]
                               [--layers N] [--kv-fraction F] [--max-batch N] [--hf-batch N] [--profile]
                               [--out FILE.json]

`--kv-fraction`: the paged engine's K/V pool as a share of free GPU memory (a pool large enough that nothing is
preempted: each paged row reports its timed run's `preemptions`); `--max-batch`: the engines' rows; `--hf-batch`: HF
`generate` in chunks of that many prompts (halved while it runs out of memory: the largest batch that fits);
`--profile`: the timed paged runs under torch.profiler, their top 25 kernels printed and a chrome trace written beside
`--out`.

One GPU: the embedded engine runs in one process on one device (`--gpus` other than 1 is refused). Without CUDA it
runs on the CPU, a check of the script (`--shape qwen3-0.6b --layers 1 --engines old --prompts 4 --episodes 4`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
sys.path.insert(0, __file__.rsplit("/", 1)[0])

from megatron_mfu import spec_peak  # noqa: E402 - the card's dense bf16 peak
from shapes import SHAPES, gpus_arg, random_model  # noqa: E402

from slime_env.agents.transformers_policy import TransformersPolicy  # noqa: E402

from slime_env import Message, get_renderer  # noqa: E402

TOPICS = ["the tides", "prime numbers", "a haiku about rain", "the French revolution", "photosynthesis",
          "how a compiler works", "the rules of chess", "black holes", "sourdough bread", "the stock market"]


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def load(shape: str | None, layers: int | None = None):
    """(model, tokenizer): SmolLM2-135M-Instruct in bf16, or random bf16 weights at `shape` (bench/shapes.py, no model
    package needed), on `DEVICE`."""
    if shape is None:
        from slime_env.agents.default_model import load_default_model

        return load_default_model(DEVICE, torch.bfloat16)
    return random_model(shape, layers=layers, device=DEVICE)


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def multi_turn_plan(tok, episodes: int, turns: int, seed: int = 0):
    """Per episode: its first prompt's ids, each turn's length and the ids of each turn's observation."""
    rng = random.Random(seed)
    renderer = get_renderer(tok)
    plan = []
    for i in range(episodes):
        prompt = renderer.render_prompt([Message("system", "You are a helpful assistant with a calculator."),
                                         Message("user", f"Question {i}: tell me about {rng.choice(TOPICS)}, "
                                                         f"then compute {rng.randrange(100)} * {rng.randrange(100)}.")])
        lengths = [rng.randint(16, 64) for _ in range(turns)]
        plan.append((prompt, lengths, [f"Result: {rng.randrange(10 ** 6)}. Continue." for _ in range(turns)]))
    return plan, renderer


async def run_engine_multi(policy, plan, renderer) -> tuple[float, int]:
    async def episode(i, prompt, lengths, observations):
        session = policy.for_episode(f"bench-{i}")
        ids, made = list(prompt), 0
        for t, n in enumerate(lengths):
            gen = await session.generate(ids, {"temperature": 1.0, "max_new_tokens": n, "ignore_eos": True})
            made += len(gen.token_ids)
            ids = ids + list(gen.token_ids) + renderer.bridge(gen.token_ids, [Message("user", observations[t])])
        return made

    t0 = time.perf_counter()
    made = await asyncio.gather(*(episode(i, *p) for i, p in enumerate(plan)))
    synchronize()
    return time.perf_counter() - t0, sum(made)


def run_hf_multi(model, tok, plan, renderer, batch: int | None = None) -> tuple[float, int]:
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids = [list(p) for p, _, _ in plan]
    made = 0
    t0 = time.perf_counter()
    for t in range(len(plan[0][1])):
        lengths = [lens[t] for _, lens, _ in plan]
        out = hf_generate(model, ids, max(lengths), pad, batch)
        for i, row in enumerate(out):
            gen = row[:lengths[i]]
            made += len(gen)
            ids[i] = ids[i] + gen + renderer.bridge(gen, [Message("user", plan[i][2][t])])
    synchronize()
    return time.perf_counter() - t0, made


def hf_generate(model, prompts: list[list[int]], new_tokens: int, pad: int, batch: int | None = None
                ) -> list[list[int]]:
    """`new_tokens` sampled tokens per prompt; in chunks of `batch` prompts (None: all at once). Every chunk has one
    shape -- the widest prompt's width, `batch` rows (the last chunk filled up with copies of its first prompt, whose
    outputs are dropped) -- so the compiled static-cache decode is compiled once, not once per chunk."""
    width = max(len(p) for p in prompts)
    batch = batch or len(prompts)
    out: list[list[int]] = []
    for at in range(0, len(prompts), batch):
        chunk = prompts[at:at + batch]
        chunk = chunk + [chunk[0]] * (batch - len(chunk))
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(chunk):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        gen = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, temperature=1.0,
                             top_p=1.0, top_k=0, cache_implementation="static", pad_token_id=pad)
        out += gen[:min(batch, len(prompts) - at), width:].tolist()
    return out


def single_plan(tok, prompts: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    renderer = get_renderer(tok)
    words = " ".join(TOPICS).split()
    return [renderer.render_prompt([Message("user", " ".join(rng.choice(words) for _ in range(rng.randint(20, 90))))])
            for _ in range(prompts)]


async def run_engine_single(policy, prompts, new_tokens: int) -> tuple[float, int]:
    params = {"temperature": 1.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    t0 = time.perf_counter()
    gens = await asyncio.gather(*(policy.generate(p, params) for p in prompts))
    synchronize()
    return time.perf_counter() - t0, sum(len(g.token_ids) for g in gens)


def turn3_ttft(policy, renderer) -> tuple[float, int]:
    session = policy.for_episode("ttft")
    ids = renderer.render_prompt([Message("user", " ".join(f"fact {i} is true." for i in range(240)))])

    async def main():
        nonlocal ids
        for _ in range(2):
            gen = await session.generate(ids, {"temperature": 0.0, "max_new_tokens": 16})
            ids = ids + list(gen.token_ids) + renderer.bridge(gen.token_ids, [Message("user", "and?")])
        synchronize()
        t0 = time.perf_counter()
        await session.generate(ids, {"temperature": 0.0, "max_new_tokens": 1})
        return time.perf_counter() - t0

    return asyncio.run(main()), len(ids)


HBM_BYTES_PER_S = 4.8e12  # the H200's datasheet bandwidth: the decode workload's floor (bytes a step must read)


def decode_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """`n` prompts of `length` random ids (below every shape's vocabulary), distinct: nothing comes from the prefix
    cache unless a run repeats them."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(length)] for _ in range(n)]


async def run_decode_batch(policy, prompts, new_tokens: int) -> float:
    params = {"temperature": 1.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    t0 = time.perf_counter()
    await asyncio.gather(*(policy.generate(p, params) for p in prompts))
    synchronize()
    return time.perf_counter() - t0


KERNEL_KINDS = (("projections", ("gemm", "gemv", "nvjet", "cutlass", "skinny_linear", "splitk", "xmma")),
                ("attention", ("_decode", "_prefill")),
                ("norm/rope/silu", ("_add_rms_norm", "_rope_store", "_silu_mul")),
                ("copies", ("memcpy", "memset")))


def kernel_breakdown(prof, steps: int, wall: float) -> dict[str, float]:
    """Milliseconds per step of each kind of kernel (`KERNEL_KINDS`; the rest: the sampler and small torch ops),
    and `gaps`: the step's time with no kernel running (host work between replays, launch latency)."""
    from torch.autograd import DeviceType

    out = {kind: 0.0 for kind, _ in KERNEL_KINDS} | {"sampler/other": 0.0}
    for e in prof.key_averages():
        if e.device_type != DeviceType.CUDA or e.self_device_time_total <= 0:
            continue
        name = e.key.lower()
        kind = next((k for k, marks in KERNEL_KINDS if any(m in name for m in marks)), "sampler/other")
        out[kind] += e.self_device_time_total / 1e3 / steps
    out["gaps"] = max(0.0, wall * 1e3 / steps - sum(out.values()))
    return out


def run_decode(args, model, policy, weights_read: int, label: str) -> list[dict]:
    """The small-batch decode workload: for each prompt length and batch, `--new-tokens` tokens per sequence
    (sampled, `ignore_eos`); ms per decode step = (time of that run - time of a one-token run on fresh prompts of
    the same length) / (new tokens - 1), the median of `--decode-reps`, beside the bandwidth floor of the step
    (the weights once and each row's K/V at its average context, over `HBM_BYTES_PER_S`)."""
    e = policy._engine
    per_token_kv = e.runner.pool_bytes() / (e.prefix.num_blocks * e.block_size)
    rows, seed = [], 100
    for length in args.decode_context:
        for batch in args.decode_batches:
            seed += 10
            asyncio.run(run_decode_batch(policy, decode_prompts(batch, length, seed), 8))  # graphs captured
            per_step, steps = [], []
            for rep in range(args.decode_reps):
                one = asyncio.run(run_decode_batch(policy, decode_prompts(batch, length, seed + 2 * rep + 1), 1))
                before = counters(policy)
                prompts = decode_prompts(batch, length, seed + 2 * rep + 2)
                full = asyncio.run(run_decode_batch(policy, prompts, args.new_tokens))
                steps.append(counters(policy)["decode_steps"] - before["decode_steps"])
                per_step.append((full - one) / (args.new_tokens - 1))
            ms = sorted(per_step)[len(per_step) // 2] * 1e3
            ctx = length + args.new_tokens / 2
            floor_ms = (weights_read + batch * ctx * per_token_kv) / HBM_BYTES_PER_S * 1e3
            row = {"workload": "decode", "label": label, "batch": batch, "prompt_tokens": length,
                   "new_tokens": args.new_tokens, "ms_per_step": ms, "ms_per_step_all": [x * 1e3 for x in per_step],
                   "decode_steps": steps, "floor_ms": floor_ms, "of_floor": floor_ms / ms,
                   "tokens_per_s": batch / ms * 1e3}
            if args.profile:  # the last prompts again: cached, so the run is its decode steps (and a short prefill)
                before = counters(policy)
                with profiled(True, None) as prof:
                    wall = asyncio.run(run_decode_batch(policy, prompts, args.new_tokens))
                n = counters(policy)["steps"] - before["steps"]
                row["profile_ms_per_step"] = wall * 1e3 / n
                row["breakdown_ms"] = kernel_breakdown(prof, n, wall)
                row["top_kernels"] = top_kernels(prof, 12)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "top_kernels"}), flush=True)
    return rows


def print_decode(rows: list[dict]) -> None:
    print(f"\n{'label':8} {'batch':>5} {'prompt':>6} {'ms/step':>8} {'floor ms':>8} {'of floor':>8} {'tok/s':>7}  "
          "profile: ms/step by kind")
    for r in rows:
        prof = "  ".join(f"{k} {v:.2f}" for k, v in r.get("breakdown_ms", {}).items())
        print(f"{r['label']:8} {r['batch']:>5} {r['prompt_tokens']:>6} {r['ms_per_step']:>8.2f} {r['floor_ms']:>8.2f} "
              f"{r['of_floor']:>8.1%} {r['tokens_per_s']:>7.0f}  {prof}")


def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy (read + write), median of 10; 0 on a CPU (no ceiling)."""
    if DEVICE != "cuda":
        return 0.0
    x = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    y = torch.empty_like(x)
    times = []
    for _ in range(12):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        y.copy_(x)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1000)
    del x, y
    return 2 * (1 << 30) / sorted(times[2:])[len(times[2:]) // 2]


def engine(model, tok, name: str, batch: int, kv_fraction: float | None = None) -> TransformersPolicy:
    options = {"kv_memory_fraction": kv_fraction} if name == "paged" and kv_fraction is not None else None
    return TransformersPolicy(model, tok, max_batch_size=batch, paged=(name == "paged"), seed=0, paged_options=options)


COUNTERS = ("steps", "decode_steps", "mixed_steps", "preemptions", "decode_rows", "decode_ctx")


def counters(policy) -> dict[str, int]:
    """The paged engine's step counters now (a run's are the difference across it)."""
    return {k: getattr(policy._engine, k) for k in COUNTERS}


def profiled(enabled: bool, trace: str | None):
    """A torch.profiler context when `enabled` (else a null context); on exit the chrome trace goes to `trace`. The
    device's kernels are recorded whichever thread launched them (the engine's own); CPU ops only on this thread."""
    import contextlib

    if not enabled:
        return contextlib.nullcontext(None)
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else []))

    @contextlib.contextmanager
    def run():
        with prof:
            yield prof
        if trace:
            prof.export_chrome_trace(trace)

    return run()


def top_kernels(prof, n: int = 25) -> list[dict]:
    """The `n` kernels (CPU ops on a CPU) with the most total time: name, launches, total ms, share of all."""
    from torch.autograd import DeviceType

    kind = DeviceType.CUDA if DEVICE == "cuda" else DeviceType.CPU
    spent = (lambda e: e.self_device_time_total) if DEVICE == "cuda" else (lambda e: e.self_cpu_time_total)
    events = [e for e in prof.key_averages() if e.device_type == kind and spent(e) > 0]
    total = sum(spent(e) for e in events) or 1.0
    return [{"kernel": e.key, "count": e.count, "total_ms": spent(e) / 1e3, "share": spent(e) / total}
            for e in sorted(events, key=spent, reverse=True)[:n]]


def free_gpu() -> None:
    """What a failed run left (its compiled graphs, cached blocks) goes back before the next one."""
    import gc

    torch._dynamo.reset()
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run_one(args, model, tok, workload: str, name: str, row: dict, folder: str, hf_batch: int | None = None):
    """One engine on one workload: a warm-up (or compile) pass, then the timed pass, its results into `row`.
    Returns the engine's policy (None for HF, which runs in chunks of `hf_batch` prompts)."""
    policy = None
    if workload == "multi":
        plan, renderer = multi_turn_plan(tok, args.episodes, args.turns)
        if name == "hf":
            row["hf_batch"] = hf_batch or len(plan)
            t0 = time.perf_counter()
            run_hf_multi(model, tok, plan, renderer, hf_batch)  # first pass: compiles
            row["compile_pass_s"] = time.perf_counter() - t0
            wall, made = run_hf_multi(model, tok, plan, renderer, hf_batch)
        else:
            policy = engine(model, tok, name, args.max_batch or args.episodes, args.kv_fraction)
            # Warm-up: the paged engine's first pass captures a CUDA graph per step size (as HF's compiles);
            # the old engine has nothing to warm beyond a few steps.
            warm = plan if name == "paged" else plan[:8]
            t0 = time.perf_counter()
            asyncio.run(run_engine_multi(policy, warm, renderer))
            row["warmup_s"] = time.perf_counter() - t0
            wall, made = timed(args, policy, name, workload, row, folder,
                               lambda: asyncio.run(run_engine_multi(policy, plan, renderer)))
            row["turn3_ttft_s"], row["turn3_tokens"] = turn3_ttft(policy, renderer)
    else:
        prompts = single_plan(tok, args.prompts)
        if name == "hf":
            row["hf_batch"] = hf_batch or len(prompts)
            pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
            t0 = time.perf_counter()
            hf_generate(model, prompts, args.new_tokens, pad, hf_batch)  # the same shapes as the timed pass
            row["compile_pass_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            made = sum(len(r) for r in hf_generate(model, prompts, args.new_tokens, pad, hf_batch))
            synchronize()
            wall = time.perf_counter() - t0
        else:
            batch = args.max_batch or min(args.prompts, 512)
            policy = engine(model, tok, name, batch, args.kv_fraction)
            t0 = time.perf_counter()
            asyncio.run(run_engine_single(policy, prompts[:batch] if name == "paged" else prompts[:8], 16))
            row["warmup_s"] = time.perf_counter() - t0
            wall, made = timed(args, policy, name, workload, row, folder,
                               lambda: asyncio.run(run_engine_single(policy, prompts, args.new_tokens)))
    row.update({"tokens": made, "wall_s": wall, "tokens_per_s": made / wall})
    return policy


def timed(args, policy, name: str, workload: str, row: dict, folder: str, run) -> tuple[float, int]:
    """`run()` (the timed pass); the paged engine's counters of that pass into `row` (preemptions included), and
    with --profile its top kernels and a chrome trace (the profiler's overhead is in that pass's time)."""
    before = counters(policy) if name == "paged" else None
    profile = args.profile and name == "paged"
    trace = os.path.join(folder, f"engine_gpu_{workload}_{name}_trace.json") if profile else None
    with profiled(profile, trace) as prof:
        wall, made = run()
    if before is not None:
        after = counters(policy)
        row.update({k: after[k] - before[k] for k in COUNTERS})
    if prof is not None:
        row["top_kernels"], row["trace"] = top_kernels(prof), trace
    return wall, made


def print_kernels(row: dict) -> None:
    print(f"\ntop kernels of the {row['workload']} {row['engine']} run ({row['trace']}):")
    if not row["top_kernels"]:
        print("(none recorded: on a CPU the profiler sees this thread's ops, not the engine thread's)")
        return
    print(f"{'share':>6} {'total ms':>9} {'count':>7}  kernel")
    for k in row["top_kernels"]:
        print(f"{k['share']:>6.1%} {k['total_ms']:>9.1f} {k['count']:>7}  {k['kernel'][:110]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", nargs="+", default=["multi", "single"], choices=["multi", "single", "decode"])
    ap.add_argument("--decode-batches", type=int, nargs="+", default=[1, 4, 8],
                    help="decode workload: sequences decoding together")
    ap.add_argument("--decode-context", type=int, nargs="+", default=[32],
                    help="decode workload: prompt lengths (each with every batch)")
    ap.add_argument("--decode-reps", type=int, default=3, help="decode workload: timed runs per case (median)")
    ap.add_argument("--label", default="", help="a name for this run's decode rows (e.g. the code's version)")
    ap.add_argument("--no-skinny", action="store_true", help="decode workload: cuBLAS for the small steps' projections")
    ap.add_argument("--max-splits", type=int, default=None,
                    help="decode workload: at most this many context stretches per decoding token (1: no split)")
    ap.add_argument("--engines", nargs="+", default=["old", "hf", "paged"], choices=["old", "hf", "paged"])
    ap.add_argument("--episodes", type=int, default=256)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--random", action="store_true", help="random weights of the same shapes (--shape smollm2-135m)")
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES), help="random bf16 weights at this shape")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (a quick check of the script)")
    ap.add_argument("--gpus", type=gpus_arg, default=1, help="1: the embedded engine runs on one GPU")
    ap.add_argument("--kv-fraction", type=float, default=None,
                    help="the paged engine's K/V pool, as a fraction of free GPU memory (default: the engine's 0.4)")
    ap.add_argument("--max-batch", type=int, default=None,
                    help="the engines' max_batch_size (default: --episodes for multi-turn, min(--prompts, 512) for "
                         "single-turn)")
    ap.add_argument("--hf-batch", type=int, default=None,
                    help="HF generate in chunks of this many prompts (default: all at once; the largest that fits)")
    ap.add_argument("--profile", action="store_true",
                    help="profile each timed paged run: the top 25 kernels, and a chrome trace beside --out")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.kv_fraction is not None and not 0 < args.kv_fraction < 1:
        raise SystemExit(f"--kv-fraction {args.kv_fraction}: a fraction in (0, 1)")
    for flag in ("max_batch", "hf_batch"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} {getattr(args, flag)}: at least 1")
    if args.gpus != 1:
        raise SystemExit(f"--gpus {args.gpus}: the embedded engine runs in one process on one GPU; run one bench per "
                         "GPU instead")
    if args.random and args.shape not in (None, "smollm2-135m"):
        raise SystemExit(f"--random is --shape smollm2-135m; it cannot go with --shape {args.shape}")
    shape = args.shape or ("smollm2-135m" if args.random else None)
    if args.layers and shape is None:
        raise SystemExit("--layers: only with --shape or --random (random weights)")
    model, tok = load(shape, args.layers)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = copy_bandwidth()
    results: dict = {"gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "shape": shape,
                     "layers": model.config.num_hidden_layers, "copy_bandwidth_GBps": bandwidth / 1e9,
                     "kv_fraction": args.kv_fraction, "hf_batch": args.hf_batch}
    folder = os.path.dirname(os.path.abspath(args.out)) if args.out else os.getcwd()
    os.makedirs(folder, exist_ok=True)
    rows = []
    if "decode" in args.workload:
        policy = engine(model, tok, "paged", max(args.decode_batches), args.kv_fraction)
        if args.no_skinny:
            policy._engine.runner.skinny = False
        if args.max_splits is not None:
            from slime_env.agents import paged_attention

            paged_attention.MAX_SPLITS = args.max_splits
        embed = model.get_input_embeddings().weight
        tied = embed is model.get_output_embeddings().weight
        weights_read = weights - (0 if tied else embed.numel() * embed.element_size())  # a step reads B rows of it
        rows += run_decode(args, model, policy, weights_read, args.label)
        policy.close()
        for r in rows:
            if "top_kernels" in r:
                print(f"\ntop kernels, decode batch {r['batch']}, prompt {r['prompt_tokens']}:")
                for k in r["top_kernels"]:
                    print(f"{k['share']:>6.1%} {k['total_ms']:>9.1f} {k['count']:>7}  {k['kernel'][:100]}")
    for workload in [w for w in args.workload if w != "decode"]:
        for name in args.engines:
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            row = {"workload": workload, "engine": name}
            policy, hf_batch = None, args.hf_batch
            while True:
                try:
                    policy = run_one(args, model, tok, workload, name, row, folder, hf_batch)
                    break
                except torch.cuda.OutOfMemoryError as e:  # a batch too large for this GPU
                    row["error"] = f"out of memory: {str(e).splitlines()[0]}"
                if name != "hf" or row["hf_batch"] == 1:
                    break
                # HF at the largest batch that fits: halve it and run again (compile pass included).
                row.setdefault("hf_out_of_memory_at", []).append(row["hf_batch"])
                hf_batch = row["hf_batch"] // 2
                row = {"workload": workload, "engine": name, "hf_out_of_memory_at": row["hf_out_of_memory_at"]}
                free_gpu()
            if "error" in row:  # the row says so, the rest runs
                rows.append(row)
                print(json.dumps(row), flush=True)
                free_gpu()
                continue
            row["peak_gpu_GB"] = torch.cuda.max_memory_allocated() / 1e9 if DEVICE == "cuda" else 0.0
            if name == "paged":
                e = policy._engine
                row["pool_GB"] = e.runner.pool_bytes() / 1e9
                if row["decode_rows"] and bandwidth:
                    # The ceiling: every decode step reads the weights once and each row's K/V; at the run's average
                    # batch and context, tokens per second at the device's copy bandwidth.
                    batch_avg, ctx_avg = row["decode_rows"] / row["steps"], row["decode_ctx"] / row["decode_rows"]
                    per_token_kv = e.runner.pool_bytes() / (e.prefix.num_blocks * e.block_size)
                    step_bytes = weights + batch_avg * ctx_avg * per_token_kv
                    row["ceiling_tokens_per_s"] = batch_avg * bandwidth / step_bytes
                    row["of_ceiling"] = row["tokens_per_s"] / row["ceiling_tokens_per_s"]
                    # The roofline: at a large batch the projections are compute-bound (2 FLOPs per weight and row at
                    # the card's dense bf16 peak), not bandwidth-bound; the K/V read stays a memory cost.
                    peak = spec_peak()
                    if math.isfinite(peak):
                        flops_s = 2 * weights / e.runner.dtype.itemsize * batch_avg / (peak * 1e12)
                        step_s = max(weights / bandwidth, flops_s) + (step_bytes - weights) / bandwidth
                        row["roofline_tokens_per_s"] = batch_avg / step_s
                        row["of_roofline"] = row["tokens_per_s"] / row["roofline_tokens_per_s"]
                    row["decode_batch_avg"], row["decode_ctx_avg"] = batch_avg, ctx_avg
            if name != "hf":
                policy.close()
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "top_kernels"}), flush=True)
            if "top_kernels" in row:
                print_kernels(row)
    results["rows"] = rows
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print(f"\n{results['gpu']}, copy bandwidth {bandwidth / 1e9:.0f} GB/s, weights {weights / 1e6:.0f} MB")
    decode = [r for r in rows if r["workload"] == "decode"]
    if decode:
        print_decode(decode)
    rows = [r for r in rows if r["workload"] != "decode"]
    if not rows:
        return
    print(f"{'workload':8} {'engine':6} {'tokens':>8} {'wall s':>8} {'tok/s':>9} {'vs old':>7} {'TTFT3 ms':>9} "
          f"{'peak GB':>8} {'of ceiling':>10} {'of roofline':>11} {'preempt':>7}")
    base = {r["workload"]: r["tokens_per_s"] for r in rows if r["engine"] == "old" and "error" not in r}
    for r in rows:
        if "error" in r:
            print(f"{r['workload']:8} {r['engine']:6} {r['error']}")
            continue
        ratio = r["tokens_per_s"] / base[r["workload"]] if r["workload"] in base else float("nan")
        ttft = f"{r['turn3_ttft_s'] * 1000:.1f}" if "turn3_ttft_s" in r else "-"
        ceil = f"{r['of_ceiling']:.1%}" if "of_ceiling" in r else "-"
        roof = f"{r['of_roofline']:.1%}" if "of_roofline" in r else "-"
        print(f"{r['workload']:8} {r['engine']:6} {r['tokens']:>8} {r['wall_s']:>8.2f} {r['tokens_per_s']:>9.0f} "
              f"{ratio:>6.1f}x {ttft:>9} {r['peak_gpu_GB']:>8.2f} {ceil:>10} {roof:>11} {r.get('preemptions', '-'):>7}")

if __name__ == "__main__":
    main()
