"""Tool-call formats of the model families users train, one parser each (the formats SGLang's function-call parsers
read). Each returns the calls with their exact source text (`raw`), malformed calls as errors (never an exception),
and `content`: the reply's text outside the calls.

- `llama3_json` (Llama 3.1 / 3.2 / 3.3): the reply is `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`, several separated by `;`.
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v0.3 tokenizers) or `[TOOL_CALLS]NAME[ARGS]{...}`
  repeated (Mistral-Small-3.2, Magistral, Devstral).
- `deepseek_v3`: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>` (V3, R1); `deepseek_v31`: the same section with
  `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>` (V3.1).
- `glm45` (GLM-4.5 / 4.6): `<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>...</tool_call>` (the
  template writes no newline after NAME); a value that is valid JSON is decoded, any other stays text.
- `kimi_k2`: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}
  <|tool_call_end|>...<|tool_calls_section_end|>`; the call id is `functions.NAME:IDX`.
- `minimax_m2`: `<minimax:tool_call>\n<invoke name="NAME"><parameter name="K">V</parameter>...</invoke>\n
  </minimax:tool_call>`; a value that is valid JSON is decoded, any other stays text.
- `qwen3_5`: Qwen3-Coder's XML calls as Qwen3.5's template writes them: a non-string value is written with Python's
  `str`, so `True` / `False` / `None` are read back as true / false / null (JSON values as `qwen3_coder` reads them).
- `gpt_oss` (harmony): calls are messages `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}
  <|call|>`; the content is the `final` channel's message (the `analysis` channel is reasoning, not content).
"""

from __future__ import annotations

import json
import re
from typing import Any

from slime_env.parsers import qwen3_coder
from slime_env.parsers.blocks import tool_call_blocks
from slime_env.parsers.result import ParseResult
from slime_env.types import ParseError, ToolCall


def _args(body: str, name: str, raw: str, errors: list[ParseError]) -> dict[str, Any] | None:
    try:
        args = json.loads(body) if body.strip() else {}
    except ValueError as e:
        errors.append(ParseError(f"arguments of {name!r} are not valid JSON: {e}", raw))
        return None
    if not isinstance(args, dict):
        errors.append(ParseError(f"arguments of {name!r} must be a JSON object, got {type(args).__name__}", raw))
        return None
    return args


def _call(obj: Any, raw: str, errors: list[ParseError], keys=("arguments", "parameters")) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        errors.append(ParseError("tool call must be an object with a string 'name'", raw))
        return None
    args = next((obj[k] for k in keys if k in obj), {})
    if isinstance(args, str):
        args = _args(args, obj["name"], raw, errors)
        if args is None:
            return None
    if not isinstance(args, dict):
        errors.append(ParseError(f"arguments of {obj['name']!r} must be an object", raw))
        return None
    return ToolCall(name=obj["name"], arguments=args, raw=raw, id=obj.get("id") if isinstance(obj.get("id"), str)
                    else None)


def _result(calls, errors, content: str) -> ParseResult:
    return ParseResult(tuple(calls), tuple(errors), content.strip())


def _section(text: str, begin: str, end: str) -> tuple[int, str, list[ParseError]] | None:
    """Where a `begin`…`end` tool-calls section starts, the section, and an error if it is never closed; None
    without one."""
    at = text.find(begin)
    if at < 0:
        return None
    section = text[at:]
    return at, section, [] if end in section else [ParseError(f"{begin} is not closed", section)]


# --- Llama 3.x JSON ---------------------------------------------------------------------------------------------
def llama3_json(text: str) -> ParseResult:
    body = text.strip()
    tagged = body.startswith("<|python_tag|>")
    if tagged:
        body = body[len("<|python_tag|>"):].strip()
    if not body.startswith("{"):
        return _result((), (), text)
    calls, errors = [], []
    decoder = json.JSONDecoder()
    at = 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except ValueError as e:
            errors.append(ParseError(f"tool call is not valid JSON: {e}", body[at:]))
            break
        call = _call(obj, body[at:end], errors, keys=("parameters", "arguments"))
        if call is not None:
            calls.append(call)
        at = end
        while at < len(body) and body[at] in " \n\t;":
            at += 1
    if not calls and not errors:
        return _result((), (), text)
    return _result(calls, errors, "")


# --- Mistral --------------------------------------------------------------------------------------------------
_MISTRAL_NAMED = re.compile(r"\[TOOL_CALLS\]\s*([A-Za-z0-9_.\-]+)\s*\[ARGS\]")


