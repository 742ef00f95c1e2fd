"""Garbage-collector settings while a batch of episodes runs.

A driver with a thousand episodes in flight allocates a few container objects per token list, message and
future every turn. With CPython's default thresholds (a young collection every 700 net allocations) the
collector runs hundreds of times per batch and, every tenth of those, walks the whole heap the batch built:
on a 2-core machine that was a quarter to a third of the driver's CPU per turn (bench/rollout.py). Inference
servers do the same for the same reason (vLLM and SGLang `gc.freeze()` after start-up).
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

YOUNG_THRESHOLD = 50_000
_lock = threading.Lock()
_depth = 0
_saved: tuple[tuple[int, int, int], bool] | None = None


@contextmanager
def quiet_gc(enabled: bool = True) -> Iterator[None]:
    """While inside: objects alive at entry are left out of collections (`gc.freeze`) and the young generation
    is collected every 50,000 net allocations instead of 700. Both are undone at exit, also after an error;
    nested and overlapping uses (several managers in one loop) undo only when the last one leaves. Cycles still
    get collected, only less often; memory held by uncollected cycles stays small (tens of MB at most). A
    process that froze its heap itself keeps it frozen."""
    global _depth, _saved
    if not enabled:
        yield
        return
    with _lock:  # managers on event loops in different threads share the one collector
        if _depth == 0:
            froze = gc.get_freeze_count() == 0  # someone else's freeze is theirs to undo
            _saved = (gc.get_threshold(), froze)
            if froze:
                gc.freeze()
            gc.set_threshold(YOUNG_THRESHOLD, *gc.get_threshold()[1:])
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _saved is not None:
                threshold, froze = _saved
                gc.set_threshold(*threshold)
                if froze:
                    gc.unfreeze()
                _saved = None
