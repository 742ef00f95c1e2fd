"""Code grading throughput: HumanEval canonical solutions graded per second, per sandbox backend, beside a
naive baseline in the same run, on two workloads: every problem once (164 submissions, each problem new
to the grader) and RL-shaped groups (`--group` samples of each of the first `--problems` problems).

Baseline: one `subprocess.run([sys.executable, file])` per submission (solution + test + `check(...)`
concatenated in a temp file), one after another, no sandbox, no pool, no per-test results — what
many RL code graders do. Ours: `Grader` on each backend, with `--concurrency` submissions in flight:
the solution's sandbox run records its calls, and the test code is replayed on them in sandbox runs
that hold no solution (the first replay of a problem is cached; replays share runs under load).
Anchor: SandboxFusion grades ≈14.9 problems/s on 64 cores (≈0.23 per core per second); target
≥ 10 problems/s per core. Usage: python bench/code.py [--concurrency 4] [--backends docker,bwrap,process]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slime_env.envs.code import Grader, load_humaneval, parse_tests  # noqa: E402


def naive(tasks) -> tuple[float, int]:
    passed = 0
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for i, t in enumerate(tasks):
            path = os.path.join(tmp, f"p{i}.py")
            with open(path, "w") as f:
                f.write(t.metadata["prompt_code"] + t.metadata["canonical_solution"] + "\n\n" + t.label["test"]
                        + f"\n\ncheck({t.label['entry_point']})\n")
            passed += subprocess.run([sys.executable, path], capture_output=True, timeout=60).returncode == 0
    return time.perf_counter() - t0, passed


async def ours(tasks, sandbox, concurrency: int) -> tuple[float, int]:
    grader = Grader(sandbox)
    sem = asyncio.Semaphore(concurrency)
    warm = Grader(sandbox)

    async def one(t):
        async with sem:
            return await grader.grade(t.metadata["prompt_code"] + t.metadata["canonical_solution"],
                                      parse_tests(t.label))

    await warm.grade("pass", parse_tests(tasks[0].label))  # warm-up (pool start, page cache), not in `grader`
    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(t) for t in tasks))
    return time.perf_counter() - t0, sum(r.all_passed for r in results)


def make(backend: str, concurrency: int):
    if backend == "docker":
        from slime_env.tools_sandbox.docker_pool import DockerSandbox

        return DockerSandbox(pool_size=concurrency)
    if backend == "bwrap":
        from slime_env.tools_sandbox.bwrap import BwrapSandbox

        return BwrapSandbox(max_concurrency=concurrency)
    from slime_env.tools_sandbox.process import ProcessSandbox

    return ProcessSandbox(max_concurrency=concurrency)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--backends", default="docker,bwrap,process")
    ap.add_argument("--group", type=int, default=8, help="samples per problem in the RL-shaped workload")
    ap.add_argument("--problems", type=int, default=40, help="problems in the RL-shaped workload")
    args = ap.parse_args()
    tasks = load_humaneval()
    cores = os.cpu_count() or 1
    workloads = {f"every problem once ({len(tasks)})": tasks,
                 f"groups: {args.problems} problems x {args.group} samples": [
                     t for t in tasks[:args.problems] for _ in range(args.group)]}
    for title, items in workloads.items():
        base_t, base_ok = naive(items)
        rows = [("naive subprocess.run (baseline)", base_t, base_ok)]
        for backend in args.backends.split(","):
            sandbox = make(backend, args.concurrency)

            async def run():
                try:
                    return await ours(items, sandbox, args.concurrency)
                finally:
                    await sandbox.close()

            took, ok = asyncio.run(run())
            rows.append((f"Grader + {sandbox.describe()}", took, ok))
        print(f"\nHumanEval canonical solutions, {title}: {len(items)} submissions, {cores} cores, "
              f"concurrency {args.concurrency}\n")
        print(f"{'grader':60s} {'passed':>9s} {'submissions/s':>14s} {'per core':>9s} {'vs baseline':>12s}")
        for name, took, ok in rows:
            rate = len(items) / took
            print(f"{name:60s} {ok:4d}/{len(items):<4d} {rate:14.1f} {rate / cores:9.1f} {base_t / took:11.2f}x")


if __name__ == "__main__":
    main()
