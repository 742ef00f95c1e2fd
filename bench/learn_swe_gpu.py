"""The SWE learning check on one GPU: SmolLM2-135M-Instruct, an SFT warm-up on a scripted teacher's successful
episodes, then GRPO, on SWE-style bug-fix tasks (examples/swe_tasks, `Harbor-v0`); held-out = every task of a
repository never trained on.

No Docker and no internet are needed on the GPU machine: each pinned repository is unpacked from its sdist (a
folder, `--sdists`, filled here beforehand with `--fetch-sdists DIR`) into a clean folder, and every workspace is
bubblewrap over the host's root file system (`slime_env.envs.swe.local`): the agent's has /repo = the clean
repository with the task's bug.patch applied and its hidden tests removed; the reward (`swe_reward`) runs the hidden
tests in a fresh one with /repo = the clean repository. Both plug into Harbor-v0 as its `workspace` and
`reward_workspace` factories.

1. Oracle/nop check of every task used on these workspaces (the teacher's edits earn 1, the unchanged checkout 0);
   tasks that do not check on this host's Python are dropped (reported).
2. Train on the tasks of the other repositories, hold out all tasks of `--heldout` (default toolz).
3. Warm-up: SFT on the teacher's successful episodes (`slime_env.envs.swe.teacher:teacher_reply`: it reads the
   task's bug.patch — the student never sees it — and searches for the function the report names, views the bugged
   lines, reverts them with `str_replace_editor`, submits; rejection-sampled: reward 1 only).
4. GRPO (Megatron trainer, embedded engine, same GPU) until the time budget.
Reported: held-out pass rate (greedy; pass@k sampled) of the base model, after SFT, after GRPO; the train reward
curve; per-step time split (generation / container / training); wall-clock. Target: the whole script <= 20 min on
one H100. A 135M model is expected to learn the episode's shape (search, view, edit, submit in hermes tool calls)
long before it learns to find and fix an unseen bug: the held-out numbers say which.

Usage: python bench/learn_swe_gpu.py --fetch-sdists .gpu/sdists        (here, with internet)
       python bench/learn_swe_gpu.py --sdists .gpu/sdists [--budget-min 20]   (on the GPU machine, as root)
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

from slime_env.envs.swe import local  # noqa: E402
from slime_env.envs.swe.task import find_tasks, load_task  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEACHER = "slime_env.envs.swe.teacher:teacher_reply"


def pick_workspace_dir(repo: str, log) -> None:
    """Where workspaces' overlay layers go: $SLIME_ENV_WORKSPACE_DIR if set, else the first of the temporary
    folder, a tmpfs of our own (an overlay's upper layer cannot be on overlayfs, a container's usual root) and
    /dev/shm where a local workspace starts and runs python + pytest."""
    given = os.environ.get("SLIME_ENV_WORKSPACE_DIR")
    candidates = [given] if given else [tempfile.gettempdir(), "/mnt/slime_env_ws", "/dev/shm/slime_env_ws"]
    errors = []
    for d in candidates:
        os.makedirs(d, exist_ok=True)
        if d == "/mnt/slime_env_ws" and not os.path.ismount(d):
            os.system(f"mount -t tmpfs -o size=16g,mode=0755 tmpfs {d} 2>/dev/null")
        os.environ["SLIME_ENV_WORKSPACE_DIR"] = d
        try:
            log(f"workspaces in {d}: {asyncio.run(local.check(repo))} (python, pytest inside)")
            return
        except Exception as e:  # noqa: BLE001 - try the next folder
            errors.append(f"{d}: {type(e).__name__}: {str(e)[:600]}")
    raise SystemExit("no folder for local workspaces works:\n" + "\n".join(errors))


async def check_tasks(folders: list[Path], concurrency: int, log) -> tuple[list[Path], list[dict]]:
    """The oracle/nop check of each task folder, `concurrency` at a time; (the tasks that check, all results)."""
    sem = asyncio.Semaphore(concurrency)

    async def one(folder: Path) -> dict:
        async with sem:
            try:
                return {"task": folder.name, **await local.check_task(folder)}
            except Exception as e:  # noqa: BLE001 - a task that cannot be set up is dropped, with its reason
                return {"task": folder.name, "ok": False, "why": f"{type(e).__name__}: {str(e)[:300]}"}

    results = await asyncio.gather(*(one(f) for f in folders))
    for r in results:
        if not r["ok"]:
            log(f"  dropped {r['task']}: {r['why']}")
    return [f for f, r in zip(folders, results) if r["ok"]], list(results)


def config(args, tasks_dir: Path, train_repos: list[str]):
    from slime_env.trainers.run import TrainConfig

    gen = "slime_env.envs.swe:swe_tasks"
    env_kwargs = {"workspace": "slime_env.envs.swe.local:agent_workspace",
                  "reward_workspace": "slime_env.envs.swe.local:clean_workspace",
                  "max_turns": args.max_turns, "command_timeout_s": 60.0}
    heldout = {"generator": gen, "path": str(tasks_dir), "repos": [args.heldout]}
    cfg = {
        "run_dir": args.run_dir, "model": args.model, "env": "Harbor-v0", "env_kwargs": env_kwargs,
        "train_data": {"generator": gen, "path": str(tasks_dir), "repos": train_repos},
        "eval_data": heldout,
        "steps": args.steps, "prompts_per_step": args.prompts, "n_samples_per_prompt": args.n,
        "max_turns": args.max_turns, "max_new_tokens": args.max_new_tokens, "temperature": 1.0,
        "eval_every": args.eval_every, "max_concurrency": args.concurrency,
        "time_budget_s": args.train_budget_s, "seed": 0, "device": args.device, "save_every": 0,
        "trainer": {"backend": args.backend, "estimator": "grpo", "lr": args.lr, "micro_batch_size": args.micro_batch,
                    "max_tokens_per_micro_batch": 16384, "max_grad_norm": 1.0},
        "warmup": {"steps": args.sft_steps, "lr": args.sft_lr, "batch_size": args.sft_batch,
                   "data": {"rollouts": {"policy": TEACHER, "min_reward": 1.0}}},
    }
    if args.pass_k > 1:
        cfg["eval"] = {"sets": {"sampled": {"data": heldout, "n_samples": args.pass_k, "temperature": 1.0}},
                       "every": args.eval_every}
    return TrainConfig.from_dict(cfg, "bench/learn_swe_gpu.py")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fetch-sdists", metavar="DIR", help="download the pinned sdists and test wheels into DIR; exit")
    ap.add_argument("--sdists", default=str(ROOT / ".gpu" / "sdists"), help="the folder --fetch-sdists filled")
    ap.add_argument("--tasks", default=str(ROOT / "examples" / "swe_tasks"))
    ap.add_argument("--heldout", default="toolz", help="the repository held out (never trained on)")
    ap.add_argument("--per-repo", type=int, default=None, help="at most this many tasks per repository (toy runs)")
    ap.add_argument("--check-only", action="store_true", help="stop after the oracle/nop check")
    ap.add_argument("--stage", default=None, help="where the clean repositories go (default: RUN_DIR/stage)")
    ap.add_argument("--python", default=None, help="the Python the tests run with (default: this one); the "
                    "tests run as nobody, who must be able to run it")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--model", default="default")
    ap.add_argument("--backend", default="megatron", choices=["megatron", "torch"])
    ap.add_argument("--steps", type=int, default=400, help="upper bound; the time budget usually ends the run")
    ap.add_argument("--budget-min", type=float, default=20.0, help="the whole script, the check included")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-turns", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=384)
    ap.add_argument("--lr", type=float, default=2e-6)
    ap.add_argument("--sft-steps", type=int, default=40)
    ap.add_argument("--sft-lr", type=float, default=5e-5)
    ap.add_argument("--sft-batch", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--pass-k", type=int, default=4, help="samples per held-out task for pass@k (1: greedy only)")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--concurrency", type=int, default=64, help="episodes in flight")
    ap.add_argument("--run-dir", default="runs/learn_swe_gpu")
    ap.add_argument("--copy-to", default=None, help="also copy the summary, curves and metrics.jsonl here")
    args = ap.parse_args()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)

    t0 = time.perf_counter()
    if args.fetch_sdists:
        local.fetch(args.fetch_sdists)
        print(f"sdists and wheels in {args.fetch_sdists}: {sorted(os.listdir(args.fetch_sdists))}")
        return
    run = Path(args.run_dir).resolve()
    if run.exists():
        shutil.rmtree(run)
    run.mkdir(parents=True)
    args.run_dir = str(run)

    # 1. the repositories, the workspaces, the oracle/nop check
    folders = find_tasks(args.tasks)
    by_repo: dict[str, list[Path]] = {}
    for f in folders:
        by_repo.setdefault(load_task(f).repo, []).append(f)
    if args.heldout not in by_repo:
        raise SystemExit(f"--heldout {args.heldout}: no task of it under {args.tasks} (have: {sorted(by_repo)})")
    if args.per_repo:
        by_repo = {r: fs[:args.per_repo] for r, fs in by_repo.items()}
    stage_dir = Path(args.stage or run / "stage")
    local.stage(stage_dir, args.sdists, repos=sorted(by_repo), hide=[args.tasks, args.sdists], python=args.python,
                log=log)
    os.environ[local.STAGE_ENV] = str(stage_dir)
    pick_workspace_dir(args.heldout, log)
    used = [f for fs in by_repo.values() for f in fs]
    log(f"oracle/nop check of {len(used)} tasks ({', '.join(f'{r}: {len(fs)}' for r, fs in by_repo.items())})")
    concurrency = max(1, (os.cpu_count() or 2) - 2)
    ok, results = asyncio.run(check_tasks(used, concurrency, log))
    check_s = time.perf_counter() - t0
    (run / "task_check.json").write_text(json.dumps(results, indent=1))
    log(f"oracle/nop check: {len(ok)} of {len(used)} tasks check ({len(used) - len(ok)} dropped) in {check_s:.0f}s")
    if args.check_only:
        return
    tasks_dir = run / "tasks"  # the tasks that checked, as links: the generator's and the teacher's dataset
    tasks_dir.mkdir()
    for f in ok:
        (tasks_dir / f.name).symlink_to(Path(f).resolve())
    os.environ["SLIME_ENV_SWE_TASKS"] = str(tasks_dir)
    counts = {r: sum(1 for f in ok if f in fs) for r, fs in by_repo.items()}
    train_repos = sorted(r for r in counts if r != args.heldout and counts[r])
    if not train_repos or not counts[args.heldout]:
        raise SystemExit(f"nothing to train or to hold out after the check: {counts}")
    log(f"train: {', '.join(f'{r} ({counts[r]})' for r in train_repos)}; held out: {args.heldout} "
        f"({counts[args.heldout]} tasks)")

    # 2-4. SFT warm-up, GRPO, the held-out evals
    args.train_budget_s = max(60.0, args.budget_min * 60 - check_s - 60)
    from slime_env.trainers.run import train

    summary = asyncio.run(train(config(args, tasks_dir, train_repos)))
    rows = [json.loads(line) for line in open(summary["metrics"])]
    report(args, rows, summary, counts, len(used), len(ok), check_s, time.perf_counter() - t0, train_repos)


def report(args, rows, summary, counts, n_used, n_ok, check_s, wall_s, train_repos) -> None:
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    pk = f"eval/sampled/pass@{args.pass_k}"
    print(f"\nstep  elapsed_s  train_reward  heldout_greedy  heldout_{pk.rsplit('/', 1)[1]}  step_s  gen_s  "
          f"container_s  train_s")
    for r in rows:
        def f(key, fmt=".3f"):
            return format(r[key], fmt) if key in r else ""
        print(f"{r['step']:4d} {r.get('time/elapsed_s', 0):10.0f} {f('train/reward_mean'):>13s} "
              f"{f('eval/accuracy'):>15s} {f(pk):>15s} {f('time/step_s', '.1f'):>7s} "
              f"{f('rollout/time/generate_s', '.0f'):>6s} {f('rollout/time/container_s', '.0f'):>12s} "
              f"{f('train/step_s', '.1f'):>8s}")
    evals = [r for r in rows if "eval/accuracy" in r]
    sampled = [r for r in rows if pk in r]
    steps = [r for r in rows if "train/reward_mean" in r]

    def mean(key):
        vals = [r[key] for r in steps if key in r]
        return round(sum(vals) / len(vals), 3) if vals else None

    out = {
        "device": device, "trainer": args.backend, "wall_clock_min": round(wall_s / 60, 2),
        "task_check": {"used": n_used, "checked": n_ok, "dropped": n_used - n_ok, "seconds": round(check_s, 1)},
        "train_repos": {r: counts[r] for r in train_repos}, "heldout_repo": args.heldout,
        "heldout_tasks": counts[args.heldout],
        "heldout_greedy": {"base": summary.get("first_accuracy"), "after_sft": summary.get("after_warmup_accuracy"),
                           "after_grpo": summary.get("last_accuracy")},
        f"heldout_pass@{args.pass_k}": {"base": sampled[0][pk] if sampled else None,
                                        "after_grpo": sampled[-1][pk] if sampled else None,
                                        "all": [(r["step"], r[pk]) for r in sampled]},
        "heldout_greedy_all": [(r["step"], r["eval/accuracy"]) for r in evals],
        "train_reward_curve": [(r["step"], round(r["train/reward_mean"], 3)) for r in steps],
        "grpo_steps": len(steps),
        "mean_step_time_split_s": {"step": mean("time/step_s"), "generation": mean("rollout/time/generate_s"),
                                   "env": mean("rollout/time/env_s"), "container": mean("rollout/time/container_s"),
                                   "training": mean("train/step_s")},
        "metrics": summary["metrics"], "curves": summary.get("curves"),
    }
    print("\nsummary " + json.dumps(out, indent=1))
    print(f"\nheld-out ({args.heldout}, {counts[args.heldout]} tasks, greedy): base {out['heldout_greedy']['base']} -> "
          f"after SFT {out['heldout_greedy']['after_sft']} -> after GRPO {out['heldout_greedy']['after_grpo']} "
          f"({len(steps)} GRPO steps) in {wall_s / 60:.1f} min on {device} (target: <= 20 min on one H100)")
    (Path(args.run_dir) / "summary.json").write_text(json.dumps(out, indent=1))
    if args.copy_to:
        os.makedirs(args.copy_to, exist_ok=True)
        for src, name in ((Path(args.run_dir) / "summary.json", "learn_swe_gpu_summary.json"),
                          (summary["metrics"], "learn_swe_gpu_metrics.jsonl"),
                          (Path(args.run_dir) / "task_check.json", "learn_swe_gpu_task_check.json"),
                          (summary.get("curves"), "learn_swe_gpu.png")):
            if src and Path(src).exists():
                shutil.copy(src, os.path.join(args.copy_to, name))


if __name__ == "__main__":
    main()
