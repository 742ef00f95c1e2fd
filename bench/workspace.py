"""Workspace start and command latency, and many workspaces at once,
beside `docker run` / `docker exec` in the same run.

Rows (each backend that runs here; Docker and bubblewrap):
- start from the warm pool (p50 of `pool.acquire`), cold start (`open_workspace`: container or bubblewrap root up and
  its agent answering) — beside the baseline `docker run --rm IMAGE true` (the CLI, one container start and stop);
- `exec(["true"])` p50 / p99 — beside `docker exec CONTAINER true` on the same container;
- N workspaces open at once (default 64), a command in each at the same time: wall time, failures, and the memory a
  workspace costs (host-side: the rise of the host's used memory per workspace; inside: the container's cgroup usage).
Targets on the 2-core machine: warm start p50 <= 50 ms, exec p50 <= 15 ms over Docker, 64 concurrent workspaces hold.
Usage: python bench/workspace.py [--image python:3.11-slim] [--runs 50] [--concurrent 64] [--backends docker bwrap]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slime_env.tools_sandbox.workspace import Limits, WorkspaceSpec  # noqa: E402
from slime_env.tools_sandbox.workspace.open import open_workspace  # noqa: E402
from slime_env.tools_sandbox.workspace.pool import WorkspacePool  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return 1000 * xs[min(len(xs) - 1, int(q * len(xs)))]


def used_memory_mb() -> float:
    info = dict(line.split(":", 1) for line in open("/proc/meminfo"))
    kb = lambda k: int(info[k].split()[0])  # noqa: E731
    return (kb("MemTotal") - kb("MemAvailable")) / 1024


def docker_run_baseline(image: str, runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(["docker", "run", "--rm", "--network", "none", image, "true"], check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return times


def docker_exec_baseline(container_id: str, runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(["docker", "exec", container_id, "true"], check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return times


async def bench_backend(backend: str, image: str, runs: int, concurrent: int) -> None:
    spec = WorkspaceSpec(image=image, workdir="/app", limits=Limits(memory_mb=512, pids=256))
    print(f"\n== {backend}")
    cold = []
    for _ in range(max(3, runs // 10)):
        t0 = time.perf_counter()
        ws = await open_workspace(spec, backend=backend)
        cold.append(time.perf_counter() - t0)
        await ws.close()
    print(f"cold start           p50 {pct(cold, 0.5):8.1f} ms   p99 {pct(cold, 0.99):8.1f} ms")
    if backend == "docker":
        base = docker_run_baseline(image, max(3, runs // 10))
        print(f"  baseline docker run p50 {pct(base, 0.5):8.1f} ms   (docker run --rm {image} true)")

    async with WorkspacePool(backend=backend, warm=4) as pool:
        ws = await pool.acquire(spec)
        await pool.release(ws)
        warm = []
        for _ in range(runs):
            while not pool._ready[spec.pool_key()]:
                await asyncio.sleep(0.05)
            t0 = time.perf_counter()
            ws = await pool.acquire(spec)
            warm.append(time.perf_counter() - t0)
            await pool.release(ws)
        print(f"warm start (pool)    p50 {pct(warm, 0.5):8.2f} ms   p99 {pct(warm, 0.99):8.2f} ms   "
              f"target p50 <= 50 ms")

        ws = await pool.acquire(spec)
        for _ in range(5):
            await ws.exec(["true"])
        lat = []
        for _ in range(runs * 4):
            t0 = time.perf_counter()
            r = await ws.exec(["true"])
            lat.append(time.perf_counter() - t0)
            assert r.ok, r
        print(f"exec true            p50 {pct(lat, 0.5):8.2f} ms   p99 {pct(lat, 0.99):8.2f} ms   "
              f"target p50 <= 15 ms (Docker)")
        if backend == "docker":
            base = docker_exec_baseline(ws.container.id, runs)
            print(f"  baseline docker exec p50 {pct(base, 0.5):8.1f} ms  (same container)")
        await pool.release(ws)

    before = used_memory_mb()
    t0 = time.perf_counter()
    results = await asyncio.gather(*(open_workspace(spec, backend=backend) for _ in range(concurrent)),
                                   return_exceptions=True)
    opened = [w for w in results if not isinstance(w, BaseException)]
    start_wall = time.perf_counter() - t0
    await asyncio.sleep(2)
    after = used_memory_mb()
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(w.exec("python3 -c 'print(sum(range(10**5)))'", timeout_s=120) for w in opened),
                                return_exceptions=True)
    run_wall = time.perf_counter() - t0
    ok = sum(1 for o in outs if not isinstance(o, BaseException) and o.ok)
    inside = []
    if backend == "docker":
        for w in opened[:8]:
            r = await w.exec(["cat", "/sys/fs/cgroup/memory/memory.usage_in_bytes"])
            if r.ok and r.stdout.strip().isdigit():
                inside.append(int(r.stdout) / 2**20)
    await asyncio.gather(*(w.close() for w in opened))
    print(f"{concurrent} at once        started {len(opened)}/{concurrent} in {start_wall:.1f} s, a command in each: "
          f"{ok}/{len(opened)} ok in {run_wall:.1f} s")
    print(f"  memory per workspace: {(after - before) / max(1, len(opened)):.1f} MB on the host"
          + (f", {statistics.median(inside):.1f} MB in its cgroup (median)" if inside else ""))
    errors = [w for w in results if isinstance(w, BaseException)]
    if errors:
        print(f"  first start error: {errors[0]}")


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--image", default="python:3.11-slim")
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--concurrent", type=int, default=64)
    ap.add_argument("--backends", nargs="+", default=["docker", "bwrap"])
    args = ap.parse_args()
    from slime_env.tools_sandbox.workspace.base_images import ensure_base_image

    ensure_base_image(args.image)
    print(f"image {args.image}, {os.cpu_count()} CPUs")
    for backend in args.backends:
        await bench_backend(backend, args.image, args.runs, args.concurrent)


if __name__ == "__main__":
    asyncio.run(main())
