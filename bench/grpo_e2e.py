"""GRPO end to end at a model's shape on several GPUs, disaggregated, synchronous and asynchronous, in the units
NeMo RL publishes (tokens/s/GPU = tokens a step processes / (step time x GPUs)).

The workload: random bf16 weights at `--shape` (bench/shapes.py, SmolLM2's tokenizer); single-turn episodes whose
generated lengths follow a length plan — one log-normal draw per episode, clipped to [--min-tokens, --max-tokens],
scaled so its mean is --mean-tokens, generated with ignore_eos (`Env.sampling_params`) — the long tail of NeMo RL's
Llama-3.1-8B row (16 x H100, max 4,096 / mean 1,060 generated tokens: 1,562 tok/s/GPU on-policy, 2,161 one step
off); a reward that splits every group (the parity of the sum of the generated ids), so every step trains.

Layouts (`--layouts`): `split`: the trainer's ranks on GPUs 0..T-1 as child processes of the run
(`cluster.backend: process`; Megatron, TP = T, full recompute), one serve-engine on each of GPUs T..N-1, the
weights over NCCL after every step. `colocated`: the ranks on all N GPUs (TP = T, DP = N / T) and a serve-engine on
each of them, each rank pushing the weights to the engine on its GPU by CUDA IPC; in the synchronous mode the engines
free their memory while the trainer steps and the optimizer state leaves the GPUs while they generate
(`trainer.offload`); in an async mode both share each GPU throughout.

Per run (`--modes off overlap full`): s/step (mean and median, the first step excluded: it compiles and warms the
engines), total and generated tokens/s/GPU, trainer and engine idle shares, the sync's seconds; then the table
beside NeMo RL's figures. Writes OUT/<layout>_<mode>/ (each run's metrics.jsonl) and OUT/summary.json.

GPU memory, as it goes: before each run and after each step, one line per GPU — the driver's view (nvidia-smi's
memory.used: every process, engines included) now and its largest value sampled every 0.5 s during the step, and
each trainer rank's torch view of its GPU over the step (`max_memory_allocated` / `max_memory_reserved`, and
allocated now); also in OUT/<layout>_<mode>/gpu_memory.jsonl. Before any weights are built, every layout x mode is
checked against the GPUs (`trainers/run/gpu_memory.check_fit`, the run's own check before it starts): one that
cannot fit is refused with the numbers (`--no-fit-check` runs it anyway).

  python bench/grpo_e2e.py --shape qwen3-8b --gpus 4 --trainer-gpus 2 --steps 6 --layouts split colocated
  python bench/grpo_e2e.py --cpu --shape smollm2-135m --layers 2 --steps 2 --layouts split colocated --modes off full
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from shapes import SHAPES, gpus_arg, save_random_model  # noqa: E402

import slime_env  # noqa: E402
from slime_env import Env, Task  # noqa: E402
from slime_env.trainers.run import TrainConfig, train  # noqa: E402

NEMO_RL = {"off": 1562.0, "overlap": 2161.0}  # Llama-3.1-8B GRPO, 16 x H100, tokens/s/GPU (on-policy, one step off)
PROMPT = "Write a long story about the sea, one sentence per line."


def plan_tasks(size: int, seed: int = 0, *, mean: float = 1060.0, low: int = 16, high: int = 4096,
               sigma: float = 1.0) -> list[Task]:
    """`size` tasks, each carrying its planned generated length: log-normal(sigma) draws clipped to [low, high],
    scaled (by bisection on the log-mean) so the clipped mean is `mean`."""
    rng = random.Random(seed)
    normals = [rng.gauss(0.0, sigma) for _ in range(size)]

    def clipped(mu: float) -> list[int]:
        return [min(high, max(low, round(math.exp(mu + z)))) for z in normals]

    lo_mu, hi_mu = math.log(low) - 4 * sigma, math.log(high) + 4 * sigma
    for _ in range(60):
        mid = (lo_mu + hi_mu) / 2
        lo_mu, hi_mu = (mid, hi_mu) if statistics.fmean(clipped(mid)) < mean else (lo_mu, mid)
    return [Task(prompt=PROMPT, id=f"plan-{seed}-{i}", metadata={"tokens": n})
            for i, n in enumerate(clipped((lo_mu + hi_mu) / 2))]


class LengthPlanEnv(Env):
    """One turn of the task's planned length (ignore_eos); reward: the parity of the generated ids' sum."""

    async def reset(self, *, seed=None, options=None):
        task = self.task_from(options, seed)
        self.sampling_params = {"max_new_tokens": int(task.metadata["tokens"]), "ignore_eos": True}
        return task.messages(), {}

    async def step(self, action):
        return [], float(sum(action.token_ids) % 2), True, False, {}


slime_env.register("LengthPlan-v0", entry_point="grpo_e2e:LengthPlanEnv", description="bench/grpo_e2e.py")


def config(args: argparse.Namespace, layout: str, mode: str, run_dir: Path) -> TrainConfig:
    t, n = args.trainer_gpus, args.gpus
    on_gpu = not args.cpu
    colocated = layout == "colocated"
    engine_gpus = list(range(n)) if colocated else list(range(t, n))
    return TrainConfig.from_dict({
        "run_dir": str(run_dir), "model": args.model, "env": "LengthPlan-v0", "seed": 0,
        "train_data": {"generator": "grpo_e2e:plan_tasks", "size": 20000, "seed": 1, "mean": args.mean_tokens,
                       "low": args.min_tokens, "high": args.max_tokens},
        "steps": args.steps, "prompts_per_step": args.prompts, "n_samples_per_prompt": args.n, "max_turns": 1,
        "max_new_tokens": args.max_tokens, "temperature": 1.0, "max_concurrency": args.prompts * args.n,
        "eval_every": 10 ** 6, "device": "cuda" if on_gpu else "cpu",
        "trainer": {"backend": "megatron", "estimator": "grpo", "lr": 1e-6, "tp": t,
                    "sequence_parallel": t > 1, "recompute": "full" if on_gpu else "none",
                    "micro_batch_size": 64, "max_tokens_per_micro_batch": args.micro_batch_tokens,
                    "max_grad_norm": 1.0, "offload": colocated and mode == "off"},
        "engine": {"kind": "serve", "count": len(engine_gpus) if on_gpu else (2 if colocated else 1),
                   **({"gpus": engine_gpus} if on_gpu else {}), **({"weight_sync": "tensor"} if colocated else {})},
        "cluster": {"backend": "process", "trainer": {"gpus_per_node": n if colocated else t}},
        "async": {"mode": mode, "max_staleness": 1, "in_flight": 2 * args.prompts * args.n},
    }, "bench/grpo_e2e.py")


class GPUMemoryLog:
    """Per-GPU memory around each step of a run: nvidia-smi's used memory sampled every `interval_s` by a thread
    (the largest since the last line), with the trainer ranks' torch view from the step's metrics; each line printed
    and appended to `path` as it comes."""

    def __init__(self, path: Path, interval_s: float = 0.5):
        from slime_env.trainers.run.gpu_memory import device_used

        self.device_used, self.path, self.interval_s = device_used, path, interval_s
        self.max: dict[int, float] = {}
        self.peak_of_run: dict[int, float] = {}
        self.lock, self.stop = threading.Lock(), threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self.stop.wait(self.interval_s):
            view = self.device_used()
            with self.lock:
                for g, (used, _) in view.items():
                    self.max[g] = max(self.max.get(g, 0.0), used)
                    self.peak_of_run[g] = max(self.peak_of_run.get(g, 0.0), used)

    def __enter__(self) -> GPUMemoryLog:
        self.write("before the run", {})
        if self.device_used():
            self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join()

    def write(self, when: str, ranks: dict[str, float]) -> None:
        now = self.device_used()
        with self.lock:
            during, self.max = self.max, {}
        row = {"when": when, "time": time.time(),
               "gpus": {g: {"used_gb": used, "total_gb": total, "max_used_gb": during.get(g)}
                        for g, (used, total) in now.items()}, "trainer_ranks": ranks}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        for g, (used, total) in now.items():
            peak = f", max {during[g]:.1f} during the step" if g in during else ""
            print(f"  memory {when}: GPU {g} {used:.1f} of {total:.1f} GB used (nvidia-smi){peak}", flush=True)
        for r in sorted({k.split("_")[0] for k in ranks}):
            v = {k.split("_", 1)[1]: x for k, x in ranks.items() if k.startswith(r + "_")}
            print(f"  memory {when}: trainer {r} (torch, its GPU) peak {v.get('peak_allocated_gb', 0):.1f} GB "
                  f"allocated / {v.get('peak_reserved_gb', 0):.1f} reserved over the step, "
                  f"{v.get('allocated_gb', 0):.1f} allocated after it", flush=True)
        if not now and not ranks:
            print(f"  memory {when}: no GPU seen (no nvidia-smi)", flush=True)

    def on_log(self, run_dir: Path) -> Any:
        """The run's `log`: at each step's line, the memory lines of that step (the trainer ranks' torch view from
        the row just written to metrics.jsonl)."""
        def log(line: str) -> None:
            if not line.startswith("step "):
                return
            ranks: dict[str, float] = {}
            try:
                row = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
                ranks = {k.removeprefix("memory/"): v for k, v in row.items() if k.startswith("memory/rank")}
            except (OSError, IndexError, ValueError):
                pass
            self.write(line.split(":")[0], ranks)
        return log


def check_layouts_fit(args: argparse.Namespace, out: Path) -> None:
    """Every layout x mode against this host's GPUs, from the shape's config alone (no weights built): the run's own
    check (`gpu_memory.check_fit`), so a layout that cannot fit is refused in seconds, not at step 1."""
    import torch

    from shapes import hf_config, model_class
    from slime_env.errors import InvalidInput
    from slime_env.trainers.run.gpu_memory import check_fit

    with torch.device("meta"):
        params = sum(p.numel() for p in model_class(args.shape)(
            hf_config(args.shape, **({"num_hidden_layers": args.layers} if args.layers else {}))).parameters())
    for layout in args.layouts:
        for mode in args.modes:
            try:
                check_fit(config(args, layout, mode, out / f"{layout}_{mode}"), f"{layout}, {mode}", params=params)
            except InvalidInput as e:
                raise SystemExit(f"--shape {args.shape} --gpus {args.gpus} --trainer-gpus {args.trainer_gpus}: {e}")
    print(f"fit check: every layout x mode fits the GPUs by the estimate ({params / 1e9:.2f} B parameters)",
          flush=True)


def summarize(rows: list[dict[str, Any]], gpus: int, prompt_tokens: int, episodes: int) -> dict[str, Any]:
    steps = [r for r in rows if r["step"] > 0]
    walls = [r["time/elapsed_s"] - r.get("time/eval_s", 0.0) for r in steps]
    per_step = [b - a for a, b in zip([0.0, *walls[:-1]], walls)][1:] or [walls[-1]]  # the first step warms up
    timed = steps[1:] or steps
    generated = statistics.fmean(r["train/tokens"] for r in timed)
    total = generated + prompt_tokens * episodes
    step_s = statistics.fmean(per_step)
    return {"steps": len(steps), "step_s_mean": step_s, "step_s_median": statistics.median(per_step),
            "generated_tokens_per_step": generated, "total_tokens_per_step": total,
            "tokens_per_s_per_gpu": total / step_s / gpus, "generated_tokens_per_s_per_gpu": generated / step_s / gpus,
            "trainer_idle": statistics.fmean(r["time/trainer_idle_frac"] for r in timed),
            "engine_idle": statistics.fmean(r["time/engine_idle_frac"] for r in timed),
            "sync_s": statistics.fmean(r.get("sync/s", 0.0) for r in timed),
            "sync_ranks": max(r.get("sync/ranks", 1.0) for r in timed),
            "train_step_s": statistics.fmean(r.get("train/step_s", 0.0) for r in timed)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="fewer of --shape's layers (a quick check)")
    ap.add_argument("--gpus", type=gpus_arg, default=4)
    ap.add_argument("--trainer-gpus", type=gpus_arg, default=2)
    ap.add_argument("--layouts", nargs="+", default=["split"], choices=["split", "colocated"])
    ap.add_argument("--modes", nargs="+", default=["off", "overlap", "full"], choices=["off", "overlap", "full"])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--mean-tokens", type=float, default=1060.0)
    ap.add_argument("--min-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--micro-batch-tokens", type=int, default=32768)
    ap.add_argument("--cpu", action="store_true", help="the plumbing on CPU: 2 x 4 episodes of 4-32 tokens, one "
                                                       "engine, the trainer on gloo")
    ap.add_argument("--no-fit-check", action="store_true", help="run layouts the GPU-memory estimate refuses")
    ap.add_argument("--out", default="runs/grpo_e2e")
    args = ap.parse_args()
    if args.cpu:  # colocated: two ranks (DP = 2) and two engines, each rank pushing to one
        args.prompts, args.n, args.mean_tokens, args.min_tokens, args.max_tokens = 2, 4, 12.0, 4, 32
        args.gpus, args.trainer_gpus = (2, 1) if "colocated" in args.layouts else (1, 1)
    elif "split" in args.layouts and args.trainer_gpus >= args.gpus:
        raise SystemExit(f"--trainer-gpus {args.trainer_gpus}: leave at least one of the {args.gpus} GPUs to engines")
    if "colocated" in args.layouts and args.gpus % args.trainer_gpus:
        raise SystemExit(f"--trainer-gpus {args.trainer_gpus} (TP) must divide --gpus {args.gpus} when colocated")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.model = str(out / (f"model_{args.shape}" + (f"_{args.layers}l" if args.layers else "")))
    if args.no_fit_check:  # the run's own check before it starts too (preflight looks it up at each run)
        from slime_env.trainers.run import gpu_memory

        gpu_memory.check_fit = lambda *a, **k: None
    elif not args.cpu:
        check_layouts_fit(args, out)
    save_random_model(args.shape, args.model, layers=args.layers)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False)
    prompt_tokens = len(tok(text, add_special_tokens=False)["input_ids"])
    plans = [t.metadata["tokens"] for t in plan_tasks(4096, 1, mean=args.mean_tokens, low=args.min_tokens,
                                                      high=args.max_tokens)]
    print(f"length plan: mean {statistics.fmean(plans):.0f}, median {statistics.median(plans):.0f}, "
          f"p99 {sorted(plans)[int(0.99 * len(plans))]}, max {max(plans)} generated tokens; prompt {prompt_tokens}",
          flush=True)
    results: dict[str, dict[str, Any]] = {}
    for layout in args.layouts:
        for mode in args.modes:
            name = f"{layout}_{mode}"
            (out / name).mkdir(parents=True, exist_ok=True)
            with GPUMemoryLog(out / name / "gpu_memory.jsonl") as memory:
                summary = asyncio.run(train(config(args, layout, mode, out / name), log=memory.on_log(out / name)))
            rows = [json.loads(line) for line in open(summary["metrics"])]
            r = results[name] = {"layout": layout, "mode": mode, "gpus": args.gpus, "trainer_gpus": args.trainer_gpus,
                                 **summarize(rows, args.gpus, prompt_tokens, args.prompts * args.n),
                                 "gpu_used_max_gb": memory.peak_of_run}
            print(f"{name:18s} {r['step_s_mean']:7.2f} s/step (median {r['step_s_median']:.2f})  "
                  f"{r['tokens_per_s_per_gpu']:7.0f} tok/s/GPU ({r['generated_tokens_per_s_per_gpu']:.0f} generated)  "
                  f"trainer idle {r['trainer_idle']:.2f}  engine idle {r['engine_idle']:.2f}  "
                  f"train {r['train_step_s']:.2f} s  sync {r['sync_s']:.3f} s ({r['sync_ranks']:.0f} rank(s))",
                  flush=True)
    where = "CPU (the plumbing only)" if args.cpu else \
        f"{args.gpus} GPUs (split: {args.trainer_gpus} training, {args.gpus - args.trainer_gpus} generating; " \
        f"colocated: all both, TP {args.trainer_gpus})"
    print(f"\n{args.shape}, {where}, {args.prompts} x {args.n} episodes per step")
    for name, r in results.items():
        ref = NEMO_RL.get(r["mode"])
        vs = f"{r['tokens_per_s_per_gpu'] / ref:.2f}x NeMo RL's {ref:.0f}" if ref else \
            "(NeMo RL publishes no full mode)"
        print(f"  {name:18s} {r['tokens_per_s_per_gpu']:7.0f} tok/s/GPU  {vs}")
    (out / "summary.json").write_text(json.dumps(results, indent=1))
    print(f"\nwrote {out / 'summary.json'}")


if __name__ == "__main__":
    main()
