"""`WorkspacePool`: warm workspaces per image, so an episode starts on one already running.

`acquire(spec)` hands out a warm workspace of an equal spec (`WorkspaceSpec.pool_key`) when there is one, else
starts one; either way the pool then starts replacements in the background until `warm` are ready for that spec.
A workspace is used once: `release(ws)` closes it (a used workspace is never handed out again). Warm workspaces of
a spec nobody asked for within `idle_timeout_s` are closed. The first `acquire` removes what killed runs left behind. At
most `max_open` workspaces exist at once (warm ones included; a warm one of another spec is closed to make room). Its
wall time counts from `acquire`.
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

    def __init__(self, *, backend: str = "docker", warm: int = 2, max_open: int = 64, idle_timeout_s: float = 300.0,
                 run: str | None = None, client=None):
        if warm < 0 or max_open < 1:
            raise ValueError(f"warm must be >= 0 and max_open >= 1, got {warm}, {max_open}")
        self.backend, self.warm, self.max_open, self.idle_timeout_s = backend, warm, max_open, idle_timeout_s
        self.run, self.client = run, client
        self._ready: dict[tuple, collections.deque[Workspace]] = collections.defaultdict(collections.deque)
        self._starting: collections.Counter = collections.Counter()
        self._asked: dict[tuple, float] = {}
        self._specs: dict[tuple, WorkspaceSpec] = {}
        self._out: set[Workspace] = set()
        self._tasks: set[asyncio.Task] = set()
        self._room: asyncio.Condition | None = None
        self._janitor: asyncio.Task | None = None
        self._closed = False
        self.stats = collections.Counter()  # warm_hits, cold_starts, start_failures, released

    def _open(self) -> int:
        return len(self._out) + sum(map(len, self._ready.values())) + sum(self._starting.values())

    async def acquire(self, spec: WorkspaceSpec) -> Workspace:
        """A started workspace for `spec`, warm if one is ready; WorkspaceError if one cannot be started."""
        if self._closed:
            raise WorkspaceError("the workspace pool is closed")
        key = spec.pool_key()
        self._asked[key], self._specs[key] = time.monotonic(), spec
        self._room = self._room or asyncio.Condition()
        if self._janitor is None:
            self._janitor = asyncio.get_running_loop().create_task(self._sweep())
            await asyncio.to_thread(reap_stale, self.backend, self.client)  # what killed runs left behind
        while True:
            ready = self._ready[key]
            while ready:
                ws = ready.popleft()
                if ws.closed or ws._dead:
                    continue
                self.stats["warm_hits"] += 1
                return self._hand_out(ws, key)
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
        return self._hand_out(ws, key)

    def _hand_out(self, ws: Workspace, key: tuple) -> Workspace:
        self._out.add(ws)
        Watchdog.for_loop().watch(ws)  # the wall time counts from now
        self._refill(key)
        return ws

    async def release(self, ws: Workspace) -> None:
        """Close a workspace this pool handed out (never reused), and make room for the next one."""
        self._out.discard(ws)
        self.stats["released"] += 1
        try:
            await ws.close()
        finally:
            await self._notify()

    def _refill(self, key: tuple) -> None:
        missing = self.warm - len(self._ready[key]) - self._starting[key]
        for _ in range(max(0, min(missing, self.max_open - self._open()))):
            self._starting[key] += 1
            self._spawn(self._start_warm(key))

    async def _start_warm(self, key: tuple) -> None:
        try:
            ws = await open_workspace(self._specs[key], backend=self.backend, client=self.client, run=self.run)
        except Exception:  # noqa: BLE001 - an acquire starts its own and reports the error
            self.stats["start_failures"] += 1
            return
        finally:
            self._starting[key] -= 1
        Watchdog.for_loop().forget(ws)  # a warm workspace's wall time has not started
        if self._closed:
            await ws.close()
            return
        self._ready[key].append(ws)
        await self._notify()

    def _evict_one(self, keep: tuple) -> bool:
        """Close a warm workspace of another spec (the one asked for least recently) to make room."""
        others = [k for k, q in self._ready.items() if k != keep and q]
        if not others:
            return False
        victim = self._ready[min(others, key=lambda k: self._asked.get(k, 0.0))].pop()
        self._spawn(victim.close())
        return True

    def reap_idle(self) -> int:
        """Close warm workspaces of specs nobody asked for within `idle_timeout_s`; returns how many."""
        now, closed = time.monotonic(), 0
        for key, ready in self._ready.items():
            if ready and now - self._asked.get(key, now) > self.idle_timeout_s:
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
        everything = [ws for q in self._ready.values() for ws in q] + list(self._out)
        self._ready.clear()
        self._out.clear()
        await asyncio.gather(*(ws.close() for ws in everything), return_exceptions=True)

    async def __aenter__(self) -> WorkspacePool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


_shared: dict[tuple, WorkspacePool] = {}


def shared_pool(backend: str = "docker", *, warm: int = 2) -> WorkspacePool:
    """The process's pool for `backend` in the running event loop (envs that make a workspace per episode share it;
    what it holds is removed at exit, or when a `BackgroundLoop` running it closes)."""
    key = (asyncio.get_running_loop(), backend)
    pool = _shared.get(key)
    if pool is None or pool._closed:
        for stale in [k for k in _shared if k[0].is_closed()]:
            del _shared[stale]
        pool = _shared[key] = WorkspacePool(backend=backend, warm=warm)
        # a synchronous facade's loop (Gymnasium's, PettingZoo's) takes its warm workspaces with it when it closes
        at_loop_close(key[0], pool.close)
    return pool
