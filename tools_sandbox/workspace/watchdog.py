"""The limits a workspace cannot enforce from inside: its wall time and (on Docker) its disk use.

One `Watchdog` per event loop checks every workspace it watches: past its deadline, or past its disk limit (Docker's
`SizeRw`, sampled every `disk_interval_s`: overlay2 on ext4 has no per-container quota), the workspace is killed
and later calls on it raise `WorkspaceError` naming the limit.
"""

from __future__ import annotations

import asyncio
import time
import weakref

from slime_env.tools_sandbox.workspace.base import Workspace

_watchdogs: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Watchdog] = weakref.WeakKeyDictionary()


class Watchdog:
    def __init__(self, *, interval_s: float = 0.5, disk_interval_s: float = 5.0):
        self.interval_s, self.disk_interval_s = interval_s, disk_interval_s
        self._watched: dict[Workspace, float] = {}
        self._task: asyncio.Task | None = None
        self._last_disk = 0.0
        self.killed: list[tuple[str, str]] = []  # (workspace id, reason)

    @classmethod
    def for_loop(cls) -> Watchdog:
        loop = asyncio.get_running_loop()
        if loop not in _watchdogs:
            _watchdogs[loop] = cls()
        return _watchdogs[loop]

    def watch(self, ws: Workspace) -> None:
        """Count `ws`'s wall time from now."""
        self._watched[ws] = time.monotonic() + ws.spec.limits.wall_time_s
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def forget(self, ws: Workspace) -> None:
        self._watched.pop(ws, None)

    async def _run(self) -> None:
        while self._watched:
            await asyncio.sleep(self.interval_s)
            now = time.monotonic()
            for ws, deadline in list(self._watched.items()):
                if ws.closed:
                    self.forget(ws)
                elif now >= deadline:
                    await self._kill(ws, f"its wall time of {ws.spec.limits.wall_time_s:g}s is over")
            if now - self._last_disk >= self.disk_interval_s:
                self._last_disk = now
                await self._check_disk()

    async def _check_disk(self) -> None:
        limited = [ws for ws in self._watched if ws.spec.limits.disk_mb is not None and hasattr(ws, "size_rw")]
        if not limited:
            return
        sizes = await asyncio.gather(*(asyncio.to_thread(ws.size_rw) for ws in limited))
        for ws, size in zip(limited, sizes):
            if size is not None and size > ws.spec.limits.disk_mb << 20:
                await self._kill(ws, f"it wrote {size >> 20} MB, over its disk limit of {ws.spec.limits.disk_mb} MB")

    async def _kill(self, ws: Workspace, reason: str) -> None:
        self.forget(ws)
        self.killed.append((ws.id, reason))
        try:
            await ws.kill(reason)
        except Exception:  # noqa: BLE001 - gone already
            pass
