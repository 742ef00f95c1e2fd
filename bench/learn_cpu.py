"""The learning check: GRPO with TorchTrainer + TransformersPolicy on SmolLM2-135M-Instruct, on this CPU.

Task: reasoning-gym `chain_sum` (sums of two one-digit numbers, a format the 135M model answers in a few
tokens), answers taken from `<answer>` or, failing that, the last number of the reply. Held-out split:
200 problems from another seed, scored greedily before training and every few steps. The run stops at
`--budget-min` (default 28 minutes, leaving room for the final evaluation inside 30). Writes
`runs/learn_cpu/` (metrics.jsonl, TensorBoard, curves.png) and copies the plot to `docs/learn_cpu.png`.
Target: >= +10 points of held-out accuracy within 30 minutes on 2 cores. Usage: python bench/learn_cpu.py
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

TASK = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def config(args) -> TrainConfig:
    return TrainConfig.from_dict({
        "run_dir": args.run_dir, "model": "default", "env": "ReasoningGym-v0",
        "env_kwargs": {"dataset": "chain_sum", "answer_formats": ["answer_tag", "last_number"],
                       "system_prompt": "Answer the question. Put only the final number inside <answer></answer>."},
        "train_data": {"reasoning_gym": {"dataset": "chain_sum", "size": 2000, "seed": 11, "config": TASK}},
        "eval_data": {"reasoning_gym": {"dataset": "chain_sum", "size": args.eval_size, "seed": 12, "config": TASK}},
        "steps": args.steps, "prompts_per_step": args.prompts, "n_samples_per_prompt": args.n,
        "max_new_tokens": 24, "temperature": 1.0, "eval_every": args.eval_every, "max_concurrency": 64,
        "time_budget_s": args.budget_min * 60, "seed": 0,
        "trainer": {"estimator": "grpo", "lr": args.lr, "micro_batch_size": 16, "clip_low": 0.2, "clip_high": 0.28,
                    "max_grad_norm": 1.0},
    }, "bench/learn_cpu.py")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="upper bound; the time budget usually ends the run")
    ap.add_argument("--budget-min", type=float, default=28.0)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--eval-size", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--run-dir", default="runs/learn_cpu")
    args = ap.parse_args()
    summary = asyncio.run(train(config(args)))
    rows = [json.loads(line) for line in open(summary["metrics"])]
    print("\nstep  elapsed_s  train_reward  heldout_accuracy")
    for r in rows:
        acc = f"{r['eval/accuracy']:.3f}" if "eval/accuracy" in r else ""
        reward = f"{r['train/reward_mean']:.3f}" if "train/reward_mean" in r else ""
        print(f"{r['step']:4d} {r.get('time/elapsed_s', 0):10.0f} {reward:>13s} {acc:>17s}")
    gain = summary["last_accuracy"] - summary["first_accuracy"]
    print(f"\nheld-out accuracy {summary['first_accuracy']:.3f} -> {summary['last_accuracy']:.3f} "
          f"({gain * 100:+.1f} points) in {summary['elapsed_s'] / 60:.1f} min on {os.cpu_count()} cores "
          f"(target: >= +10 points within 30 min)")
    docs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "learn_cpu.png")
    shutil.copy(summary["curves"], docs)
    print(f"plot: {docs}")


if __name__ == "__main__":
    main()
