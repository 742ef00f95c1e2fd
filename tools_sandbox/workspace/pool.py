"""`WorkspacePool`: warm workspaces per image, so an episode starts on one already running.

`acquire(spec)` hands out a warm workspace of an equal spec (`WorkspaceSpec.pool_key`) when there is one; else it
takes over a warm start already under way, or starts one of its own. A workspace is used once: `release(ws)` closes it
(a used workspace is never handed out again). Warm workspaces of a spec nobody asked for within `idle_timeout_s` are
closed. The first `acquire` removes what killed runs left behind. At most `max_open` workspaces exist at once (warm
ones included; a warm one of another spec is closed to make room). Its wall time counts from `acquire`.

Sizing and refilling, from the run's concurrency:
- `warm` (default None): how many started workspaces to keep per spec. None sizes it from the run's concurrency: the
  most workspaces of that spec held at once (handed out or being acquired) since the spec was last idle, so a whole
  wave of a run's episodes starts warm — once the spec is asked for again after one of its workspaces was released.
  Until then none is kept: a spec per task (Harbor's images) whose group of samples starts at once and does not come
  back costs no idle starts. A given number wins, for every spec.
- Refills of a spec start as soon as it has fewer than that many warm (or starting and not yet claimed);
  `refill_concurrency` (default None: no bound) caps the refills in flight. Measured (`bench/workspace.py --load`,
  Docker, 2 cores, 16 episodes of ~2.5 s): caps of 1, 2 and 4 starved the pool (not one warm start; start p50
  1.6-2.2 s), and so did holding refills back while an acquire started its own (p50 2.2 s); uncapped, every start
  after the first wave but a few was warm, and `exec` latency did not rise.
- An `acquire` that finds no warm one while refills are under way waits for one of those (it started earlier than a
  new one would) instead of starting one more, so a burst of episodes does not start twice as many workspaces.
"""

from __future__ import annotations

import asyncio
import collections
import time

from slime_env.background_loop import at_loop_close
from slime_env.tools_sandbox.workspace.base import Workspace
from slime_env.tools_sandbox.workspace.open import open_workspace
from slime_env.tools_sandbox.workspace.types import WorkspaceError, WorkspaceSpec
from slime_env.tools_sandbox.workspace.watchdog import Watchdog


def reap_stale(backend: str, client=None) -> None:
    """Remove the workspaces of owners that are gone (a run killed with -9 left them)."""
    if backend == "docker":
        from slime_env.tools_sandbox.workspace.docker import reap

        reap(client)
    elif backend == "bwrap":
        from slime_env.tools_sandbox.workspace.bwrap import reap_folders

        reap_folders()


