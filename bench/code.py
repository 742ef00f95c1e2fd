"""Code grading throughput: HumanEval's 164 canonical solutions graded per second, per sandbox backend,
beside a naive baseline in the same run.

Baseline: one `subprocess.run([sys.executable, file])` per problem (solution + test + `check(...)`
concatenated in a temp file), one after another, no sandbox, no pool, no per-test results — what
many RL code graders do. Ours: `Grader` (one sandbox run per problem; per-assert results and time limits;
comparisons outside the sandbox) on each backend, with `--concurrency` problems in flight.
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

from envs.code import Grader, load_humaneval, parse_tests  # noqa: E402


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

    async def one(t):
        async with sem:
            return await grader.grade(t.metadata["prompt_code"] + t.metadata["canonical_solution"], parse_tests(t.label))

    await one(tasks[0])  # warm-up: pool start, page cache
    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(t) for t in tasks))
    return time.perf_counter() - t0, sum(r.all_passed for r in results)


def make(backend: str, concurrency: int):
    if backend == "docker":
        from tools_sandbox.docker_pool import DockerSandbox

        return DockerSandbox(pool_size=concurrency)
    if backend == "bwrap":
        from tools_sandbox.bwrap import BwrapSandbox

        return BwrapSandbox(max_concurrency=concurrency)
    from tools_sandbox.process import ProcessSandbox

    return ProcessSandbox(max_concurrency=concurrency)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--backends", default="docker,bwrap,process")
    args = ap.parse_args()
    tasks = load_humaneval()
    cores = os.cpu_count() or 1
    base_t, base_ok = naive(tasks)
    rows = [("naive subprocess.run (baseline)", base_t, base_ok)]
    for backend in args.backends.split(","):
        sandbox = make(backend, args.concurrency)

        async def run():
            try:
                return await ours(tasks, sandbox, args.concurrency)
            finally:
                await sandbox.close()

        took, ok = asyncio.run(run())
        rows.append((f"Grader + {sandbox.describe()}", took, ok))
    print(f"\nHumanEval canonical solutions, {len(tasks)} problems, {cores} cores, concurrency {args.concurrency}\n")
    print(f"{'grader':72s} {'passed':>7s} {'problems/s':>11s} {'per core':>9s} {'vs baseline':>12s}")
    for name, took, ok in rows:
        rate = len(tasks) / took
        print(f"{name:72s} {ok:4d}/{len(tasks)} {rate:11.1f} {rate / cores:9.1f} {base_t / took:11.2f}x")


if __name__ == "__main__":
    main()
