"""Anthropic Messages on the wire: a `/v1/messages` body read into the gateway's request (system prompt, `tool_use` /
`tool_result` blocks, tools with `input_schema`), a reply written as a `message` or as its stream of events
(`message_start`, content blocks with text and input-JSON deltas, `message_delta`, `message_stop`)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

from slime_env.gateway import validation
from slime_env.gateway.conversation import GatewayError, normalize
from slime_env.gateway.openai_api import ChatRequest, Completion


_UNSUPPORTED = {
    "thinking": (lambda v: isinstance(v, Mapping) and v.get("type") == "disabled",
                 "extended thinking cannot be switched on through the gateway: the model thinks as its chat template "
                 "and training make it, and its reply is returned as text"),
    "mcp_servers": (lambda v: v == [], "MCP servers are not supported; run the tools in the agent"),
    "container": (lambda v: False, "code-execution containers are not supported"),
    "context_management": (lambda v: v == {} or v == {"edits": []},
                           "server-side context editing is not supported: the agent manages its own context"),
    # Claude Code sends `effort` on every request; it is a hint the model is not sampled by (accepted, as a tool's
    # `strict`); a structured-output `format` would constrain the sample and is refused
    "output_config": (lambda v: isinstance(v, Mapping) and set(v) <= {"effort"},
                      "only output_config.effort is accepted (not enforced); a structured-output format is not"),
}
# The Messages API's fields: anything else is refused as Anthropic does ("Extra inputs are not permitted")
_KNOWN = {"model", "messages", "max_tokens", "system", "metadata", "stop_sequences", "stream", "temperature", "top_k",
          "top_p", "tools", "tool_choice", "thinking", "service_tier", "mcp_servers", "container",
          "context_management", "output_config", "inference_geo"}


def parse_messages_request(body: Any) -> ChatRequest:
    """Validate an Anthropic Messages body; `GatewayError` names the first field it cannot honour."""
    if not isinstance(body, Mapping):
        raise GatewayError(400, "the request body must be a JSON object")
    for key in body:
        if key not in _KNOWN:
            raise GatewayError(400, f"{key}: Extra inputs are not permitted", param=key)
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise GatewayError(400, f"max_tokens: required, a positive integer (got {max_tokens!r})", param="max_tokens")
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        messages.append({"role": "system", "content": _blocks_text(system, "system")})
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise GatewayError(400, "messages: expected a non-empty list", param="messages")
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping) or m.get("role") not in ("user", "assistant", "system"):
            raise GatewayError(400, f"{where}.role: 'user', 'assistant' or 'system'", param=f"{where}.role")
        if m["role"] == "system":  # a system message mid-conversation (Claude Code's environment context)
            messages.append({"role": "system", "content": _blocks_text(m.get("content"), f"{where}.content")})
        else:
            messages.extend(_message(m, where))
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
            raise GatewayError(400, "tools: expected a list of {'name', 'description', 'input_schema'}", param="tools")
        for k, t in enumerate(tools):
            if t.get("type") not in (None, "custom"):
                raise GatewayError(400, f"tools[{k}].type: {t['type']!r}: only client tools (name, description, "
                                        "input_schema) are supported", param=f"tools[{k}].type")
            validation.check_tool(t.get("name"), t.get("description"), f"tools[{k}]")
            if "input_schema" in t:
                validation.check_schema(t["input_schema"], f"tools[{k}].input_schema")
        tools = [{"type": "function", "function": {"name": t["name"], "description": t.get("description") or "",
                                                   "parameters": t.get("input_schema") or {"type": "object"}}}
                 for t in tools] or None
    raw_choice = body.get("tool_choice")
    if raw_choice is not None and not isinstance(raw_choice, Mapping):
        raise GatewayError(400, "tool_choice: expected an object such as {'type': 'auto'}", param="tool_choice")
    choice = (raw_choice or {}).get("type", "auto")
    if choice not in ("auto", "none"):
        raise GatewayError(400, f"tool_choice {choice!r}: the gateway samples the model as it is and cannot force a "
                                "tool call; use 'auto' or 'none'", param="tool_choice")
    if (raw_choice or {}).get("disable_parallel_tool_use"):
        raise GatewayError(400, "tool_choice.disable_parallel_tool_use: the gateway cannot stop the model from making "
                                "several calls in one reply", param="tool_choice.disable_parallel_tool_use")
    if choice == "none":
        tools = None
    validation.refuse(body, _UNSUPPORTED)
    # Anthropic's ranges: the client's out-of-range values are its 400, never the engine's failure
    values = {"temperature": validation.number(body, "temperature", 0, 1),
              "top_p": validation.number(body, "top_p", 0, 1, low_open=True),
              "top_k": validation.integer(body, "top_k", 0, 2**31 - 1)}
    sampling: dict[str, Any] = {k: v for k, v in values.items() if v is not None}
    stop = body.get("stop_sequences")
    if stop:
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise GatewayError(400, "stop_sequences: a list of non-empty strings", param="stop_sequences")
        sampling["stop"] = stop
    return ChatRequest(messages=normalize(messages), tools=tools, max_tokens=max_tokens, sampling=sampling,
                       stream=bool(body.get("stream", False)), include_usage=True, logprobs=False,
                       model=str(body.get("model") or ""))


def _blocks_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, Mapping) and b.get("type") == "text" for b in content):
        return "".join(str(b.get("text", "")) for b in content)
    raise GatewayError(400, f"{where}: a string or a list of text blocks", param=where)


def _message(m: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    """One Anthropic message as OpenAI-form messages: an assistant turn with its `tool_use` blocks as tool calls; a
    user turn's `tool_result` blocks as tool messages (first, as Anthropic orders them), then its text."""
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": m["role"], "content": content}]
    if not isinstance(content, list):
        raise GatewayError(400, f"{where}.content: a string or a list of blocks", param=f"{where}.content")
    text, calls, results = [], [], []
    for k, b in enumerate(content):
        kind = b.get("type") if isinstance(b, Mapping) else None
        at = f"{where}.content[{k}]"
        if kind == "text":
            text.append(str(b.get("text", "")))
        elif kind == "tool_use" and m["role"] == "assistant":
            if not isinstance(b.get("input"), Mapping):
                raise GatewayError(400, f"{at}.input: a JSON object", param=at)
            calls.append({"id": b.get("id"), "type": "function",
                          "function": {"name": b.get("name"), "arguments": json.dumps(b["input"])}})
        elif kind == "tool_result" and m["role"] == "user":
            results.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                            "content": _blocks_text(b.get("content") or "", f"{at}.content")})
        else:
            raise GatewayError(400, f"{at}: block type {kind!r} is not supported in a {m['role']} message (text, "
                                    "tool_use from the assistant, tool_result from the user)", param=at)
    if m["role"] == "assistant":
        return [{"role": "assistant", "content": "".join(text), **({"tool_calls": calls} if calls else {})}]
    return results + ([{"role": "user", "content": "".join(text)}] if text or not results else [])


