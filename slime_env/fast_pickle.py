"""`fast_pickle`: cheap pickling for the frozen, slotted dataclasses that cross process boundaries.

Trajectories go from driver workers to the manager (and through Ray) as pickles. A frozen slotted dataclass
pickles through the Python-level `__getstate__`/`__setstate__` that `dataclasses` generates; rebuilding it from
a tuple of field values through the slot descriptors halves the manager's cost of receiving a group
(bench/rollout.py, worker rows).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")
_SETTERS: dict[type, tuple[Any, ...]] = {}


def fast_pickle(cls: type[T]) -> type[T]:
    """Class decorator for a frozen, slotted dataclass: pickles as `(class, field values)` and unpickles without
    calling `__init__` (the values were validated when the pickled object was made)."""
    names = tuple(f.name for f in dataclasses.fields(cls))
    _SETTERS[cls] = tuple(getattr(cls, n).__set__ for n in names)

    def __reduce__(self: Any) -> tuple[Any, tuple[Any, ...]]:
        return _rebuild, (cls, tuple([getattr(self, n) for n in names]))

    cls.__reduce__ = __reduce__  # type: ignore[method-assign]
    return cls


def _rebuild(cls: type, values: tuple[Any, ...]) -> Any:
    obj = object.__new__(cls)
    for set_slot, value in zip(_SETTERS[cls], values):
        set_slot(obj, value)
    return obj
