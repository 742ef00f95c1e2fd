"""Qwen3-Coder tool calls: `<tool_call><function=NAME><parameter=P>V</parameter>...</function></tool_call>`.

Parameter values lose one leading and one trailing newline (as the format writes them); a value that
is valid JSON (number, bool, null, object, list, quoted string) is decoded, otherwise it stays text.
"""

from __future__ import annotations

import json
import re

from slime_env.parsers.blocks import tool_call_blocks
from slime_env.parsers.result import ParseResult
from slime_env.types import ParseError, ToolCall

NAME = "qwen3_coder"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*\Z", re.DOTALL)
_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def parse(text: str) -> ParseResult:
    blocks, unclosed = tool_call_blocks(text)
    calls: list[ToolCall] = []
    errors: list[ParseError] = []
    for m in blocks:
        raw = m.group(0)
        fm = _FUNCTION.match(m.group(1))
        if fm is None:
            errors.append(ParseError("tool call has no complete <function=...>...</function>", raw))
            continue
        name, body = fm.group(1).strip(), fm.group(2)
        args = {}
        for pm in _PARAM.finditer(body):
            args[pm.group(1).strip()] = _value(pm.group(2))
        leftover = _PARAM.sub("", body).strip()
        if leftover:
            errors.append(ParseError(f"unexpected text in function {name!r}: {leftover[:80]!r}", raw))
            continue
        calls.append(ToolCall(name=name, arguments=args, raw=raw))
    if unclosed is not None:
        errors.append(unclosed)
    return ParseResult(tuple(calls), tuple(errors))


def _value(raw: str):
    if raw.startswith("\n"):
        raw = raw[1:]
    if raw.endswith("\n"):
        raw = raw[:-1]
    try:
        return json.loads(raw)
    except ValueError:
        return raw
