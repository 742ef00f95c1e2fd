"""Config sections as dataclasses, checked one way: the run config's sections (`engine:`, `cluster:`, `async:`, the
document itself) and the trainer's (`trainer.lora`). A section is a mapping of a dataclass's fields (`parse_section`):
no field the dataclass does not know (`check_fields`), each scalar of the type its field declares (`check_scalars`).
Every refusal is an `InvalidInput` naming the field's path. Imports the core's errors alone (the run and the trainers
use it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any, TypeVar

from slime_env.errors import InvalidInput

T = TypeVar("T")

_SCALARS = {"int", "float", "bool", "str", "None"}
_NAMES = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string", "None": "null"}


def parse_section(cls: type[T], raw: Any, where: str) -> T:
    """`cls(**raw)`: the defaults when `raw` is None or empty; an `InvalidInput` naming `where` when `raw` is not a
    mapping, has fields `cls` does not know (the known ones listed) or a scalar of the wrong type."""
    if raw is None or (isinstance(raw, Mapping) and not raw):
        return cls()
    if not isinstance(raw, Mapping):
        raise InvalidInput(f"{where}: expected a mapping, got {type(raw).__name__}")
    check_fields(cls, raw, where)
    return cls(**check_scalars(cls, raw, where))


def check_fields(cls: type, raw: Mapping[str, Any], where: str, sep: str = ".") -> None:
    """An `InvalidInput` when `raw` has keys that are no field of the dataclass `cls`, naming the first one's path
    (`where.field`; `sep` instead of the dot), all of them, and the known fields. A field named with a trailing `_`
    (`async_`: a Python keyword) is named without it, as the YAML writes it."""
    known = sorted(f.name.rstrip("_") for f in fields(cls))
    unknown = sorted(k.rstrip("_") if isinstance(k, str) else repr(k) for k in set(raw) - {f.name for f in fields(cls)})
    if unknown:
        raise InvalidInput(f"{where}{sep}{unknown[0]}: unknown field(s) {unknown}; known: {known}")


def check_scalars(cls: type, raw: Mapping[str, Any], where: str, sep: str = ".") -> dict[str, Any]:
    """`raw` with every field of `cls` declared as a scalar (`int`, `float`, `bool`, `str`, or a union of them with
    None) checked against its declaration: a boolean is no integer (YAML's `true` is not 1), a number no string;
    a float field takes an integer, and a string that reads as a number (YAML 1.1 reads `1e-5` as a string).
    An `InvalidInput` names the field's YAML path (`where.field`; `sep` instead of the dot) and what it takes."""
    out = dict(raw)
    for f in fields(cls):
        if f.name not in raw:
            continue
        kinds = _kinds(f.type)
        if not kinds <= _SCALARS:
            continue  # a list, a mapping, Any: its own checks
        value, name = raw[f.name], f.name.rstrip("_")
        if value is None and "None" in kinds or isinstance(value, bool) and "bool" in kinds:
            continue
        if isinstance(value, int) and not isinstance(value, bool) and kinds & {"int", "float"}:
            continue
        if isinstance(value, float) and "float" in kinds or isinstance(value, str) and "str" in kinds:
            continue
        if isinstance(value, str) and "float" in kinds:
            try:
                out[f.name] = float(value)
                continue
            except ValueError:
                pass
        wanted = " or ".join(_NAMES[k] for k in sorted(kinds, key=list(_NAMES).index))
        raise InvalidInput(f"{where}{sep}{name}: expected {wanted}, got {value!r} ({type(value).__name__})")
    return out


def _kinds(annotation: Any) -> set[str]:
    """The type names of a field's annotation (a string under `from __future__ import annotations`, else a type or
    a union of types)."""
    if isinstance(annotation, type):
        return {annotation.__name__}
    return {k.strip().removeprefix("<class '").removesuffix("'>").replace("NoneType", "None")
            for k in str(annotation).split("|")}


def check_int(value: Any, where: str, *, minimum: int | None = None) -> int:
    """`value` when it is an integer (not a boolean) >= `minimum`; else an `InvalidInput` naming `where`."""
    if not isinstance(value, int) or isinstance(value, bool) or minimum is not None and value < minimum:
        at_least = f" >= {minimum}" if minimum is not None else ""
        raise InvalidInput(f"{where}: expected an integer{at_least}, got {value!r}")
    return value
