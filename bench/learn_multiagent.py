"""The multi-agent learning check: self-play GRPO with one shared SmolLM2-135M-Instruct policy on tic-tac-toe
(CPU, TorchTrainer), evaluated as win rate against a fixed opponent the training never played.

Training: `TicTacToe-v0` with the policy in both seats (each seat's 8 games of a group form its own GRPO
group). Evaluation: the policy plays X, greedily, against the env's random bot as O (never an
opponent in training), `--eval-games` games before training and every few steps; the win rate and the
illegal-move rate are reported. Moves may be a bare digit (`move_format="tag_or_digit"`). The run stops
at `--budget-min` (default 28 minutes). Writes `runs/learn_multiagent/` and copies the plot to
`docs/learn_multiagent.png`. Target: >= +15 points of win rate within 30 minutes on 2 cores.
Usage: python bench/learn_multiagent.py
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


def config(args) -> TrainConfig:
    return TrainConfig.from_dict({
        "run_dir": args.run_dir, "model": "default", "env": "TicTacToe-v0",
        "env_kwargs": {"move_format": "tag_or_digit"},
        "eval_env_kwargs": {"bot": {"o": "random"}},
        "train_agents": ["x", "o"],
        "train_data": {"generator": "slime_env.envs.games.tictactoe:play_tasks", "size": 4096},
        "eval_data": {"generator": "slime_env.envs.games.tictactoe:play_tasks", "size": args.eval_games},
        "steps": args.steps, "prompts_per_step": args.prompts, "n_samples_per_prompt": args.n,
        "max_turns": 5, "max_new_tokens": 10, "temperature": 1.0, "eval_every": args.eval_every,
        "max_concurrency": 64, "time_budget_s": args.budget_min * 60, "seed": 0,
        "trainer": {"estimator": args.estimator, "lr": args.lr, "micro_batch_size": 16, "clip_low": 0.2,
                    "clip_high": 0.28, "max_grad_norm": 1.0},
    }, "bench/learn_multiagent.py")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="upper bound; the time budget usually ends the run")
    ap.add_argument("--budget-min", type=float, default=28.0)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--estimator", default="grpo", help="grpo (per-seat groups) or rae (SPIRAL's role baselines)")
    ap.add_argument("--eval-games", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--run-dir", default="runs/learn_multiagent")
    args = ap.parse_args()
    summary = asyncio.run(train(config(args)))
    rows = [json.loads(line) for line in open(summary["metrics"])]
    print("\nstep  elapsed_s  train_reward  win_rate  illegal_rate")
    for r in rows:
        win = f"{r['eval/accuracy']:.3f}" if "eval/accuracy" in r else ""
        illegal = f"{r['eval/illegal_rate']:.3f}" if "eval/illegal_rate" in r else ""
        reward = f"{r['train/reward_mean']:.3f}" if "train/reward_mean" in r else ""
        print(f"{r['step']:4d} {r.get('time/elapsed_s', 0):10.0f} {reward:>13s} {win:>9s} {illegal:>13s}")
    gain = summary["last_accuracy"] - summary["first_accuracy"]
    print(f"\nwin rate against the random bot {summary['first_accuracy']:.3f} -> {summary['last_accuracy']:.3f} "
          f"({gain * 100:+.1f} points) in {summary['elapsed_s'] / 60:.1f} min on {os.cpu_count()} cores "
          f"(target: >= +15 points within 30 min)")
    docs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "learn_multiagent.png")
    shutil.copy(summary["curves"], docs)
    print(f"plot: {docs}")


if __name__ == "__main__":
    main()
