"""Tool sections and tool calls for templates that have none: both in the parser's own call format.

A model whose chat template renders no `tools` (SmolLM2's, the default model's) would otherwise never see them. The
runner then puts this section into the system message — the same text the family of the parser writes for its own
models (hermes: Qwen2.5's template, verbatim), so the calls the model learns to make are the ones the parser reads.
Likewise a template that ignores an assistant message's structured `tool_calls` would show an empty turn: `call_text`
writes the calls as the family's template writes them (what the parser reads back).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence

from slime_env.errors import InvalidInput
from slime_env.types import Message


def _functions(tools: Sequence[Mapping]) -> list[Mapping]:
    return [t.get("function", t) if t.get("type") == "function" else t for t in tools]


def hermes(tools: Sequence[Mapping]) -> str:
    """Qwen2.5's tool section (the hermes format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`)."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n" + lines +
            "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
            "<args-json-object>}\n</tool_call>")


def llama3_json(tools: Sequence[Mapping]) -> str:
    """Llama 3.1's JSON tool-calling instructions (its template's user-turn section, moved to the system)."""
    funcs = "\n\n".join(json.dumps(t, indent=4, ensure_ascii=False) for t in tools)
    return ("Given the following functions, please respond with a JSON for a function call with its proper "
            "arguments that best answers the given prompt.\n\nRespond in the format {\"name\": function name, "
            "\"parameters\": dictionary of argument name and its value}. Do not use variables.\n\n" + funcs)


def qwen3_coder(tools: Sequence[Mapping]) -> str:
    """Qwen3-Coder's XML tool section
    (`<tool_call><function=NAME><parameter=K>V</parameter></function></tool_call>`)."""
    out = ["# Tools\n\nYou have access to the following functions:\n\n<tools>"]
    for f in _functions(tools):
        out.append(f"<function>\n<name>{f.get('name')}</name>\n<description>{f.get('description', '')}</description>")
        out.append("<parameters>")
        for name, spec in (f.get("parameters") or {}).get("properties", {}).items():
            out.append(f"<parameter>\n<name>{name}</name>\n<type>{spec.get('type', '')}</type>\n"
                       f"<description>{spec.get('description', '')}</description>\n</parameter>")
        out.append("</parameters>\n</function>")
    out.append("</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
               "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
               "</parameter>\n</function>\n</tool_call>")
    return "\n".join(out)


TOOL_PROMPTS: dict[str, Callable[[Sequence[Mapping]], str]] = {"hermes": hermes, "llama3_json": llama3_json,
                                                                "qwen3_coder": qwen3_coder}


def tool_prompt(parser: str | None, tools: Sequence[Mapping]) -> str:
    """The tool section for `parser`'s call format; InvalidInput when the parser has none (describe your tools in
    the system prompt yourself, or use a parser of this list)."""
    if parser not in TOOL_PROMPTS:
        raise InvalidInput(f"the chat template renders no tools and parser {parser!r} has no tool section of its own "
                           f"(those that do: {sorted(TOOL_PROMPTS)}); describe the tools in the env's system prompt")
    return TOOL_PROMPTS[parser](list(tools))


def _hermes_calls(content: str, calls: Sequence[Mapping]) -> str:
    """Qwen2.5 / Qwen3's form: the content, then each call as `<tool_call>` + its JSON (`{"name": ..., "arguments":
    ...}`) + `</tool_call>`, on lines of their own."""
    blocks = ["<tool_call>\n" + json.dumps({"name": c["name"], "arguments": c["arguments"]}, ensure_ascii=False)
              + "\n</tool_call>" for c in calls]
    return "\n".join([content, *blocks] if content else blocks)


def _llama3_calls(content: str, calls: Sequence[Mapping]) -> str:
    """Llama 3.1's form: the calls alone, `{"name": ..., "parameters": ...}`, separated by `; ` (its template drops
    the content of a turn with calls)."""
    return "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}, ensure_ascii=False) for c in calls)


def _qwen3_coder_calls(content: str, calls: Sequence[Mapping]) -> str:
    """Qwen3-Coder's form: `<tool_call>`, `<function=NAME>`, each `<parameter=K>` V `</parameter>`, `</function>`,
    `</tool_call>` on lines of their own; a string value as it is, any other as JSON."""
    blocks = []
    for c in calls:
        params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n"
                         "</parameter>\n" for k, v in c["arguments"].items())
        blocks.append(f"<tool_call>\n<function={c['name']}>\n{params}</function>\n</tool_call>")
    return "\n".join([content, *blocks] if content else blocks)


CALL_TEXTS: dict[str, Callable[[str, Sequence[Mapping]], str]] = {
    "hermes": _hermes_calls, "llama3_json": _llama3_calls, "qwen3_coder": _qwen3_coder_calls}


def call_text(parser: str | None, content: str, calls: Sequence[Mapping]) -> str | None:
    """An assistant turn with tool `calls` ({"name", "arguments"}) as text in `parser`'s format; None when the parser
    has no such form here (the template must then write the structured calls itself)."""
    form = CALL_TEXTS.get(parser) if isinstance(parser, str) else None
    return None if form is None else form(content, calls)


def with_system_section(messages: Sequence[Message], section: str) -> list[Message]:
    """`messages` with `section` after the system message's text (a system message of its own if there is none)."""
    if messages and messages[0].role == "system":
        first = messages[0]
        return [dataclasses.replace(first, content=f"{first.content}\n\n{section}"), *messages[1:]]
    return [Message("system", section), *messages]
