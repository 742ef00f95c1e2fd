"""`ParseResult` and the `Parser` signature: what every tool-call parser returns, apart from the registry that
imports the parsers (so that a parser module never imports its half-loaded package)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from slime_env.types import ParseError, ToolCall


@dataclass(frozen=True, slots=True)
class ParseResult:
    """Tool calls found in one assistant turn, and the malformed ones as errors; `content`, where the parser says
    it, is the turn's text outside the calls (what an OpenAI client shows as the message's content)."""

    tool_calls: tuple[ToolCall, ...] = ()
    errors: tuple[ParseError, ...] = ()
    content: str | None = None


Parser = Callable[[str], ParseResult]
