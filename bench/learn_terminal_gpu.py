"""The terminal-task learning check on one GPU: SmolLM2-135M-Instruct, an SFT warm-up on the scripted teacher's
successful episodes (train kinds, train seeds), then GRPO, on generated terminal tasks (`Terminal-v0`) in bubblewrap
workspaces; held out: the other side of the seed partition of the train kinds, and four kinds never trained on
(`HELDOUT_KINDS`: move a file into a folder, count matching lines, copy a file, append a line), each its own eval set
so the report has a pass rate per held-out kind beside their mean.

No Docker is needed: the workspaces are bubblewrap over this host's root file system (`--image /`; a root exported
from a Docker image also works). Reported: held-out pass rates (greedy) of the base model, after SFT and after GRPO,
for held-out seeds and held-out kinds; the train reward curve; the episodes' time split (generation / env /
container, summed over episodes) and the trainer's time per step; wall clock.

`--demo-config examples/terminal_train.yaml` then also runs the CPU demo's config here (its data and steps, this
host's workspaces and device), to see whether its held-out-seed lift holds after a change to the generator.

Usage: python bench/learn_terminal_gpu.py [--budget-min 8] [--backend torch|megatron] [--out DIR] [--demo-config Y]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GEN = "slime_env.envs.terminal:terminal_tasks"
TEACHER = "slime_env.envs.terminal.teacher:teacher_reply"


def config(args):
    from slime_env.trainers.run import TrainConfig

    from slime_env.envs.terminal.kinds import HELDOUT_KINDS

    seeds = {"generator": GEN, "n": args.eval_n, "seed": 2, "split": "test"}
    per_kind = max(1, args.eval_n // len(HELDOUT_KINDS))
    kinds = {f"kind_{k}": {"data": {"generator": GEN, "n": per_kind, "seed": 3, "kinds": [k]}} for k in HELDOUT_KINDS}
    cfg = {
        "run_dir": args.run_dir, "model": args.model, "env": "Terminal-v0",
        "env_kwargs": {"max_turns": args.max_turns, "image": args.image},
        "train_data": {"generator": GEN, "n": 4096, "seed": 1, "split": "train"},
        "eval_data": seeds,
        "eval": {"sets": kinds, "every": args.eval_every},
        "steps": args.steps, "prompts_per_step": args.prompts, "n_samples_per_prompt": args.n,
        "max_turns": args.max_turns, "max_new_tokens": args.max_new_tokens, "temperature": 1.0,
        "eval_every": args.eval_every, "max_concurrency": args.concurrency, "time_budget_s": args.train_budget_s,
        "seed": 0, "device": args.device, "save_every": 0,
        "trainer": {"backend": args.backend, "estimator": "grpo", "lr": args.lr, "micro_batch_size": args.micro_batch,
                    "max_grad_norm": 1.0},
        "warmup": {"steps": args.sft_steps, "lr": args.sft_lr, "batch_size": args.sft_batch,
                   "data": {"rollouts": {"policy": TEACHER, "min_reward": 1.0, "max_tasks": args.sft_tasks}}},
    }
    return TrainConfig.from_dict(cfg, "bench/learn_terminal_gpu.py")


def check_workspaces(image: str, log) -> None:
    """One task's teacher episode and a do-nothing one in a real workspace: 1 and 0, or stop here."""
    from slime_env import ScriptedPolicy, get_renderer, run_episode
    from slime_env.envs.terminal.env import TerminalEnv
    from slime_env.envs.terminal.tasks import terminal_tasks
    from slime_env.envs.terminal.teacher import call, teacher_reply
    from slime_env.offline_tokenizers import smollm2

    async def main():
        tok, task = smollm2(), terminal_tasks(1, seed=9, split="test")[0]
        env = TerminalEnv(image=image)
        try:
            good = await run_episode(env, ScriptedPolicy(tok, teacher_reply), task, renderer=get_renderer(tok),
                                     max_turns=4)
            nop = await run_episode(env, ScriptedPolicy(tok, [call("submit")]), task, renderer=get_renderer(tok),
                                    max_turns=4)
        finally:
            await env.close()
        return good, nop

    t = time.perf_counter()
    good, nop = asyncio.run(main())
    log(f"workspace check ({image}): teacher {good.status} {good.reward}, nop {nop.status} {nop.reward} "
        f"in {time.perf_counter() - t:.1f}s")
    if good.reward != 1.0 or nop.reward != 0.0:
        raise SystemExit(f"workspaces do not verify here: teacher {good.status} {good.reason}, nop {nop.reward}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--image", default="/", help="the workspaces' root: / (this host's, under bubblewrap) or an image")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--model", default="default")
    ap.add_argument("--backend", default="torch", choices=["megatron", "torch"])
    ap.add_argument("--steps", type=int, default=200, help="upper bound; the time budget usually ends the run")
    ap.add_argument("--budget-min", type=float, default=8.0, help="the whole script")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--lr", type=float, default=5e-6)
    ap.add_argument("--sft-steps", type=int, default=40)
    ap.add_argument("--sft-lr", type=float, default=1e-4)
    ap.add_argument("--sft-batch", type=int, default=32)
    ap.add_argument("--sft-tasks", type=int, default=1024, help="teacher episodes (13 kinds x 4 paraphrases)")
    ap.add_argument("--micro-batch", type=int, default=32)
    ap.add_argument("--eval-n", type=int, default=96)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--concurrency", type=int, default=64, help="episodes in flight")
    ap.add_argument("--run-dir", default="runs/learn_terminal_gpu")
    ap.add_argument("--out", default=None, help="also copy the summary and metrics.jsonl here")
    ap.add_argument("--demo-config", default=None, help="then run this YAML config too (module docstring)")
    args = ap.parse_args()
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)

    run = Path(args.run_dir).resolve()
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    args.run_dir = str(run)
    # the task folders and the workspaces' layers on the root file system (bubblewrap over / shows other mounts, a
    # tmpfs /tmp among them, as empty folders)
    os.environ.setdefault("SLIME_ENV_TERMINAL_TASKS", str(run / "tasks"))
    if args.image == "/" and "SLIME_ENV_WORKSPACE_DIR" not in os.environ:
        os.environ["SLIME_ENV_WORKSPACE_DIR"] = tempfile.mkdtemp(prefix="ws-", dir=run)
    check_workspaces(args.image, log)
    args.train_budget_s = max(60.0, args.budget_min * 60 - (time.perf_counter() - t0) - 45)
    from slime_env.trainers.run import train

    summary = asyncio.run(train(config(args)))
    rows = [json.loads(line) for line in open(summary["metrics"])]
    report(args, rows, summary, time.perf_counter() - t0)
    if args.demo_config:
        demo(args, log)


