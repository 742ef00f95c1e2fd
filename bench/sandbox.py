"""Sandbox latency and throughput: every backend beside a bare subprocess and a per-call `docker run`.

For `print(1)` and for a ~50 ms compute snippet, at concurrency 1, 4 and 16: p50 / p99 latency per
run and executions per second, for
- baseline `subprocess`: `subprocess.run([sys.executable, "-c", code])` (no isolation, no limits);
- baseline `docker run`: one `docker run --rm --network none IMAGE python3 -c code` per call;
- ours: ProcessSandbox, BwrapSandbox (cgroups when root), BwrapSandbox(fork_server=True), DockerSandbox
  (warm pool of 16).
All in one run on the same machine. Usage: python bench/sandbox.py [--runs N] [--skip-docker-run]
[--backends process bwrap bwrap_fork docker]. Targets on 2 cores: bwrap fork server p50 <= 8 ms and >= 2x the
per-run bwrap's runs/s at concurrency 4, docker warm pool p50 <= 70 ms (print(1), concurrency 1).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slime_env.tools_sandbox.docker_pool import DEFAULT_IMAGE  # noqa: E402


def calibrate_snippet(target_s: float = 0.05) -> str:
    n = 200_000
    while True:
        code = f"s = 0\nfor i in range({n}):\n    s += i * i\nprint(s)"
        t0 = time.perf_counter()
        exec(compile(code.replace("print(s)", ""), "<snippet>", "exec"), {})
        took = time.perf_counter() - t0
        if took >= target_s * 0.9:
            return code
        n = int(n * target_s / max(took, 1e-4) * 1.02)


def stats(latencies: list[float], wall: float) -> dict[str, float]:
    xs = sorted(latencies)
    return {"p50_ms": 1000 * statistics.median(xs), "p99_ms": 1000 * xs[min(len(xs) - 1, int(0.99 * len(xs)))],
            "per_s": len(xs) / wall}


def run_threads(fn, runs: int, concurrency: int) -> dict[str, float]:
    latencies = []

    def one(_):
        t0 = time.perf_counter()
        fn()
        latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(runs)))
    return stats(latencies, time.perf_counter() - t0)


async def run_sandbox(sandbox, code: str, runs: int, concurrency: int) -> dict[str, float]:
    latencies = []
    sem = asyncio.Semaphore(concurrency)

    async def one():
        async with sem:
            t0 = time.perf_counter()
            result = await sandbox.run(code, timeout_s=30)
            latencies.append(time.perf_counter() - t0)
            if result.status != "ok":
                raise RuntimeError(f"{sandbox.backend}: {result}")

    for _ in range(3):  # warm-up (pool start, page cache)
        await one()
    latencies.clear()
    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(runs)))
    return stats(latencies, time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=60, help="runs per cell at concurrency 1 (x2 at 4, x4 at 16)")
    ap.add_argument("--skip-docker-run", action="store_true", help="leave out the per-call docker run baseline")
    ap.add_argument("--backends", nargs="+", default=["process", "bwrap", "bwrap_fork", "docker"],
                    choices=["process", "bwrap", "bwrap_fork", "docker"])
    args = ap.parse_args()
    snippet = calibrate_snippet()
    codes = {"print(1)": "print(1)", "50ms compute": snippet}
    levels = (1, 4, 16)
    rows: list[tuple[str, str, int, dict[str, float]]] = []

    for label, code in codes.items():
        for c in levels:
            runs = args.runs * {1: 1, 4: 2, 16: 4}[c]
            rows.append(("subprocess (baseline)", label, c, run_threads(
                lambda code=code: subprocess.run([sys.executable, "-c", code], capture_output=True, check=True),
                runs, c)))
    if not args.skip_docker_run:
        import docker

        client = docker.from_env()
        for label, code in codes.items():
            for c in levels:
                runs = max(8, args.runs // 4) * {1: 1, 4: 2, 16: 4}[c]
                rows.append(("docker run (baseline)", label, c, run_threads(
                    lambda code=code: client.containers.run(DEFAULT_IMAGE, ["/usr/bin/python3", "-c", code],
                                                            remove=True, network_mode="none"), runs, c)))

    async def ours():
        from slime_env.tools_sandbox.bwrap import BwrapSandbox
        from slime_env.tools_sandbox.docker_pool import DockerSandbox
        from slime_env.tools_sandbox.process import ProcessSandbox

        makers = {"process": lambda: ProcessSandbox(max_concurrency=16),
                  "bwrap": lambda: BwrapSandbox(max_concurrency=16),
                  "bwrap_fork": lambda: BwrapSandbox(max_concurrency=16, fork_server=True),
                  "docker": lambda: DockerSandbox(pool_size=16)}
        for name in args.backends:
            sandbox = makers[name]()
            try:
                for label, code in codes.items():
                    for c in levels:
                        runs = args.runs * {1: 1, 4: 2, 16: 4}[c]
                        rows.append((sandbox.describe(), label, c, await run_sandbox(sandbox, code, runs, c)))
            finally:
                await sandbox.close()

    asyncio.run(ours())
    base = {(label, c): r for name, label, c, r in rows if name.startswith("subprocess")}
    print(f"\n{os.cpu_count()} cores; snippet: {snippet.splitlines()[1].strip()} (~50 ms in-process)\n")
    print(f"{'backend':58s} {'code':13s} {'conc':>4s} {'p50 ms':>8s} {'p99 ms':>8s} {'runs/s':>8s} "
          f"{'p50 vs subprocess':>18s}")
    for name, label, c, r in rows:
        ratio = r["p50_ms"] / base[(label, c)]["p50_ms"]
        print(f"{name:58s} {label:13s} {c:4d} {r['p50_ms']:8.1f} {r['p99_ms']:8.1f} {r['per_s']:8.1f} {ratio:17.2f}x")


if __name__ == "__main__":
    main()