def mistral(text: str) -> ParseResult:
    at = text.find("[TOOL_CALLS]")
    if at < 0:
        return _result((), (), text)
    content, rest = text[:at], text[at:]
    calls, errors = [], []
    if _MISTRAL_NAMED.match(rest):
        decoder = json.JSONDecoder()
        pos = 0
        while True:
            m = _MISTRAL_NAMED.match(rest, pos)
            if m is None:
                if rest[pos:].strip():
                    errors.append(ParseError("text after the tool calls is not another [TOOL_CALLS]NAME[ARGS]",
                                             rest[pos:]))
                break
            try:
                args, end = decoder.raw_decode(rest, m.end())
            except ValueError as e:
                errors.append(ParseError(f"arguments of {m.group(1)!r} are not valid JSON: {e}", rest[pos:]))
                break
            raw = rest[pos:end]
            if isinstance(args, dict):
                calls.append(ToolCall(name=m.group(1), arguments=args, raw=raw))
            else:
                errors.append(ParseError(f"arguments of {m.group(1)!r} must be a JSON object", raw))
            pos = end
            while pos < len(rest) and rest[pos].isspace():
                pos += 1
        return _result(calls, errors, content)
    body = rest[len("[TOOL_CALLS]"):].strip()
    try:
        items, end = json.JSONDecoder().raw_decode(body)
    except ValueError as e:
        return _result((), (ParseError(f"[TOOL_CALLS] is not followed by a JSON list: {e}", rest),), content)
    for obj in items if isinstance(items, list) else [items]:
        call = _call(obj, rest, errors)
        if call is not None:
            calls.append(call)
    return _result(calls, errors, content)


# --- DeepSeek V3 / R1 and V3.1 ----------------------------------------------------------------------------------
_DS_BEGIN, _DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
_DS_CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁call▁end｜>", re.DOTALL)
_DS_V3_BODY = re.compile(r"\A\s*function<｜tool▁sep｜>([^\n]+)\n```(?:json)?\n(.*?)\n```\s*\Z", re.DOTALL)
_DS_V31_BODY = re.compile(r"\A\s*([^<\n]+?)<｜tool▁sep｜>(.*)\Z", re.DOTALL)


def _deepseek(text: str, body_re: re.Pattern) -> ParseResult:
    found = _section(text, _DS_BEGIN, _DS_END)
    if found is None:
        return _result((), (), text)
    at, section, errors = found
    calls = []
    for m in _DS_CALL.finditer(section):
        b = body_re.match(m.group(1))
        if b is None:
            errors.append(ParseError("tool call is not in this model's format", m.group(0)))
            continue
        name = b.group(1).strip()
        args = _args(b.group(2), name, m.group(0), errors)
        if args is not None:
            calls.append(ToolCall(name=name, arguments=args, raw=m.group(0)))
    return _result(calls, errors, text[:at])


def deepseek_v3(text: str) -> ParseResult:
    return _deepseek(text, _DS_V3_BODY)


def deepseek_v31(text: str) -> ParseResult:
    return _deepseek(text, _DS_V31_BODY)


# --- GLM-4.5 / 4.6 -------------------------------------------------------------------------------------------------
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def glm45(text: str) -> ParseResult:
    at = text.find("<tool_call>")
    if at < 0:
        return _result((), (), text)
    found, unclosed = tool_call_blocks(text)
    calls, errors = [], [unclosed] if unclosed is not None else []
    for m in found:
        inner = m.group(1)
        # the name ends at a newline (the model's output) or right at the first <arg_key> (as the template writes it)
        cut = min((i for i in (inner.find("\n"), inner.find("<arg_key>")) if i >= 0), default=len(inner))
        name, body = inner[:cut].strip(), inner[cut:]
        if not name or "<" in name:
            errors.append(ParseError("tool call has no function name before its arguments", m.group(0)))
            continue
        args = {k.strip(): _glm_value(v) for k, v in _GLM_ARG.findall(body)}
        if _GLM_ARG.sub("", body).strip():
            errors.append(ParseError(f"unexpected text in the arguments of {name!r}", m.group(0)))
            continue
        calls.append(ToolCall(name=name, arguments=args, raw=m.group(0)))
    return _result(calls, errors, text[:at])


def _glm_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


# --- Kimi-K2 ------------------------------------------------------------------------------------------------------
_KIMI_BEGIN, _KIMI_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
_KIMI_CALL = re.compile(r"<\|tool_call_begin\|>\s*([^<]+?)\s*<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>",
                        re.DOTALL)
# Kimi-K2 writes the id `functions.NAME:INDEX` and its name is read from there: any other id (an OpenAI `call_8f2`)
# carries no name, so it is an error rather than a call to a function named after the id.
_KIMI_ID = re.compile(r"\Afunctions\.([A-Za-z0-9_.\-]+):\d+\Z")