def demo(args, log) -> None:
    """The YAML config `args.demo_config` on this host (its run_dir under this run's, `image` and device this run's);
    its held-out pass rates by stage."""
    from slime_env.trainers.run import TrainConfig, train

    run_dir = Path(args.run_dir) / "demo"
    cfg = TrainConfig.from_yaml(args.demo_config, run_dir=str(run_dir), device=args.device, env_kwargs={
        "max_turns": args.max_turns, "image": args.image})
    summary = asyncio.run(train(cfg))
    rows = [json.loads(line) for line in open(summary["metrics"])]
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    log(f"demo config {args.demo_config}: held-out seeds by stage (step, pass rate) {evals}")
    if args.out:
        shutil.copy(summary["metrics"], os.path.join(args.out, "demo_metrics.jsonl"))


def report(args, rows, summary, wall_s) -> None:
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    from slime_env.envs.terminal.kinds import HELDOUT_KINDS

    evals = [r for r in rows if "eval/accuracy" in r]
    steps = [r for r in rows if "train/reward_mean" in r]
    kinds = "eval/heldout_kinds/accuracy"
    per_kind = [f"eval/kind_{k}/accuracy" for k in HELDOUT_KINDS]
    for r in evals:  # the held-out kinds' mean (equal-sized sets)
        if all(k in r for k in per_kind):
            r[kinds] = sum(r[k] for k in per_kind) / len(per_kind)

    def total(key):
        return round(sum(r.get(key, 0.0) for r in steps), 1)

    def stage(key):  # base, after the warm-up, last
        vals = [r[key] for r in evals if key in r]
        return {"base": vals[0], "after_sft": vals[1], "after_grpo": vals[-1]} if len(vals) >= 3 else vals

    split = {"generate_s": total("rollout/time/generate_s"), "env_s": total("rollout/time/env_s"),
             "container_s": total("rollout/time/container_s"), "framework_s": total("rollout/time/framework_s"),
             "train_s": total("train/step_s")}
    episode_s = split["generate_s"] + split["env_s"] + split["framework_s"]  # the episodes' time, summed
    out = {
        "device": device, "trainer": args.backend, "image": args.image, "wall_clock_min": round(wall_s / 60, 2),
        "heldout_seeds_greedy": stage("eval/accuracy"), "heldout_kinds_greedy": stage(kinds),
        "heldout_kind_greedy": {k: stage(f"eval/kind_{k}/accuracy") for k in HELDOUT_KINDS},
        "all_evals": [(r["step"], r["eval/accuracy"], r.get(kinds)) for r in evals],
        "train_reward_curve": [(r["step"], round(r["train/reward_mean"], 3)) for r in steps],
        "grpo_steps": len(steps), "warmup": {k: v for k, v in evals[1].items() if k.startswith("warmup/")}
        if len(evals) > 1 else {},
        "episode_time_split_s": {**split, **{f"{k[:-2]}_frac": round(split[k] / max(episode_s, 1e-9), 3)
                                             for k in ("generate_s", "env_s", "container_s", "framework_s")}},
        "metrics": summary["metrics"],
    }
    print("\nsummary " + json.dumps(out, indent=1))
    s, k = out["heldout_seeds_greedy"], out["heldout_kinds_greedy"]
    print(f"\nheld-out seeds: {s}; held-out kinds: {k}; {len(steps)} GRPO steps in {wall_s / 60:.1f} min on {device}")
    (Path(args.run_dir) / "summary.json").write_text(json.dumps(out, indent=1))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        shutil.copy(Path(args.run_dir) / "summary.json", os.path.join(args.out, "learn_terminal_gpu_summary.json"))
        shutil.copy(summary["metrics"], os.path.join(args.out, "learn_terminal_gpu_metrics.jsonl"))


if __name__ == "__main__":
    main()
