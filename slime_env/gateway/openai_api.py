"""OpenAI Chat Completions on the wire: a request read into sampling parameters, a reply written as a completion or
as Server-Sent-Event chunks that reassemble to the same completion, and errors in OpenAI's body."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from slime_env.gateway import validation
from slime_env.gateway.conversation import GatewayError, normalize


@dataclass
class ChatRequest:
    """What the gateway takes from a chat-completions body."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    max_tokens: int | None
    sampling: dict[str, Any]
    stream: bool
    include_usage: bool
    logprobs: bool
    model: str


_UNSUPPORTED = {
    "response_format": (lambda v: isinstance(v, Mapping) and v.get("type") == "text",
                        "the gateway samples the model as it is and cannot constrain its output to a format; ask "
                        "for JSON in the prompt and parse the reply"),
    "logit_bias": (lambda v: v == {}, "not supported: the engines behind the gateway sample without logit biases"),
    "parallel_tool_calls": (lambda v: v is True, "the gateway cannot stop the model from making several calls in "
                                                "one reply; leave it unset (or true)"),
    "functions": (lambda v: v == [], "the legacy function-calling fields are not supported; use 'tools'"),
    "function_call": (lambda v: v in ("auto", "none"), "the legacy function-calling fields are not supported; use "
                                                       "'tools' and 'tool_choice'"),
    "modalities": (lambda v: v == ["text"], "only text output is supported"),
    "audio": (lambda v: False, "only text output is supported"),
    "prediction": (lambda v: False, "predicted outputs are not supported"),
    "web_search_options": (lambda v: False, "web search is not supported"),
    "reasoning_effort": (lambda v: False, "the gateway cannot set a reasoning effort: the model reasons as the "
                                          "chat template and its training make it"),
}


def parse_chat_request(body: Any) -> ChatRequest:
    """Validate an OpenAI chat-completions body; `GatewayError` names the first field it cannot honour."""
    if not isinstance(body, Mapping):
        raise GatewayError(400, "the request body must be a JSON object")
    messages = normalize(body.get("messages"))
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, Mapping) and t.get("type") == "function"
                                                  and isinstance(t.get("function"), Mapping) for t in tools):
            raise GatewayError(400, "tools: expected a list of {'type': 'function', 'function': {'name', "
                                    "'description', 'parameters'}}", param="tools")
        for k, t in enumerate(tools):
            fn, where = t["function"], f"tools[{k}].function"
            validation.check_tool(fn.get("name"), fn.get("description"), where)
            if fn.get("parameters") is not None:
                validation.check_schema(fn["parameters"], f"{where}.parameters")
        tools = [dict(t) for t in tools] or None
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise GatewayError(400, f"tool_choice {choice!r}: the gateway samples the model as it is and cannot force a "
                                "tool call; use 'auto' or 'none'", param="tool_choice")
    if choice == "none":
        tools = None
    n = body.get("n", 1)
    if n != 1 and n is not None:
        raise GatewayError(400, f"n={n}: one choice per call (send n calls; each is its own branch)", param="n")
    validation.refuse(body, _UNSUPPORTED)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise GatewayError(400, f"max_tokens: expected a positive integer, got {max_tokens!r}", param="max_tokens")
    # OpenAI's ranges: the client's out-of-range values are its 400, never the engine's failure
    values = {"temperature": validation.number(body, "temperature", 0, 2),
              "top_p": validation.number(body, "top_p", 0, 1, low_open=True),
              "presence_penalty": validation.number(body, "presence_penalty", -2, 2),
              "frequency_penalty": validation.number(body, "frequency_penalty", -2, 2),
              "sampling_seed": validation.seed(body, "seed")}
    sampling: dict[str, Any] = {k: v for k, v in values.items() if v is not None}
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
            raise GatewayError(400, "stop: a string or a list of up to 4 non-empty strings", param="stop")
        sampling["stop"] = stop
    if body.get("top_logprobs"):
        raise GatewayError(400, "top_logprobs: only the sampled tokens' log-probs are recorded; set logprobs: true",
                           param="top_logprobs")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, Mapping):
        raise GatewayError(400, f"stream_options: expected an object, got {options!r}", param="stream_options")
    return ChatRequest(messages=messages, tools=tools, max_tokens=max_tokens, sampling=sampling,
                       stream=bool(body.get("stream", False)), include_usage=bool((options or {}).get("include_usage")),
                       logprobs=bool(body.get("logprobs", False)), model=str(body.get("model") or ""))


def error_body(e: GatewayError) -> dict[str, Any]:
    return {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}}


def _finish(reason: str, has_calls: bool) -> str:
    if has_calls:
        return "tool_calls"
    return "length" if reason == "length" else "stop"


def _wire_calls(reply: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [{"id": c["id"], "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
            for c in reply.get("tool_calls", ())]


@dataclass
class Completion:
    """One generated reply as the gateway returns it."""

    reply: dict[str, Any]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    tokens: Sequence[str]  # each generated token's text, for `logprobs`
    logprobs: Sequence[float]
    model: str
    stop_sequence: str | None = None  # the agent's stop string the reply ended on (cut from the content)
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        self.id = self.id or f"chatcmpl-{uuid.uuid4().hex}"
        self.created = self.created or int(time.time())

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def _logprobs(self) -> dict[str, Any]:
        return {"content": [{"token": t, "logprob": float(lp), "bytes": list(t.encode()), "top_logprobs": []}
                            for t, lp in zip(self.tokens, self.logprobs)]}

    def body(self, with_logprobs: bool) -> dict[str, Any]:
        calls = _wire_calls(self.reply)
        message: dict[str, Any] = {"role": "assistant", "content": self.reply["content"] or (None if calls else ""),
                                   "refusal": None}
        if calls:
            message["tool_calls"] = calls
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": message, "finish_reason": _finish(self.finish_reason, bool(calls)),
                             "logprobs": self._logprobs() if with_logprobs else None}],
                "usage": self.usage()}

    def chunks(self, with_logprobs: bool, include_usage: bool) -> Iterator[dict[str, Any]]:
        """The completion as `chat.completion.chunk` objects: the role, the content token by token (with its
        log-prob), each tool call whole, the finish reason, then usage if asked. They reassemble to `body`."""
        head = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model}

        def chunk(delta: dict[str, Any], finish: str | None = None, lp: Any = None) -> dict[str, Any]:
            return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lp}],
                    **({"usage": None} if include_usage else {})}

        yield chunk({"role": "assistant", "content": ""})
        calls = _wire_calls(self.reply)
        content = self.reply["content"]
        if content:
            if with_logprobs and not calls and "".join(self.tokens) == content:
                for t, lp in zip(self.tokens, self.logprobs):
                    yield chunk({"content": t}, lp={"content": [{"token": t, "logprob": float(lp),
                                                                 "bytes": list(t.encode()), "top_logprobs": []}]})
            else:
                yield chunk({"content": content})
        for k, c in enumerate(calls):
            yield chunk({"tool_calls": [{"index": k, "id": c["id"], "type": "function",
                                         "function": {"name": c["function"]["name"],
                                                      "arguments": c["function"]["arguments"]}}]})
        yield chunk({}, _finish(self.finish_reason, bool(calls)))
        if include_usage:
            yield {**head, "choices": [], "usage": self.usage()}


def sse(event: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(event, ensure_ascii=False).encode() + b"\n\n"
