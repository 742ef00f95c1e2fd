"""Hermes / Qwen2.5 tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number per turn."""

from __future__ import annotations

import json

from slime_env.parsers.blocks import tool_call_blocks
from slime_env.parsers.result import ParseResult
from slime_env.types import ParseError, ToolCall

NAME = "hermes"


def parse(text: str) -> ParseResult:
    blocks, unclosed = tool_call_blocks(text)
    calls: list[ToolCall] = []
    errors: list[ParseError] = []
    for m in blocks:
        call = _decode(m.group(1), m.group(0), errors)
        if call is not None:
            calls.append(call)
    if unclosed is not None:
        errors.append(unclosed)
    return ParseResult(tuple(calls), tuple(errors))


def _decode(body: str, raw: str, errors: list[ParseError]) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError as e:
        errors.append(ParseError(f"tool call is not valid JSON: {e}", raw))
        return None
    if not isinstance(obj, dict):
        errors.append(ParseError(f"tool call must be a JSON object, got {type(obj).__name__}", raw))
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        errors.append(ParseError("tool call has no string 'name'", raw))
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            errors.append(ParseError(f"arguments of {name!r} are a string that is not JSON", raw))
            return None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        errors.append(ParseError(f"arguments of {name!r} must be an object, got {type(args).__name__}", raw))
        return None
    call_id = obj.get("id")
    return ToolCall(name=name, arguments=args, raw=raw, id=call_id if isinstance(call_id, str) else None)
