"""The GPU learning check: GRPO with `MegatronTrainer` + the embedded engine (bf16), all on one GPU.

Task: `ArithmeticRetry-v0` — "What is 47 + 8?" (a two-digit and a one-digit number, + or -), up to three
attempts, a wrong answer is told "That is not correct. Try again." (a multi-turn episode: every retry is in
the same token ledger). Reward 0.8^(attempt-1) when solved. Held-out split: 200 problems from the test side
of a fixed partition (never seen in training), greedy, before training and every few steps. The engine
(`TransformersPolicy`, bf16 on the GPU) and the trainer (megatron-core, bf16 with fp32 master weights)
share the GPU; the weights go into the engine in place after every step. Stops at `--budget-min`.
Target: >= +20 points of held-out accuracy in <= 10 minutes on one H100. Writes runs/learn_gpu/ and
copies the plot to docs/learn_gpu.png. Usage: python bench/learn_gpu.py [--backend torch] [--lora]

`--lora` trains a LoRA adapter (`trainer.lora`, rank `--lora-rank`, every linear layer) on the torch trainer (or the
FSDP2 one with `--backend fsdp`) instead of every weight, and syncs the adapter alone; compare it with `--backend
torch` (full fine-tuning, same trainer): the printout ends with held-out accuracy, wall-clock, the GPU's peak memory
and the mean weight-sync bytes and seconds per step, and the same numbers go to RUN_DIR/bench_summary.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slime_env.trainers.run import TrainConfig, train  # noqa: E402

TASKS = {"generator": "slime_env.envs.math.retry_env:arithmetic_tasks", "digits": [2, 1], "ops": "+-"}


def config(args) -> TrainConfig:
    return TrainConfig.from_dict({
        "run_dir": args.run_dir, "model": "default", "env": "ArithmeticRetry-v0",
        "env_kwargs": {"digits": [2, 1], "ops": "+-", "max_attempts": 3},
        "train_data": {**TASKS, "size": 20000, "seed": 11, "split": "train"},
        "eval_data": {**TASKS, "size": args.eval_size, "seed": 12, "split": "test"},
        "steps": args.steps, "prompts_per_step": args.prompts, "n_samples_per_prompt": args.n, "max_turns": 3,
        "max_new_tokens": 24, "temperature": 1.0, "eval_every": args.eval_every, "max_concurrency": 512,
        "time_budget_s": args.budget_min * 60, "seed": 0, "device": "auto",
        "trainer": {"backend": args.backend, "estimator": "grpo", "lr": args.lr, "micro_batch_size": 64,
                    "max_tokens_per_micro_batch": 16384, "clip_low": 0.2, "clip_high": 0.28, "max_grad_norm": 1.0,
                    "off_policy": args.off_policy,
                    **({"lora": {"rank": args.lora_rank, "alpha": 2 * args.lora_rank, "target_modules": "all-linear"}}
                       if args.lora else {})},
    }, "bench/learn_gpu.py")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400, help="upper bound; the time budget usually ends the run")
    ap.add_argument("--budget-min", type=float, default=9.0)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--eval-size", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--backend", default="megatron", choices=["megatron", "torch"])
    ap.add_argument("--run-dir", default="runs/learn_gpu")
    ap.add_argument("--copy-to", default=None, help="also copy the plot and metrics.jsonl into this folder")
    ap.add_argument("--lora", action="store_true",
                    help="train a LoRA adapter (torch or fsdp trainer) instead of every weight")
    ap.add_argument("--lora-rank", type=int, default=32)
    ap.add_argument("--off-policy", default="auto", help="trainer.off_policy: the correction against the engine's "
                    "log-probs (auto = none in this synchronous run; tis, mis, ...)")
    args = ap.parse_args()
    import torch

    if args.lora:
        if args.backend == "megatron":
            args.backend = "torch"  # LoRA runs on the torch / FSDP trainers (docs/lora.md)
        if args.lr == 2e-5:
            args.lr = 2e-4  # an adapter's usual learning rate: ~10x full fine-tuning's
        if args.run_dir == "runs/learn_gpu":
            args.run_dir = "runs/learn_gpu_lora"

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (no GPU: this check is meant for one)"
    summary = asyncio.run(train(config(args)))
    rows = [json.loads(line) for line in open(summary["metrics"])]
    print("\nstep  elapsed_s  train_reward  heldout_accuracy  rollout_s  train_s")
    for r in rows:
        acc = f"{r['eval/accuracy']:.3f}" if "eval/accuracy" in r else ""
        reward = f"{r['train/reward_mean']:.3f}" if "train/reward_mean" in r else ""
        print(f"{r['step']:4d} {r.get('time/elapsed_s', 0):10.0f} {reward:>13s} {acc:>17s} "
              f"{r.get('rollout/s', 0):10.1f} {r.get('train/step_s', 0):8.2f}")
    gain = summary["last_accuracy"] - summary["first_accuracy"]
    print(f"\nheld-out accuracy {summary['first_accuracy']:.3f} -> {summary['last_accuracy']:.3f} "
          f"({gain * 100:+.1f} points) in {summary['elapsed_s'] / 60:.1f} min on {device}, {args.backend} trainer "
          f"(target: >= +20 points within 10 min on one H100)")
    syncs = [r for r in rows if "sync/bytes" in r]
    bench = {"mode": "lora" if args.lora else "full", "backend": args.backend, "device": device,
             "first_accuracy": summary["first_accuracy"], "last_accuracy": summary["last_accuracy"],
             "elapsed_s": summary["elapsed_s"], "steps": sum("train/reward_mean" in r for r in rows),
             "gpu_peak_gb": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
             "sync_bytes_mean": sum(r["sync/bytes"] for r in syncs) / max(len(syncs), 1),
             "sync_s_mean": sum(r.get("sync/s", 0.0) for r in syncs) / max(len(syncs), 1),
             "off_policy": args.off_policy,
             "rollout_logprob_gap": [round(r["train/rollout_logprob_gap"], 4) for r in rows
                                     if "train/rollout_logprob_gap" in r]}
    with open(os.path.join(args.run_dir, "bench_summary.json"), "w") as f:
        json.dump(bench, f, indent=1)
    print(f"{bench['mode']}: GPU peak {bench['gpu_peak_gb'] or 0:.1f} GB (engine + trainer), weight sync "
          f"{bench['sync_bytes_mean'] / 1e6:.1f} MB in {bench['sync_s_mean'] * 1e3:.0f} ms per step")
    docs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                        "learn_gpu_lora.png" if args.lora else "learn_gpu.png")
    shutil.copy(summary["curves"], docs)
    if args.copy_to:  # e.g. a folder that outlives the machine the check ran on
        os.makedirs(args.copy_to, exist_ok=True)
        shutil.copy(summary["curves"], os.path.join(args.copy_to, "learn_gpu.png"))
        shutil.copy(summary["metrics"], os.path.join(args.copy_to, "learn_gpu_metrics.jsonl"))
    print(f"plot: {docs}")


if __name__ == "__main__":
    main()
