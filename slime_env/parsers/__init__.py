"""Tool-call parsers: assistant text -> (tool calls, parse errors). A parser never raises.

Select one by name (`get_parser("hermes")`) or by import path (`"pkg.mod:fn"`); add your own with
`register_parser("name", fn)`. A parser is any callable `fn(text: str) -> ParseResult`.
"""

from __future__ import annotations

from slime_env.errors import InvalidInput
from slime_env.loading import load_object
from slime_env.parsers import families, hermes, python_block, qwen3_coder, search_r1
from slime_env.parsers.result import ParseResult, Parser
from slime_env.types import ParseError

_PARSERS: dict[str, Parser] = {}


def register_parser(name: str, fn: Parser, *, override: bool = False) -> None:
    """Make `fn` selectable as `name`."""
    if name in _PARSERS and not override:
        raise InvalidInput(f"parser {name!r} is already registered")
    _PARSERS[name] = fn


def parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_parser(spec: str | Parser | None) -> Parser | None:
    """A registered name, an import path, a callable, or None (no parsing). Wrapped so it never raises."""
    if spec is None:
        return None
    if callable(spec):
        fn = spec
    elif spec in _PARSERS:
        fn = _PARSERS[spec]
    elif isinstance(spec, str) and ("." in spec or ":" in spec):
        fn = load_object(spec)
    else:
        raise InvalidInput(f"unknown parser {spec!r}; registered: {parser_names()}")
    return _never_raises(fn)


def _never_raises(fn: Parser) -> Parser:
    if getattr(fn, "_never_raises", False):
        return fn

    def safe(text: str) -> ParseResult:
        try:
            result = fn(text)
        except Exception as e:  # a user parser's bug becomes a parse error, not a crashed episode
            return ParseResult(errors=(ParseError(f"parser {getattr(fn, '__name__', fn)!r} raised {e!r}", ""),))
        if not isinstance(result, ParseResult):
            return ParseResult(errors=(ParseError(f"parser returned {type(result).__name__}, not ParseResult"),))
        return result

    safe._never_raises = True  # type: ignore[attr-defined]
    safe.__name__ = getattr(fn, "__name__", "parser")
    return safe


for _mod in (hermes, qwen3_coder, search_r1, python_block):
    register_parser(_mod.NAME, _mod.parse)
for _name, _fn in families.PARSERS.items():
    register_parser(_name, _fn)

__all__ = ["ParseResult", "Parser", "get_parser", "parser_names", "register_parser"]
