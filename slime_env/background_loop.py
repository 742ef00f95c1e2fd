"""`BackgroundLoop`: an event loop of its own in a daemon thread, for synchronous facades over async envs (the
Gymnasium and PettingZoo adapters) — they then work inside a running loop too (Jupyter)."""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

_AT_CLOSE: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, list[Callable[[], Awaitable[Any]]]] = \
    weakref.WeakKeyDictionary()


def at_loop_close(loop: asyncio.AbstractEventLoop, close: Callable[[], Awaitable[Any]]) -> None:
    """`await close()` on `loop` when a `BackgroundLoop` running it closes, after its last coroutine: for what lives
    as long as the loop (a process-wide pool of started workspaces kept per loop), which a synchronous facade's
    `close()` must end too. Other loops never call it."""
    _AT_CLOSE.setdefault(loop, []).append(close)


class BackgroundLoop:
    """`run(coro)` runs a coroutine on the private loop and returns its result (or raises its exception);
    `close(last)` runs `last` (e.g. the env's `close()`), then what `at_loop_close` registered for the loop, then
    stops the loop and joins the thread; idempotent."""

    def __init__(self, name: str):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Awaitable[Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self, last: Awaitable[Any] | None = None) -> None:
        if self._loop.is_closed():
            if asyncio.iscoroutine(last):
                last.close()  # never awaited: no "coroutine was never awaited" warning
            return
        try:
            if last is not None:
                self.run(last)
        finally:
            try:
                for close in _AT_CLOSE.pop(self._loop, []):
                    self.run(close())
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            self._loop.close()
