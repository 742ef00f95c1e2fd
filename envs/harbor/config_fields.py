"""The value readers of Harbor's task.toml (`config.py`): each takes a raw value and its field path and returns it
typed, or raises `FieldError` naming the path; `_Section` reads one table's keys and notes the unknown ones."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from ipaddress import ip_address, ip_network
from typing import Any


class FieldError(ValueError):
    """A bad value at a field path (`environment.cpus`); `load_task` adds the file's name."""

    def __init__(self, where: str, message: str):
        super().__init__(f"{where}: {message}" if where else message)
        self.where, self.message = where, message


@dataclass
class ParseNotes:
    """What parsing noticed but Harbor accepts: unknown keys (ignored) and deprecated fields (converted)."""

    unknown: list[str] = field(default_factory=list)
    deprecated: list[str] = field(default_factory=list)


# --- the sections --------------------------------------------------------------------------------------------
# --- reading values ------------------------------------------------------------------------------------------
def _join(where: str, key: str | int) -> str:
    return f"{where}[{key}]" if isinstance(key, int) else (f"{where}.{key}" if where else key)


def _table(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise FieldError(where, f"expected a table, got {_show(value)}")
    return value


def _show(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


class _Section:
    """The keys of one table, read one by one; what is left at the end is unknown (ignored, noted)."""

    def __init__(self, data: Any, where: str, notes: ParseNotes):
        self.data, self.where, self.notes = dict(_table(data, where)), where, notes

    def pop(self, key: str, read, default: Any = None):
        if key not in self.data:
            return default
        return read(self.data.pop(key), _join(self.where, key))

    def done(self) -> None:
        self.notes.unknown.extend(_join(self.where, k) for k in self.data)


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise FieldError(where, f"expected a string, got {_show(value)}")
    return value


def _opt_str(value: Any, where: str) -> str | None:
    return _str(value, where)


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool):
        raise FieldError(where, f"expected a number, got {_show(value)}")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            pass
    raise FieldError(where, f"expected a number, got {_show(value)}")


def _seconds(value: Any, where: str) -> float:
    v = _number(value, where)
    if not (math.isfinite(v) and v > 0):
        raise FieldError(where, f"must be a positive number of seconds, got {value!r}")
    return v


def _nonneg_seconds(value: Any, where: str) -> float:
    v = _number(value, where)
    if not (math.isfinite(v) and v >= 0):
        raise FieldError(where, f"must be a non-negative number of seconds, got {value!r}")
    return v


def _int(value: Any, where: str) -> int:
    if isinstance(value, bool):
        raise FieldError(where, f"expected an integer, got {_show(value)}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        return int(value)
    raise FieldError(where, f"expected an integer, got {_show(value)}")


def _positive_int(value: Any, where: str) -> int:
    v = _int(value, where)
    if v <= 0:
        raise FieldError(where, f"must be a positive integer, got {value!r}")
    return v


def _nonneg_int(value: Any, where: str) -> int:
    v = _int(value, where)
    if v < 0:
        raise FieldError(where, f"must be zero or more, got {value!r}")
    return v


def _cpus(value: Any, where: str) -> int | float:
    """Harbor's `normalize_cpus`: `2.0` → 2; NaN / infinity rejected (and, here, anything not positive)."""
    v = _number(value, where)
    if not (math.isfinite(v) and v > 0):
        raise FieldError(where, f"must be a positive finite number of CPUs, got {value!r}")
    if isinstance(value, int) or v.is_integer():
        return int(v)
    return v


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise FieldError(where, f"expected true or false, got {_show(value)}")
    return value


def _user(value: Any, where: str) -> str | int:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise FieldError(where, f"expected a user name or uid, got {_show(value)}")
    if isinstance(value, int) and value < 0:
        raise FieldError(where, f"a uid must be zero or more, got {value}")
    return value


def _choice(choices: tuple[str, ...], lower: bool = False):
    def read(value: Any, where: str) -> str:
        v = _str(value, where)
        v = v.lower() if lower else v
        if v not in choices:
            raise FieldError(where, f"must be one of {', '.join(map(repr, choices))}, got {value!r}")
        return v
    return read


def _str_list(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise FieldError(where, f"expected a list of strings, got {_show(value)}")
    return tuple(_str(v, _join(where, i)) for i, v in enumerate(value))


def _str_map(value: Any, where: str) -> dict[str, str]:
    return {k: _str(v, _join(where, k)) for k, v in _table(value, where).items()}


def _list_of(read):
    def read_list(value: Any, where: str) -> tuple:
        if not isinstance(value, list):
            raise FieldError(where, f"expected a list, got {_show(value)}")
        return tuple(read(v, _join(where, i)) for i, v in enumerate(value))
    return read_list


# --- network policy (Harbor's allowlist normalization) ----------------------------------------------------
_HOST_LABEL = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")
_BAD_HOST = "allowed_hosts entries must be hostnames, IP addresses, or IP CIDR ranges, not URLs, ports, or paths"


def _allowed_hosts(value: Any, where: str) -> tuple[str, ...]:
    out = []
    for i, raw in enumerate(_str_list(value, where)):
        at = _join(where, i)
        host = raw.strip().lower().rstrip(".")
        if not host:
            raise FieldError(at, "allowed_hosts entries must be non-empty hostnames")
        if "/" in host or ":" in host:
            try:
                if "%" in host:
                    raise ValueError
                out.append(ip_network(host, strict=True).compressed if "/" in host else _ipv6(host))
            except ValueError:
                raise FieldError(at, f"{_BAD_HOST}, got {raw!r}") from None
            continue
        if "[" in host or "]" in host:
            raise FieldError(at, f"{_BAD_HOST}, got {raw!r}")
        name = host
        if host.startswith("*."):
            name = host[2:]
            try:
                ip_address(name)
            except ValueError:
                pass
            else:
                raise FieldError(at, "allowed_hosts wildcard entries must target hostnames, not IP address literals")
        elif "*" in host:
            raise FieldError(at, "allowed_hosts wildcard entries must use a leading '*.' prefix")
        if not name or not all(_HOST_LABEL.match(label) for label in name.split(".")):
            raise FieldError(at, f"{raw!r} is not an IP address, CIDR range, hostname or '*.' hostname pattern")
        out.append(host)
    return tuple(out)


def _ipv6(host: str) -> str:
    address = ip_address(host)
    if address.version != 6:
        raise ValueError(host)
    return address.compressed


def _check_network(mode: str | None, hosts: tuple[str, ...] | None, where: str) -> None:
    if mode is None:
        if hosts is not None:
            raise FieldError(_join(where, "allowed_hosts"), "is only valid when network_mode='allowlist'")
    elif mode != "allowlist" and hosts:
        raise FieldError(_join(where, "allowed_hosts"), "is only valid when network_mode='allowlist'")


# --- sections ------------------------------------------------------------------------------------------------
def _size_mb(value: str, where: str) -> int:
    """Harbor's `_parse_size_to_mb`: `2G` → 2048, `512M` → 512, `1024K` → 1 (case-insensitive, floats allowed)."""
    text = value.strip().upper()
    try:
        if text.endswith("G"):
            return int(float(text[:-1]) * 1024)
        if text.endswith("M"):
            return int(float(text[:-1]))
        if text.endswith("K"):
            return int(float(text[:-1]) / 1024)
    except ValueError:
        pass
    raise FieldError(where, f"invalid size {value!r}: expected a format like '1G', '512M'")