def kimi_k2(text: str) -> ParseResult:
    found = _section(text, _KIMI_BEGIN, _KIMI_END)
    if found is None:
        return _result((), (), text)
    at, section, errors = found
    calls = []
    for m in _KIMI_CALL.finditer(section):
        ident = m.group(1).strip()
        idm = _KIMI_ID.match(ident)
        if idm is None:
            errors.append(ParseError(f"tool call id {ident!r} is not functions.NAME:INDEX", m.group(0)))
            continue
        args = _args(m.group(2), idm.group(1), m.group(0), errors)
        if args is not None:
            calls.append(ToolCall(name=idm.group(1), arguments=args, raw=m.group(0), id=ident))
    return _result(calls, errors, text[:at])


# --- gpt-oss (harmony) ----------------------------------------------------------------------------------------------
_HARMONY_MSG = re.compile(r"(?:<\|start\|>assistant)?((?: to=[^<]*)?)<\|channel\|>(\w+)([^<]*?)"
                          r"(?:<\|constrain\|>\s*(\w+))?\s*"
                          r"<\|message\|>(.*?)(<\|call\|>|<\|end\|>|<\|return\|>|(?=<\|start\|>)|(?=<\|channel\|>)|\Z)",
                          re.DOTALL)
_HARMONY_TO = re.compile(r"to=functions\.([A-Za-z0-9_.\-]+)")


def gpt_oss(text: str) -> ParseResult:
    if "<|channel|>" not in text:
        return _result((), (), text)
    calls, errors, final = [], [], []
    for m in _HARMONY_MSG.finditer(text):
        channel, header, body, end = m.group(2), m.group(1) + m.group(3), m.group(5), m.group(6)
        to = _HARMONY_TO.search(header)
        if to is not None:
            if end not in ("<|call|>", ""):
                errors.append(ParseError(f"call to {to.group(1)!r} does not end with <|call|>", m.group(0)))
                continue
            args = _args(body, to.group(1), m.group(0), errors)
            if args is not None:
                calls.append(ToolCall(name=to.group(1), arguments=args, raw=m.group(0)))
        elif channel == "final":
            final.append(body)
    return _result(calls, errors, "".join(final))


def harmony_messages(text: str) -> tuple[str, str, list[ToolCall]]:
    """A generated harmony turn as (analysis text, final text, calls): what gpt-oss's template takes as `thinking`,
    `content` and `tool_calls`."""
    analysis, final = [], []
    for m in _HARMONY_MSG.finditer(text):
        if _HARMONY_TO.search(m.group(1) + m.group(3)) is None:
            (final if m.group(2) == "final" else analysis).append(m.group(5))
    return "".join(analysis), "".join(final), list(gpt_oss(text).tool_calls)


# --- MiniMax-M2 ---------------------------------------------------------------------------------------------------
_MM_BEGIN, _MM_END = "<minimax:tool_call>", "</minimax:tool_call>"
_MM_INVOKE = re.compile(r'<invoke name="([^"]*)">(.*?)</invoke>', re.DOTALL)
_MM_PARAM = re.compile(r'<parameter name="([^"]*)">(.*?)</parameter>', re.DOTALL)


def minimax_m2(text: str) -> ParseResult:
    found = _section(text, _MM_BEGIN, _MM_END)
    if found is None:
        return _result((), (), text)
    at, section, errors = found
    calls = []
    for m in _MM_INVOKE.finditer(section):
        name, body = m.group(1).strip(), m.group(2)
        if not name:
            errors.append(ParseError("<invoke> has no name", m.group(0)))
            continue
        args = {k: _glm_value(v) for k, v in _MM_PARAM.findall(body)}
        if _MM_PARAM.sub("", body).strip():
            errors.append(ParseError(f"unexpected text in the arguments of {name!r}", m.group(0)))
            continue
        calls.append(ToolCall(name=name, arguments=args, raw=m.group(0)))
    return _result(calls, errors, text[:at])


# --- Qwen3.5 ------------------------------------------------------------------------------------------------------
_PY_LITERALS = {"True": True, "False": False, "None": None}


def qwen3_5(text: str) -> ParseResult:
    r = qwen3_coder.parse(text)
    calls = tuple(ToolCall(name=c.name, arguments={k: _PY_LITERALS.get(v, v) if isinstance(v, str) else v
                                                   for k, v in c.arguments.items()}, raw=c.raw, id=c.id)
                  for c in r.tool_calls)
    at = text.find("<tool_call>")
    return ParseResult(calls, r.errors, (text if at < 0 else text[:at]).strip())


PARSERS = {"llama3_json": llama3_json, "mistral": mistral, "deepseek_v3": deepseek_v3, "deepseek_v31": deepseek_v31,
           "glm45": glm45, "kimi_k2": kimi_k2, "gpt_oss": gpt_oss, "minimax_m2": minimax_m2, "qwen3_5": qwen3_5}