def _stop_reason(done: Completion) -> str:
    if done.reply.get("tool_calls"):
        return "tool_use"
    if done.stop_sequence is not None:
        return "stop_sequence"
    return "max_tokens" if done.finish_reason == "length" else "end_turn"


def _blocks(done: Completion) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = [{"type": "text", "text": done.reply["content"]}] if done.reply["content"] else []
    blocks += [{"type": "tool_use", "id": c["id"], "name": c["name"], "input": c["arguments"]}
               for c in done.reply.get("tool_calls", ())]
    return blocks


def message_body(done: Completion) -> dict[str, Any]:
    return {"id": done.id.replace("chatcmpl-", "msg_"), "type": "message", "role": "assistant", "model": done.model,
            "content": _blocks(done), "stop_reason": _stop_reason(done),
            "stop_sequence": done.stop_sequence if _stop_reason(done) == "stop_sequence" else None,
            "usage": {"input_tokens": done.prompt_tokens, "output_tokens": done.completion_tokens}}


def events(done: Completion) -> Iterator[tuple[str, dict[str, Any]]]:
    """The reply as Anthropic stream events (name, data); they reassemble to `message_body`."""
    body = message_body(done)
    yield "message_start", {"type": "message_start", "message": {**body, "content": [], "stop_reason": None,
                                                                 "usage": {**body["usage"], "output_tokens": 0}}}
    for i, block in enumerate(body["content"]):
        if block["type"] == "text":
            yield "content_block_start", {"type": "content_block_start", "index": i,
                                          "content_block": {"type": "text", "text": ""}}
            yield "content_block_delta", {"type": "content_block_delta", "index": i,
                                          "delta": {"type": "text_delta", "text": block["text"]}}
        else:
            yield "content_block_start", {"type": "content_block_start", "index": i,
                                          "content_block": {**block, "input": {}}}
            yield "content_block_delta", {"type": "content_block_delta", "index": i,
                                          "delta": {"type": "input_json_delta",
                                                    "partial_json": json.dumps(block["input"])}}
        yield "content_block_stop", {"type": "content_block_stop", "index": i}
    yield "message_delta", {"type": "message_delta", "delta": {"stop_reason": body["stop_reason"],
                                                               "stop_sequence": body["stop_sequence"]},
                            "usage": {"output_tokens": body["usage"]["output_tokens"]}}
    yield "message_stop", {"type": "message_stop"}


def error_body(e: GatewayError) -> dict[str, Any]:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            413: "request_too_large"}.get(e.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}
