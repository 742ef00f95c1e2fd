"""Search-R1 actions: the first `<search>query</search>` or `<answer>text</answer>` in the turn.

Matches Search-R1's regex `<(search|answer)>(.*?)</\\1>` (first match wins). Yields a tool call
named "search" (`{"query": ...}`) or "answer" (`{"answer": ...}`); neither tag is a parse error.
"""

from __future__ import annotations

import re

from slime_env.parsers.result import ParseResult
from slime_env.types import ParseError, ToolCall

NAME = "search_r1"
_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)


def parse(text: str) -> ParseResult:
    m = _ACTION.search(text)
    if m is None:
        return ParseResult(errors=(ParseError("no <search>...</search> or <answer>...</answer> found", text[-200:]),))
    kind, body = m.group(1), m.group(2).strip()
    key = "query" if kind == "search" else "answer"
    return ParseResult(tool_calls=(ToolCall(name=kind, arguments={key: body}, raw=m.group(0)),))
