"""Plain values as JSON with type tags, both ways (stdlib only: it also runs inside the sandbox).

Only plain built-in values cross between the solution's sandbox and the grader: `int`, `float`,
`complex`, `str`, `bytes`, `bool`, `None`, and `list` / `tuple` / `set` / `frozenset` / `dict` of them,
of exactly these types (a subclass of `int` whose `__eq__` always says True is not plain). `tag`
writes one as JSON-ready data: lists stay lists, floats become `{"f": repr}`, the others
`{"tuple" | "set" | "frozenset": [...]}`, `{"dict": [[key, value], ...]}`, `{"bytes": latin-1 text}`,
`{"complex": [re, im]}`; `untag` reads it back as exactly those types and nothing else, so whatever
a sandbox reports, the grader only ever holds plain values.
"""

from __future__ import annotations

from typing import Any

_SCALARS = (int, str, bool, type(None))
_MAX_DEPTH = 100


class NotPlain(TypeError):
    """A value that is not plain; `value` is the offending object."""

    def __init__(self, value: Any):
        super().__init__(f"a {type(value).__name__} is not a plain built-in value")
        self.value = value


def tag(value: Any, _depth: int = 0) -> Any:
    """`value` as JSON-ready tagged data; NotPlain for anything that is not a plain built-in value."""
    t = type(value)
    if _depth > _MAX_DEPTH:
        raise NotPlain(value)
    if t in _SCALARS:
        return value
    if t is float:
        return {"f": repr(value)}
    if t is list:
        return [tag(x, _depth + 1) for x in value]
    if t is tuple:
        return {"tuple": [tag(x, _depth + 1) for x in value]}
    if t is set or t is frozenset:
        items = [tag(x, _depth + 1) for x in value]
        return {t.__name__: sorted(items, key=repr)}  # a stable order for sets of mixed types
    if t is dict:
        return {"dict": [[tag(k, _depth + 1), tag(x, _depth + 1)] for k, x in value.items()]}
    if t is bytes:
        return {"bytes": value.decode("latin-1")}
    if t is complex:
        return {"complex": [repr(value.real), repr(value.imag)]}
    raise NotPlain(value)


def untag(data: Any, _depth: int = 0) -> Any:
    """Tagged data back as plain values of exactly the tagged types; ValueError for anything malformed."""
    if _depth > _MAX_DEPTH:
        raise ValueError("tagged value nested too deeply")
    t = type(data)
    if t in _SCALARS:
        return data
    if t is list:
        return [untag(x, _depth + 1) for x in data]
    if t is dict and len(data) == 1:
        (kind, inner), = data.items()
        if kind == "f" and type(inner) is str:
            return float(inner)
        if kind == "bytes" and type(inner) is str:
            return inner.encode("latin-1")
        if kind == "complex" and type(inner) is list and len(inner) == 2:
            return complex(float(inner[0]), float(inner[1]))
        if type(inner) is list:
            if kind == "tuple":
                return tuple(untag(x, _depth + 1) for x in inner)
            if kind == "set":
                return {untag(x, _depth + 1) for x in inner}
            if kind == "frozenset":
                return frozenset(untag(x, _depth + 1) for x in inner)
            if kind == "dict" and all(type(p) is list and len(p) == 2 for p in inner):
                return {untag(k, _depth + 1): untag(v, _depth + 1) for k, v in inner}
    raise ValueError(f"not a tagged plain value: {str(data)[:80]}")
