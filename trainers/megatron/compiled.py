"""`lazily_compiled(fn)`: `torch.compile(fn, dynamic=True)` made on first call, so importing a module compiles
nothing (and the CPU paths, which never call these, never compile)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def lazily_compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    compiled: list[Callable[..., Any]] = []

    def call(*args: Any, **kwargs: Any) -> Any:
        if not compiled:
            compiled.append(torch.compile(fn, dynamic=True))
        return compiled[0](*args, **kwargs)

    call.__wrapped__ = fn  # type: ignore[attr-defined]
    return call
