"""`run_loop`: run a driver's main coroutine on uvloop when it is installed, else on asyncio's own loop.

uvloop (libuv, in C) schedules callbacks and moves bytes through sockets and pipes with less Python per event
than asyncio's own loop; a driver talking HTTP to engines does that for every turn. `SLIME_ENV_UVLOOP=0` keeps
asyncio's loop (e.g. to compare, or where a library needs it).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_name() -> str:
    """"uvloop" or "asyncio": what `run_loop` will use here."""
    if os.environ.get("SLIME_ENV_UVLOOP", "1") == "0":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on the loop `loop_name()` names."""
    if loop_name() == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
