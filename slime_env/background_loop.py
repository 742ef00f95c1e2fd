"""`BackgroundLoop`: an event loop of its own in a daemon thread, for synchronous facades over async envs (the
Gymnasium and PettingZoo adapters) — they then work inside a running loop too (Jupyter)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable
from typing import Any


class BackgroundLoop:
    """`run(coro)` runs a coroutine on the private loop and returns its result (or raises its exception);
    `close(last)` runs `last` (e.g. the env's `close()`), then stops the loop and joins the thread; idempotent."""

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
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            self._loop.close()
