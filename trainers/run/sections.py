"""One parser for the run config's sections (`engine:`, `cluster:`, `async:`): a mapping of a dataclass's fields."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any, TypeVar

from slime_env.errors import InvalidInput

T = TypeVar("T")


def parse_section(cls: type[T], raw: Any, where: str) -> T:
    """`cls(**raw)`: the defaults when `raw` is None or empty; an `InvalidInput` naming `where` when `raw` is not a
    mapping or has fields `cls` does not know (the known ones listed)."""
    if raw is None or (isinstance(raw, Mapping) and not raw):
        return cls()
    if not isinstance(raw, Mapping):
        raise InvalidInput(f"{where}: expected a mapping, got {type(raw).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise InvalidInput(f"{where}: unknown field(s) {unknown}; known: {sorted(known)}")
    return cls(**raw)