class WorkspacePool:
    """Warm workspaces per spec on one backend (see the module docstring). Use in one event loop; `close()` ends
    every workspace it made, handed out or not."""

    def __init__(self, *, backend: str = "docker", warm: int | None = None, max_open: int = 64,
                 idle_timeout_s: float = 300.0, refill_concurrency: int | None = None, run: str | None = None,
                 client=None):
        if (warm is not None and warm < 0) or max_open < 1 or (refill_concurrency is not None
                                                                 and refill_concurrency < 1):
            raise ValueError(f"warm must be None or >= 0, max_open >= 1 and refill_concurrency None or >= 1, got "
                             f"{warm}, {max_open}, {refill_concurrency}")
        self.backend, self.warm, self.max_open, self.idle_timeout_s = backend, warm, max_open, idle_timeout_s
        self.refill_concurrency, self.run, self.client = refill_concurrency, run, client
        self._ready: dict[tuple, collections.deque[Workspace]] = collections.defaultdict(collections.deque)
        self._starting: collections.Counter = collections.Counter()   # every start in flight, per spec
        self._refilling: collections.Counter = collections.Counter()  # the warm ones among them
        self._waiting: dict[tuple, collections.deque[asyncio.Future]] = collections.defaultdict(collections.deque)
        self._held: collections.Counter = collections.Counter()       # handed out or being acquired, per spec
        self._peak: collections.Counter = collections.Counter()       # the most held at once (warm=None's size)
        self._released: set[tuple] = set()                            # specs with a workspace released
        self._recurring: set[tuple] = set()                           # ... and asked for again since
        self._refills = 0                                             # refills in flight, all specs
        self._asked: dict[tuple, float] = {}
        self._specs: dict[tuple, WorkspaceSpec] = {}
        self._out: dict[Workspace, tuple] = {}
        self._tasks: set[asyncio.Task] = set()
        self._room: asyncio.Condition | None = None
        self._janitor: asyncio.Task | None = None
        self._closed = False
        # warm_hits, waited_for_refill, cold_starts, refills, start_failures, released
        self.stats = collections.Counter()

    def _open(self) -> int:
        return len(self._out) + sum(map(len, self._ready.values())) + sum(self._starting.values())

    def target(self, key: tuple) -> int:
        """How many warm workspaces of spec `key` the pool keeps: `warm`, or the spec's concurrency (see above)."""
        if self.warm is not None:
            return self.warm
        return self._peak[key] if key in self._recurring else 0

    async def acquire(self, spec: WorkspaceSpec) -> Workspace:
        """A started workspace for `spec`, warm if one is ready; WorkspaceError if one cannot be started."""
        if self._closed:
            raise WorkspaceError("the workspace pool is closed")
        key = spec.pool_key()
        self._asked[key], self._specs[key] = time.monotonic(), spec
        self._held[key] += 1
        self._peak[key] = max(self._peak[key], self._held[key])
        if key in self._released:
            self._recurring.add(key)
        try:
            ws = await self._take(spec, key)
        except BaseException:
            self._let_go(key)
            self._refill_all()
            raise
        self._out[ws] = key
        Watchdog.for_loop().watch(ws)  # the wall time counts from now
        self._refill_all(key)
        return ws

    async def _take(self, spec: WorkspaceSpec, key: tuple) -> Workspace:
        self._room = self._room or asyncio.Condition()
        if self._janitor is None:
            self._janitor = asyncio.get_running_loop().create_task(self._sweep())
            await asyncio.to_thread(reap_stale, self.backend, self.client)  # what killed runs left behind
        self._refill(key)  # a spec asked for again starts its warm ones now, and this acquire waits for one of them
        while True:
            ready = self._ready[key]
            while ready:
                ws = ready.popleft()
                if not (ws.closed or ws._dead):
                    self.stats["warm_hits"] += 1
                    return ws
            if self._unclaimed(key) > 0:  # a warm start under way that no acquire waits for: wait for it
                ws = await self._wait_for_refill(key)
                if ws is not None:
                    self.stats["waited_for_refill"] += 1
                    return ws
                continue  # that start failed
            if self._open() < self.max_open or self._evict_one(key):
                break
            async with self._room:
                await self._room.wait()
        self._starting[key] += 1
        try:
            ws = await open_workspace(spec, backend=self.backend, client=self.client, run=self.run)
        except BaseException:
            self.stats["start_failures"] += 1
            raise
        finally:
            self._starting[key] -= 1
        self.stats["cold_starts"] += 1
        return ws

    def _let_go(self, key: tuple) -> None:
        self._held[key] -= 1
        if not self._held[key]:
            del self._held[key]

    def _unclaimed(self, key: tuple) -> int:
        """Warm starts of `key` under way that no acquire waits for yet."""
        return self._refilling[key] - len(self._waiting[key])

    async def _wait_for_refill(self, key: tuple) -> Workspace | None:
        claim = asyncio.get_running_loop().create_future()
        self._waiting[key].append(claim)
        try:
            return await claim
        except asyncio.CancelledError:
            if claim in self._waiting[key]:
                self._waiting[key].remove(claim)
            elif claim.done() and not claim.cancelled() and claim.result() is not None:
                self._ready[key].appendleft(claim.result())  # handed to us as we were cancelled: keep it warm
            raise

    async def release(self, ws: Workspace) -> None:
        """Close a workspace this pool handed out (never reused), and make room for the next one."""
        key = self._out.pop(ws, None)
        if key is not None:
            self._let_go(key)
            self._released.add(key)
        self.stats["released"] += 1
        try:
            await ws.close()
        finally:
            await self._notify()
            self._refill_all()

    def _refill(self, key: tuple) -> None:
        """Start warm ones for `key` up to its target, `refill_concurrency` in flight at most."""
        while (self._may_refill()
               and len(self._ready[key]) + self._unclaimed(key) < self.target(key)
               and self._open() < self.max_open):
            self._starting[key] += 1
            self._refilling[key] += 1
            self._refills += 1
            self._spawn(self._start_warm(key))

    def _may_refill(self) -> bool:
        return not self._closed and (self.refill_concurrency is None or self._refills < self.refill_concurrency)

    def _refill_all(self, first: tuple | None = None) -> None:
        """Refill `first`, then the specs episodes hold now (a spec nobody holds is refilled at its next acquire)."""
        if first is not None:
            self._refill(first)
        for key in list(self._held):
            if not self._may_refill():
                return
            self._refill(key)

    async def _start_warm(self, key: tuple) -> None:
        try:
            ws = await open_workspace(self._specs[key], backend=self.backend, client=self.client, run=self.run)
        except Exception:  # noqa: BLE001 - an acquire starts its own and reports the error
            self.stats["start_failures"] += 1
            self._hand_over(key, None)  # a waiting acquire starts its own
            return
        finally:
            self._starting[key] -= 1
            self._refilling[key] -= 1
            self._refills -= 1
        self.stats["refills"] += 1
        Watchdog.for_loop().forget(ws)  # a warm workspace's wall time has not started
        if self._closed:
            await ws.close()
            return
        if not self._hand_over(key, ws):
            self._ready[key].append(ws)
        self._refill_all()
        await self._notify()

    def _hand_over(self, key: tuple, ws: Workspace | None) -> bool:
        """Give a finished warm start (None: a failed one) to the first acquire waiting for it; False if none."""
        waiting = self._waiting[key]
        while waiting:
            claim = waiting.popleft()
            if not claim.done():
                claim.set_result(ws)
                return True
        return False

    def _evict_one(self, keep: tuple) -> bool:
        """Close a warm workspace of another spec (the one asked for least recently) to make room."""
        others = [k for k, q in self._ready.items() if k != keep and q]
        if not others:
            return False
        victim = self._ready[min(others, key=lambda k: self._asked.get(k, 0.0))].pop()
        self._spawn(victim.close())
        return True

    def reap_idle(self) -> int:
        """Close warm workspaces of specs nobody asked for within `idle_timeout_s`; returns how many. Such a spec's
        size (`warm=None`) starts again from what is held now."""
        now, closed = time.monotonic(), 0
        for key, ready in self._ready.items():
            if now - self._asked.get(key, now) > self.idle_timeout_s:
                self._peak[key] = self._held.get(key, 0)
                self._recurring.discard(key)
                while ready:
                    self._spawn(ready.pop().close())
                    closed += 1
        return closed

    async def _sweep(self) -> None:
        while not self._closed:
            await asyncio.sleep(min(30.0, max(0.5, self.idle_timeout_s / 2)))
            self.reap_idle()

    async def _notify(self) -> None:
        if self._room is not None:
            async with self._room:
                self._room.notify_all()

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Close every workspace of this pool: warm, starting and handed out."""
        self._closed = True
        if self._janitor is not None:
            self._janitor.cancel()
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        for waiting in self._waiting.values():
            for claim in waiting:
                if not claim.done():
                    claim.set_exception(WorkspaceError("the workspace pool is closed"))
        everything = [ws for q in self._ready.values() for ws in q] + list(self._out)
        self._ready.clear()
        self._out.clear()
        await asyncio.gather(*(ws.close() for ws in everything), return_exceptions=True)

    async def __aenter__(self) -> WorkspacePool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


_shared: dict[tuple, WorkspacePool] = {}


def shared_pool(backend: str = "docker", *, warm: int | None = None) -> WorkspacePool:
    """The process's pool for `backend` in the running event loop (envs that make a workspace per episode share it;
    what it holds is removed at exit, or when a `BackgroundLoop` running it closes). `warm`: see `WorkspacePool`
    (None: sized from the run's concurrency)."""
    key = (asyncio.get_running_loop(), backend)
    pool = _shared.get(key)
    if pool is None or pool._closed:
        for stale in [k for k in _shared if k[0].is_closed()]:
            del _shared[stale]
        pool = _shared[key] = WorkspacePool(backend=backend, warm=warm)
        # a synchronous facade's loop (Gymnasium's, PettingZoo's) takes its warm workspaces with it when it closes
        at_loop_close(key[0], pool.close)
    return pool
