"""The SWE reward path: one task's hidden-test run, and its share of an episode.

For a few tasks per repository of a task set (examples/swe_tasks by default), in one process on this host:
- `start`: a fresh workspace of the repository image (what the reward starts for every call, concurrently with
  reading the agent's files);
- the reward (`swe_reward` on the oracle's workspace): `read` (the agent's files through the workspace API),
  `guard`, `tests` (FAIL_TO_PASS + PASS_TO_PASS on the clean copy) and `total`;
- a scripted episode of the env side only (start the agent's workspace, 12 tool calls of the kind agents make:
  ls, grep, cat, git diff, the visible tests once, the oracle's edit) followed by the reward: the reward's share of
  it. An LLM's generation time is not included, so this share is an upper bound of the share in real training.

Numbers are p50 over `--reps` rewards per task (the first reward of a repository image also reads its clean files
once; that read is cached per process and shows in the max). Nothing here asserts a time.

    python bench/swe_reward.py [--tasks examples/swe_tasks] [--per-repo 2] [--reps 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections import defaultdict

from slime_env.envs.swe.check import build_task_image, run_oracle, start_agent_workspace
from slime_env.envs.swe.reward import reward_workspace_spec, swe_reward
from slime_env.envs.swe.task import find_tasks, load_task


def p50(xs):
    return statistics.median(xs) if xs else float("nan")


async def episode_tools(ws, task) -> int:
    """The tool calls of a short scripted episode (exploration, one visible test run, the fix)."""
    from slime_env.envs.swe import grade

    src = task.source_dir
    calls = [f"ls -la /repo /repo/{src}", f"grep -rn 'def ' {src} | head -50",
             f"cat {task.mutation['file']} | head -200",
             "git status --short", f"grep -rn 'import' {src}/__init__.py | head", "git log --oneline | head -3",
             f"find {src} -name '*.py' | head -40", "python3 --version"]
    for c in calls:
        await ws.exec(c, cwd="/repo", timeout_s=60)
    visible = [p for p in task.test_paths]
    await ws.exec(grade.pytest_argv(visible, task.deselect, "/tmp/visible.xml"), cwd="/repo", timeout_s=600,
                  env=grade.PYTEST_ENV)
    await run_oracle(task, ws)
    await ws.exec("git diff --stat", cwd="/repo")
    await ws.exec("git diff", cwd="/repo")
    return len(calls) + 4


async def bench_task(task, reps: int) -> dict:
    from slime_env.tools_sandbox.workspace import open_workspace

    image = await build_task_image(task)
    out = defaultdict(list)
    try:
        for _ in range(reps):
            t = time.monotonic()
            ws = await open_workspace(reward_workspace_spec(task))
            out["start"].append(time.monotonic() - t)
            await ws.close()
        for _ in range(reps):
            t = time.monotonic()
            ws = await start_agent_workspace(task, image)
            try:
                n = await episode_tools(ws, task)
                env_s = time.monotonic() - t
                r = await swe_reward(task, ws)
            finally:
                await ws.close()
            if r.reward != 1.0:
                raise RuntimeError(f"{task.name}: the oracle earned {r.reward}: {r.reason}")
            for k in ("read", "guard", "tests", "total"):
                out[k].append(r.timings.get(k, float("nan")))
            out["episode"].append(env_s + r.timings["total"])
            out["share"].append(r.timings["total"] / (env_s + r.timings["total"]))
            out["tools"].append(n)
    finally:
        from slime_env.envs.swe.check import _remove_image

        await asyncio.to_thread(_remove_image, image)
    return out


async def main(args) -> None:
    by_repo = defaultdict(list)
    for folder in find_tasks(args.tasks):
        task = load_task(folder)
        if len(by_repo[task.repo]) < args.per_repo:
            by_repo[task.repo].append(task)
    print(f"{'repository':<16} {'tests':>5} {'start':>7} {'read':>7} {'guard':>7} {'hidden tests':>12} "
          f"{'reward':>7} {'episode':>8} {'share':>6}   (p50 seconds over {args.reps} rewards x "
          f"{args.per_repo} tasks)")
    for repo, tasks in by_repo.items():
        agg = defaultdict(list)
        for task in tasks:
            for k, v in (await bench_task(task, args.reps)).items():
                agg[k] += v
        n_tests = len(tasks[0].fail_to_pass) + len(tasks[0].pass_to_pass)
        print(f"{repo:<16} {n_tests:>5} {p50(agg['start']):>7.2f} {p50(agg['read']):>7.3f} {p50(agg['guard']):>7.3f} "
              f"{p50(agg['tests']):>12.2f} {p50(agg['total']):>7.2f} {p50(agg['episode']):>8.2f} "
              f"{100 * p50(agg['share']):>5.0f}%   (reward max {max(agg['total']):.2f}s)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="examples/swe_tasks")
    ap.add_argument("--per-repo", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    asyncio.run(main(ap.parse_args()))
