"""Output comparison for graded code, done outside the sandbox (the expected outputs never enter it).

stdin/stdout: `lines` (default) compares line by line after dropping trailing whitespace and trailing
blank lines; `exact` compares bytes; `tokens` compares whitespace-separated tokens. With `float_tol`,
tokens that both read as numbers match within that relative/absolute tolerance (for datasets that
accept any correctly rounded float). Call-based: the returned value (JSON with type tags from the
harness) against the expected one — tuples equal lists, floats within `float_tol` (default 1e-9
relative), and APPS's habit of wrapping the expected value in a one-element list is accepted.
"""

from __future__ import annotations

import math
from typing import Any

MODES = ("lines", "exact", "tokens")


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _num(token: str) -> float | None:
    try:
        value = float(token)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _tokens_match(got: str, want: str, float_tol: float | None) -> bool:
    a, b = got.split(), want.split()
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x == y:
            continue
        if float_tol is None:
            return False
        fx, fy = _num(x), _num(y)
        if fx is None or fy is None or not math.isclose(fx, fy, rel_tol=float_tol, abs_tol=float_tol):
            return False
    return True


def stdout_matches(got: str, want: str, mode: str = "lines", float_tol: float | None = None) -> bool:
    """Whether a program's stdout is the expected output under `mode` (see the module docstring)."""
    if mode == "exact":
        return got == want
    if mode == "tokens":
        return _tokens_match(got, want, float_tol)
    if _lines(got) == _lines(want):
        return True
    return float_tol is not None and _tokens_match(got, want, float_tol)


def untag(value: Any) -> Any:
    """The harness's tagged JSON back into Python values (tuples, sets, floats, bytes, dicts)."""
    if isinstance(value, list):
        return [untag(v) for v in value]
    if isinstance(value, dict) and len(value) == 1:
        (tag, inner), = value.items()
        if tag == "f":
            return float(inner)
        if tag == "tuple":
            return tuple(untag(v) for v in inner)
        if tag in ("set", "frozenset"):
            return [untag(v) for v in inner]  # compared as a sorted list (JSON has no sets)
        if tag == "dict":
            return {_hashable(untag(k)): untag(v) for k, v in inner}
        if tag == "bytes":
            return inner.encode("latin-1")
        if tag == "complex":
            return complex(float(inner[0]), float(inner[1]))
    return value


def _hashable(v: Any) -> Any:
    return tuple(_hashable(x) for x in v) if isinstance(v, list) else v


def values_equal(got: Any, want: Any, float_tol: float = 1e-9) -> bool:
    if isinstance(got, bool) or isinstance(want, bool):
        return type(got) is type(want) and got == want
    if isinstance(got, (int, float)) and isinstance(want, (int, float)):
        if isinstance(got, float) or isinstance(want, float):
            if math.isnan(got) and math.isnan(want):
                return True
            return math.isclose(got, want, rel_tol=float_tol, abs_tol=float_tol)
        return got == want
    if isinstance(got, (list, tuple)) and isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(values_equal(a, b, float_tol) for a, b in zip(got, want))
    if isinstance(got, dict) and isinstance(want, dict):
        want = {_hashable(k) if isinstance(k, list) else k: v for k, v in want.items()}
        if set(map(str, got)) != set(map(str, want)):
            return False
        by_str = {str(k): v for k, v in want.items()}
        return all(values_equal(v, by_str[str(k)], float_tol) for k, v in got.items())
    return got == want


def value_matches(tagged: Any, want: Any, float_tol: float = 1e-9) -> bool:
    """A call's tagged return value against the expected value (see the module docstring)."""
    got = untag(tagged)
    if values_equal(got, want, float_tol):
        return True
    return isinstance(want, list) and len(want) == 1 and values_equal(got, want[0], float_tol)
