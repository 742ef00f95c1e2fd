"""Fenced Python code: every ```python (or ```py) block becomes a "python" tool call `{"code": ...}`."""

from __future__ import annotations

import re

from slime_env.parsers.result import ParseResult
from slime_env.types import ParseError, ToolCall

NAME = "python_block"
_BLOCK = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.DOTALL)
_OPEN = re.compile(r"```(?:python|py)[ \t]*\n")


def parse(text: str) -> ParseResult:
    calls = []
    end = 0
    for m in _BLOCK.finditer(text):
        end = m.end()
        calls.append(ToolCall(name="python", arguments={"code": m.group(1)}, raw=m.group(0)))
    errors = ()
    tail = _OPEN.search(text, end)
    if tail is not None:
        errors = (ParseError("```python block is not closed", text[tail.start():]),)
    return ParseResult(tuple(calls), errors)
