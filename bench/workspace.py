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

`--load`: starts under load instead (issue 58 item 13). `c` episodes run at once, each acquiring a workspace, then
`--turns` times: think (a random 0.5-1.5 x `--think-s`, the model's turn) and `exec(["true"])`, then release; each
episode's end starts the next until `--episodes` per slot have run. Per policy, in one run: start latency p50 / p90
(every start after a slot's first: the first wave is cold under any policy), exec p50 / p90, and the pool's counts
(warm hits, waits for a refill under way, cold starts, refills). Policies: `fixed-4` and `fixed-c` (the pool before:
a fixed `warm`, every missing one started at once, an acquire with none warm starts its own) and `concurrency` (now:
`warm=None`, sized from the run's concurrency, episodes wait for refills under way; `concurrency:R` caps the refills
in flight at R). Numbers: docs/benchmarks.md, "bench/workspace.py --load".
  python bench/workspace.py --load [--load-concurrency 16 64] [--episodes 4] [--turns 5] [--think-s 1.0]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slime_env.tools_sandbox.workspace import Limits, WorkspaceError, WorkspaceSpec  # noqa: E402
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

    async with WorkspacePool(backend=backend, warm=4) as pool:  # a fixed size: this row times a warm one
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


class FixedPool(WorkspacePool):
    """The pool's policy before issue 58 item 13, for comparison: a fixed `warm` per spec, every missing one started
    at once, and an acquire that finds none warm starts its own (it never waits for a refill under way)."""

    def _unclaimed(self, key: tuple) -> int:
        return 0

    def _may_refill(self) -> bool:
        return not self._closed

    def _refill(self, key: tuple) -> None:
        missing = self.warm - len(self._ready[key]) - self._refilling[key]
        for _ in range(max(0, min(missing, self.max_open - self._open()))):
            self._starting[key] += 1
            self._refilling[key] += 1
            self._refills += 1
            self._spawn(self._start_warm(key))


async def run_under_load(pool: WorkspacePool, spec: WorkspaceSpec, concurrency: int, episodes: int, turns: int,
                         think_s: float, seed: int = 0) -> dict:
    rng = random.Random(seed)
    starts, execs, failed, firsts = [], [], [], []

    async def slot() -> None:
        for i in range(episodes):
            t0 = time.perf_counter()
            ws = await pool.acquire(spec)
            (starts if i else firsts).append(time.perf_counter() - t0)
            try:
                for _ in range(turns):
                    await asyncio.sleep(think_s * rng.uniform(0.5, 1.5))
                    t0 = time.perf_counter()
                    r = await ws.exec(["true"])
                    execs.append(time.perf_counter() - t0)
                    assert r.ok, r
            except WorkspaceError as e:  # e.g. a container whose agent connection dropped under load
                failed.append(f"{e} (warm hits so far {pool.stats['warm_hits']})")
            finally:
                await pool.release(ws)

    t0 = time.perf_counter()
    await asyncio.gather(*(slot() for _ in range(concurrency)))
    return {"starts": starts, "execs": execs, "wall": time.perf_counter() - t0, "stats": dict(pool.stats),
            "failed": failed, "all": starts + firsts}


async def bench_load(backend: str, image: str, concurrencies: list[int], policies: list[str], episodes: int,
                     turns: int, think_s: float) -> None:
    spec = WorkspaceSpec(image=image, workdir="/app", limits=Limits(memory_mb=512, pids=256))
    print(f"\n== {backend} under load: {episodes} episodes per slot, {turns} turns of ~{think_s:g} s + exec(true)")
    print("  c  policy        start p50 / p90 ms (all starts)   exec p50 / p90 ms   warm / waited / cold / refills"
          "   wall s")
    for c in concurrencies:
        for policy in policies:
            max_open = 2 * c + 8  # room for a full wave warm beside a full wave running, under every policy
            if policy.startswith("concurrency"):  # concurrency:R: refill_concurrency R
                refill = int(policy.split(":")[1]) if ":" in policy else None
                pool = WorkspacePool(backend=backend, max_open=max_open, refill_concurrency=refill)
            else:
                warm = c if policy == "fixed-c" else int(policy.split("-")[1])
                pool = FixedPool(backend=backend, warm=warm, max_open=max_open)
            async with pool:
                r = await run_under_load(pool, spec, c, episodes, turns, think_s)
            st = r["stats"]
            print(f"{c:3d}  {policy:12s} {pct(r['starts'], 0.5):8.0f} / {pct(r['starts'], 0.9):6.0f} "
                  f"({pct(r['all'], 0.5):5.0f} / {pct(r['all'], 0.9):5.0f})      "
                  f"{pct(r['execs'], 0.5):7.1f} / {pct(r['execs'], 0.9):6.1f}      "
                  f"{st.get('warm_hits', 0):4d} / {st.get('waited_for_refill', 0):4d} / {st.get('cold_starts', 0):4d}"
                  f" / {st.get('refills', 0):4d}   {r['wall']:6.1f}", flush=True)
            if r["failed"]:
                print(f"     {len(r['failed'])} episodes failed; the first: {r['failed'][0]}")


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--image", default="python:3.11-slim")
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--concurrent", type=int, default=64)
    ap.add_argument("--backends", nargs="+", default=["docker", "bwrap"])
    ap.add_argument("--load", action="store_true", help="start latency under load, old pool policy vs new")
    ap.add_argument("--load-concurrency", nargs="+", type=int, default=[16, 64])
    ap.add_argument("--policies", nargs="+", default=["fixed-4", "fixed-c", "concurrency"])
    ap.add_argument("--episodes", type=int, default=4, help="episodes per slot (--load)")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--think-s", type=float, default=1.0)
    args = ap.parse_args()
    from slime_env.tools_sandbox.workspace.base_images import ensure_base_image

    ensure_base_image(args.image)
    print(f"image {args.image}, {os.cpu_count()} CPUs")
    for backend in args.backends:
        if args.load:
            await bench_load(backend, args.image, args.load_concurrency, args.policies, args.episodes, args.turns,
                             args.think_s)
        else:
            await bench_backend(backend, args.image, args.runs, args.concurrent)


if __name__ == "__main__":
    asyncio.run(main())
