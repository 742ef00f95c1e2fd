"""The same training run three ways — `async: off`, `overlap`, `full` — side by side: wall-clock per step, generated
tokens/s, trainer and engine idle shares, staleness, and held-out accuracy at equal steps and at equal wall-clock.

Tasks (both `ArithmeticRetry-v0`, the GPU learning check's env: "What is 47 + 8?", a wrong answer is told to try
again in the same episode):
  retry     the learning check itself: up to 3 attempts.
  longtail  up to 8 attempts: a weak policy's episodes run 1 to 8 turns, so their lengths vary by >= 4x and a
            synchronous step waits for its slowest episode.
Wall-clock excludes the held-out evaluations (the same number in every mode). On a GPU the defaults are the learning
check's (Megatron trainer, 32 prompts x 8 samples); `--cpu-small` runs a CPU-sized version. Engines: `embedded` (in
the trainer's process), `serve` (a serve-engine process on the trainer's GPU, weights by CUDA IPC), `apart` (a
serve-engine on GPU 1, the trainer on GPU 0, weights over NCCL: `engine.gpus: [1]`). Every engine runs every mode, or
`--runs ENGINE:MODE[:process] ...` names the runs (`:process`: the trainer in a child process of the run,
`cluster.backend: process`, so generation's driver and the trainer's step share no interpreter lock); each seed's
first `off` run is the baseline of the side-by-side table.
`--gpus N` gives `apart` N-1 serve-engines, one on each of GPUs 1..N-1 (the trainer stays on GPU 0; `embedded` and
`serve` use one GPU, so `--gpus` above 1 needs an `apart` run). The model is SmolLM2-135M-Instruct, or with
`--shape NAME` random bf16 weights at a shape of bench/shapes.py with SmolLM2's tokenizer (`--layers` for fewer):
step time, tokens/s and idle shares at that shape — its accuracy stays near 0, random weights do not learn this.
Writes OUT/<task>_<mode>_s<seed>[_<engine>]/ (each run's metrics.jsonl), OUT/<task>_summary.json and
OUT/<task>_accuracy.png.

  python bench/async_train.py --task longtail --steps 100 --seeds 0 1
  python bench/async_train.py --task retry --cpu-small --steps 8 --seeds 0
  python bench/async_train.py --task longtail --steps 30 --seeds 0 --runs serve:off apart:off apart:overlap apart:full
  python bench/async_train.py --task longtail --steps 20 --seeds 0 --runs apart:off apart:full apart:full:process
  python bench/async_train.py --shape qwen3-1.7b --gpus 3 --steps 10 --seeds 0 --runs apart:off apart:full
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from shapes import SHAPES, gpus_arg, save_random_model  # noqa: E402

from slime_env.trainers.run import TrainConfig, train  # noqa: E402

TASKS = {"generator": "slime_env.envs.math.retry_env:arithmetic_tasks", "digits": [2, 1], "ops": "+-"}
ATTEMPTS = {"retry": 3, "longtail": 8}


ENGINES = {"embedded": {"kind": "embedded"}, "serve": {"kind": "serve", "count": 1},
           "apart": {"kind": "serve", "count": 1, "gpus": [1]}}


def engines(gpus: int | None) -> dict[str, dict]:
    """`ENGINES` with `apart` spread over GPUs 1..gpus-1 (as is, GPU 1, without `--gpus`)."""
    if gpus is None:
        return ENGINES
    return {**ENGINES, "apart": {"kind": "serve", "count": gpus - 1, "gpus": list(range(1, gpus))}}


def config(args, engine: str, mode: str, seed: int, run_dir: Path, cluster: str = "local") -> TrainConfig:
    attempts = ATTEMPTS[args.task]
    small = args.cpu_small
    prompts, n = args.prompts or (4 if small else 32), args.n or (4 if small else 8)
    return TrainConfig.from_dict({
        "run_dir": str(run_dir), "model": args.model, "env": "ArithmeticRetry-v0",
        "env_kwargs": {"digits": [2, 1], "ops": "+-", "max_attempts": attempts},
        "train_data": {**TASKS, "size": 20000, "seed": 11, "split": "train"},
        "eval_data": {**TASKS, "size": args.eval_size, "seed": 12, "split": "test"},
        "steps": args.steps, "prompts_per_step": prompts, "n_samples_per_prompt": n, "max_turns": attempts,
        "max_new_tokens": 24, "temperature": 1.0, "eval_every": args.eval_every,
        "max_concurrency": 64 if small else 512, "seed": seed, "device": "auto",
        "trainer": {"backend": "torch" if small else args.backend, "estimator": "grpo", "lr": args.lr,
                    "micro_batch_size": 4 if small else 64, "max_tokens_per_micro_batch": 16384,
                    "clip_low": 0.2, "clip_high": 0.28, "max_grad_norm": 1.0},
        "engine": engines(args.gpus)[engine], "cluster": {"backend": cluster},
        "async": {"mode": mode, "max_staleness": args.max_staleness,
                  "in_flight": args.in_flight or 2 * prompts * n, "interrupt": args.interrupt},
    }, "bench/async_train.py")


def summarize(rows: list[dict]) -> dict:
    steps = [r for r in rows if r["step"] > 0]
    train_wall = [r["time/elapsed_s"] - r.get("time/eval_s", 0.0) for r in steps]
    per_step = [b - a for a, b in zip([0.0, *train_wall[:-1]], train_wall)]
    evals = [(0.0 if r["step"] == 0 else r["time/elapsed_s"] - r.get("time/eval_s", 0.0), r["step"],
              r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    hist: dict[str, int] = {}
    for r in steps:
        for k, n in (r.get("async/staleness_hist") or {"0": 1}).items():
            hist[k] = hist.get(k, 0) + n
    lengths = [r.get("train/response_len", 0.0) for r in steps]
    return {"steps": len(steps), "train_wall_s": train_wall[-1] if train_wall else 0.0,
            "step_s_mean": statistics.fmean(per_step) if per_step else 0.0,
            "step_s_median": statistics.median(per_step) if per_step else 0.0,
            "tokens_per_s": statistics.fmean(r["rollout/generated_tokens_per_s"] for r in steps),
            "trainer_idle": statistics.fmean(r["time/trainer_idle_frac"] for r in steps),
            "engine_idle": statistics.fmean(r["time/engine_idle_frac"] for r in steps),
            "stale_dropped": sum(r.get("async/groups_stale", 0.0) for r in steps),
            "staleness_hist": hist, "response_len_mean": statistics.fmean(lengths) if lengths else 0.0,
            "evals": evals, "first_accuracy": evals[0][2] if evals else None,
            "last_accuracy": evals[-1][2] if evals else None}


def accuracy_at(evals: list[tuple[float, int, float]], wall: float) -> float | None:
    """Held-out accuracy of the last evaluation at or before `wall` seconds of training."""
    seen = [a for t, _, a in evals if t <= wall + 1e-9]
    return seen[-1] if seen else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", choices=sorted(ATTEMPTS), default="longtail")
    ap.add_argument("--modes", nargs="+", default=["off", "overlap", "full"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--prompts", type=int, default=0)
    ap.add_argument("--n", type=int, default=0)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--eval-size", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--max-staleness", type=int, default=1)
    ap.add_argument("--in-flight", type=int, default=0, help="full mode's episodes in flight (default 2 steps' worth)")
    ap.add_argument("--interrupt", default="finish", choices=["finish", "resume"])
    ap.add_argument("--backend", default="megatron", choices=["megatron", "torch"])
    ap.add_argument("--engine", nargs="+", default=["embedded"], choices=sorted(ENGINES),
                    help="serve: a serve-engine process on the same GPU (CUDA IPC); apart: on GPU 1 (NCCL)")
    ap.add_argument("--runs", nargs="+", default=None, metavar="ENGINE:MODE[:process]",
                    help="the runs, instead of every --engine with every --modes")
    ap.add_argument("--cpu-small", action="store_true", help="a CPU-sized run: 4 prompts x 4 samples, torch trainer")
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES), help="random bf16 weights at this shape")
    ap.add_argument("--layers", type=int, default=None, help="fewer of --shape's layers (a quick check)")
    ap.add_argument("--gpus", type=gpus_arg, default=None, help="apart: one serve-engine on each of GPUs 1..N-1")
    ap.add_argument("--out", default="runs/async_bench")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [(*r.split(":", 2), "local")[:3] for r in args.runs] if args.runs else \
        [(e, m, "local") for e in args.engine for m in args.modes]
    for engine, mode, cluster in runs:
        if engine not in ENGINES or mode not in ("off", "overlap", "full") or cluster not in ("local", "process") \
                or (cluster == "process" and engine == "embedded"):
            raise SystemExit(f"--runs {engine}:{mode}:{cluster}: ENGINE is one of {sorted(ENGINES)}, MODE off, overlap "
                             "or full, then optionally :process (not with the embedded engine)")
    if args.gpus is not None and (args.gpus > 1) != any(e == "apart" for e, _, _ in runs):
        raise SystemExit(f"--gpus {args.gpus}: only the apart engine is placed on GPUs beyond the trainer's; it needs "
                         "--gpus 2 or more, embedded and serve runs need none (or --gpus 1)")
    if args.layers and not args.shape:
        raise SystemExit("--layers: only with --shape")
    args.model = "default"
    if args.shape:  # saved once, every run loads the same weights
        args.model = str(out / (f"model_{args.shape}" + (f"_{args.layers}l" if args.layers else "")))
        save_random_model(args.shape, args.model, layers=args.layers)
    results: dict[str, dict] = {}
    for seed in args.seeds:
        for engine, mode, cluster in runs:
            name = f"{args.task}_{mode}_s{seed}" + ("" if engine == "embedded" else f"_{engine}") + \
                ("" if cluster == "local" else f"_{cluster}")
            summary = asyncio.run(train(config(args, engine, mode, seed, out / name, cluster), log=lambda line: None))
            rows = [json.loads(line) for line in open(summary["metrics"])]
            results[name] = {"engine": engine, "mode": mode, "cluster": cluster, "seed": seed, **summarize(rows)}
            r = results[name]
            with (out / f"{args.task}_runs.jsonl").open("a") as f:  # kept even if a later run is cut short
                f.write(json.dumps({"name": name, **r}) + "\n")
            print(f"{name:30s} {r['steps']:4d} steps  {r['step_s_mean']:.3f} s/step  {r['tokens_per_s']:8.0f} tok/s  "
                  f"trainer idle {r['trainer_idle']:.2f}  engine idle {r['engine_idle']:.2f}  "
                  f"acc {r['first_accuracy']:.3f} -> {r['last_accuracy']:.3f}  stale dropped {r['stale_dropped']:.0f}  "
                  f"staleness {r['staleness_hist']}", flush=True)
    # Side by side: each run against the seed's first `off` run; accuracy at the wall-clock the fastest run needed.
    print(f"\n{args.task}: engine/mode             steps/h   vs base  tok/s    trainer idle  engine idle  acc@steps  "
          "acc@equal-wall")
    for seed in args.seeds:
        mine = [r for r in results.values() if r["seed"] == seed]
        wall = min(r["train_wall_s"] for r in mine)
        base = next((r for r in mine if r["mode"] == "off"), None)
        for r in mine:
            per_h = 3600.0 / max(r["step_s_mean"], 1e-9)
            ratio = base["step_s_mean"] / r["step_s_mean"] if base else float("nan")
            r["steps_per_hour"], r["vs_base"], r["accuracy_at_equal_wall"] = per_h, ratio, accuracy_at(r["evals"], wall)
            label = f"{r['engine']}/{r['mode']}" + ("" if r["cluster"] == "local" else f"/{r['cluster']}")
            print(f"  s{seed} {label:22s} {per_h:8.0f}  {ratio:6.2f}x  {r['tokens_per_s']:7.0f}"
                  f"  {r['trainer_idle']:12.2f}  {r['engine_idle']:11.2f}  {r['last_accuracy']:9.3f}"
                  f"  {r['accuracy_at_equal_wall'] or 0:14.3f}"
                  f"  (equal wall = {wall:.0f} s)")
    (out / f"{args.task}_summary.json").write_text(json.dumps(results, indent=1))
    plot(results, out / f"{args.task}_accuracy.png", args.task)
    print(f"\nwrote {out / (args.task + '_summary.json')} and {out / (args.task + '_accuracy.png')}")


def plot(results: dict[str, dict], path: Path, task: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"off": "tab:gray", "overlap": "tab:blue", "full": "tab:red"}
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        ts = [t for t, _, _ in r["evals"]]
        accs = [a for _, _, a in r["evals"]]
        first_seed = r["seed"] == min(x["seed"] for x in results.values())
        ax.plot(ts, accs, marker="o" if first_seed else "s", ms=3, color=colors.get(r["mode"], "black"), alpha=0.85,
                linestyle={"embedded": "-", "serve": "--", "apart": ":"}[r["engine"]],
                label=f"{r['engine']}/{r['mode']}{'/' + r['cluster'] if r['cluster'] != 'local' else ''} "
                      f"(seed {r['seed']})")
    ax.set_xlabel("training wall-clock (s, evaluations excluded)")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_title(f"async modes — ArithmeticRetry-v0, {task}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
