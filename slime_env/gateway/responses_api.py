"""OpenAI Responses on the wire (what Codex CLI and the `openai` SDK's `client.responses.create` send): a
`/v1/responses` body read into the same chat messages as a chat-completions request — so one conversation and one
ledger serve both — and a reply written as a `response` object or as its stream of events (`response.created`,
`response.in_progress`, per output item `response.output_item.added`, content parts with `response.output_text.delta` /
`response.reasoning_text.delta`, `response.function_call_arguments.delta` / `.done`, `response.output_item.done`, then
`response.completed` or `response.incomplete`).

Input items map onto chat messages: a string or message items (`input_text` / `output_text` parts) become
system / user / assistant messages, `instructions` a system message in front; consecutive assistant-side items (a
`reasoning` item, an assistant message, `function_call` items) become one assistant turn with its tool calls, as one
reply of ours gives them; `function_call_output` items become tool messages. A reply's leading `<think>` block (the
families that reason in text: Qwen3, DeepSeek-R1, ...) comes back as a `reasoning` item whose `encrypted_content`
carries the reply's text exactly as recorded, so a stateless client (Codex sends `store: false` and echoes its items)
continues the same branch. `previous_response_id` is served from the session's own record of its responses (those not
sent with `store: false`); anything else is refused with OpenAI's error body, as on chat completions.
"""

from __future__ import annotations

import base64
import binascii
import json
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from slime_env.gateway import validation
from slime_env.gateway.conversation import GatewayError, normalize
from slime_env.gateway.openai_api import ChatRequest, Completion

# Fields of the Responses API that the gateway honours, or accepts because they do not change the sample.
_KNOWN = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
          "temperature", "top_p", "stream", "stream_options", "store", "previous_response_id", "include", "reasoning",
          "text", "metadata", "user", "safety_identifier", "service_tier", "prompt_cache_key", "prompt_cache_retention",
          "truncation", "top_logprobs", "background", "conversation", "prompt", "max_tool_calls", "context_management",
          "client_metadata"}  # Codex CLI's request metadata

_UNSUPPORTED = {
    "background": (lambda v: v is False, "background responses are not supported: the gateway answers while the "
                                         "client waits"),
    "conversation": (lambda v: False, "conversations are not supported; send the history as input items, or use "
                                      "previous_response_id"),
    "prompt": (lambda v: False, "reusable prompt templates are not supported; send instructions and input"),
    "max_tool_calls": (lambda v: False, "built-in tools are not supported, so their calls cannot be bounded"),
    "context_management": (lambda v: v == [], "server-side compaction is not supported: the agent compacts its own "
                                              "history (the gateway records it as a new branch)"),
    "truncation": (lambda v: v == "disabled", "the gateway never drops input items to fit the context; a prompt that "
                                              "does not fit is a 400 (context_length_exceeded)"),
    "top_logprobs": (lambda v: v == 0, "only the sampled tokens' log-probs are recorded; include "
                                       "'message.output_text.logprobs' instead"),
}

_BUILT_IN = {"web_search", "web_search_preview", "web_search_preview_2025_03_11", "web_search_2025_08_26",
             "file_search", "computer", "computer_use", "computer_use_preview", "code_interpreter", "image_generation",
             "mcp", "local_shell", "shell", "apply_patch", "tool_search"}

_INCLUDABLE = {"message.output_text.logprobs", "reasoning.encrypted_content", "file_search_call.results",
               "web_search_call.results", "web_search_call.action.sources", "message.input_image.image_url",
               "computer_call_output.output.image_url", "code_interpreter_call.outputs"}

_ECHOED = ("tool_choice", "parallel_tool_calls", "temperature", "top_p", "max_output_tokens", "metadata", "user",
           "service_tier", "prompt_cache_key", "safety_identifier")


@dataclass
class ResponsesRequest(ChatRequest):
    """A Responses body as the gateway's request: `messages` start as the input items alone (with the instructions
    in front); `resolve` puts a `previous_response_id`'s record before them."""

    instructions: str | None = None
    items: list[dict[str, Any]] = field(default_factory=list)  # the input items as canonical chat messages
    previous_response_id: str | None = None
    store: bool = True
    output_logprobs: bool = False
    echo: dict[str, Any] = field(default_factory=dict)  # request fields the response object repeats
    tools_echo: list[dict[str, Any]] = field(default_factory=list)

    def resolve(self, record: Mapping[str, list[dict[str, Any]]]) -> None:
        """The full conversation: instructions, the previous response's (its input and output, from the session's
        `record`), then this request's input. OpenAI does not carry instructions over, nor does this."""
        before: list[dict[str, Any]] = []
        if self.previous_response_id is not None:
            if self.previous_response_id not in record:
                raise GatewayError(400, f"Previous response with id '{self.previous_response_id}' not found (only "
                                        "this session's responses created without store: false are kept)",
                                   param="previous_response_id", code="previous_response_not_found")
            before = record[self.previous_response_id]
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        self.messages = system + before + self.items


def parse_request(body: Any) -> ResponsesRequest:
    """Validate a Responses body; `GatewayError` names the first field it cannot honour."""
    if not isinstance(body, Mapping):
        raise GatewayError(400, "the request body must be a JSON object")
    for key in body:
        if key not in _KNOWN:
            raise GatewayError(400, f"Unknown parameter: '{key}'.", param=key, code="unknown_parameter")
    validation.refuse(body, _UNSUPPORTED)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise GatewayError(400, "instructions: expected a string", param="instructions")
    items = _items(body.get("input"))
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise GatewayError(400, "previous_response_id: expected a string", param="previous_response_id")
    if not items:
        raise GatewayError(400, "input: expected a non-empty string or list of items", param="input")
    tools, tools_echo = _tools(body.get("tools"))
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise GatewayError(400, f"tool_choice {choice!r}: the gateway samples the model as it is and cannot force or "
                                "restrict tool calls; use 'auto' or 'none'", param="tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise GatewayError(400, "parallel_tool_calls: expected a boolean", param="parallel_tool_calls")
    max_tokens = body.get("max_output_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise GatewayError(400, f"max_output_tokens: expected a positive integer, got {max_tokens!r}",
                           param="max_output_tokens")
    values = {"temperature": validation.number(body, "temperature", 0, 2),
              "top_p": validation.number(body, "top_p", 0, 1, low_open=True)}
    _reasoning_field(body.get("reasoning"))
    _text_field(body.get("text"))
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(i, str) and i in _INCLUDABLE for i in include):
        raise GatewayError(400, f"include: a list of {sorted(_INCLUDABLE)}", param="include")
    for key, kind in (("stream_options", Mapping), ("metadata", Mapping)):
        if body.get(key) is not None and not isinstance(body[key], kind):
            raise GatewayError(400, f"{key}: expected an object", param=key)
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise GatewayError(400, "store: expected a boolean", param="store")
    echo = {k: body.get(k) for k in _ECHOED}
    echo["tool_choice"] = choice or "auto"
    echo["parallel_tool_calls"] = True if parallel is None else parallel
    echo["metadata"] = dict(body.get("metadata") or {})
    return ResponsesRequest(
        messages=[], tools=None if choice == "none" else tools, max_tokens=max_tokens,
        sampling={k: v for k, v in values.items() if v is not None}, stream=bool(body.get("stream", False)),
        include_usage=True, logprobs=True,  # each token's text, to stream the reply token by token
        model=str(body.get("model") or ""), instructions=instructions, items=items, previous_response_id=previous,
        store=store is not False, output_logprobs="message.output_text.logprobs" in include, echo=echo,
        tools_echo=tools_echo)


def _reasoning_field(reasoning: Any) -> None:
    """`reasoning`: a summary style is accepted (there is none to give: the model's reasoning is returned whole); an
    effort the gateway cannot set is refused, as `reasoning_effort` is on chat completions."""
    if reasoning is None:
        return
    if not isinstance(reasoning, Mapping):
        raise GatewayError(400, "reasoning: expected an object", param="reasoning")
    if reasoning.get("effort") not in (None,):
        raise GatewayError(400, f"reasoning.effort {reasoning['effort']!r}: the gateway cannot set a reasoning effort: "
                                "the model reasons as its chat template and training make it; leave it unset",
                           param="reasoning.effort")


def _text_field(text: Any) -> None:
    if text is None:
        return
    if not isinstance(text, Mapping):
        raise GatewayError(400, "text: expected an object", param="text")
    fmt = text.get("format")
    if fmt is not None and not (isinstance(fmt, Mapping) and fmt.get("type") == "text"):
        raise GatewayError(400, "text.format: the gateway samples the model as it is and cannot constrain its output "
                                "to a format; ask for JSON in the prompt and parse the reply", param="text.format")
    if text.get("verbosity") not in (None, "medium"):
        raise GatewayError(400, f"text.verbosity {text['verbosity']!r}: the gateway cannot set a verbosity; leave it "
                                "unset (or 'medium')", param="text.verbosity")


def _tools(tools: Any) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]]]:
    """(the tools in chat-completions form, the tools as the response repeats them). Built-in tools are refused."""
    if tools is None:
        return None, []
    if not isinstance(tools, list):
        raise GatewayError(400, "tools: expected a list of function tools", param="tools")
    chat, echo = [], []
    for k, t in enumerate(tools):
        where = f"tools[{k}]"
        kind = t.get("type") if isinstance(t, Mapping) else None
        if kind != "function":
            why = f"built-in tool {kind!r} is not supported: the gateway serves a model, not OpenAI's hosted tools; " \
                  "run the tool in the agent and declare it" if kind in _BUILT_IN else \
                  f"tool type {kind!r} is not supported; declare each tool"
            raise GatewayError(400, f"{where}.type: {why} as a function tool ({{'type': 'function', 'name', "
                                    "'description', 'parameters'})", param=f"{where}.type", code="unsupported_value")
        validation.check_tool(t.get("name"), t.get("description"), where)
        if t.get("parameters") is not None:
            validation.check_schema(t["parameters"], f"{where}.parameters")
        fn = {"name": t["name"], "description": t.get("description") or "",
              "parameters": t.get("parameters") or {"type": "object", "properties": {}}}
        chat.append({"type": "function", "function": fn})
        echo.append({"type": "function", "name": t["name"], "description": t.get("description"),
                     "parameters": t.get("parameters"), "strict": t.get("strict")})
    return chat or None, echo


# --- input items -> chat messages ------------------------------------------------------------------------------
_REASONING_TAG = "slime-env.v1:"


def _items(raw: Any) -> list[dict[str, Any]]:
    """The input as canonical chat messages (`conversation.normalize`); [] for none."""
    if raw is None:
        return []
    if isinstance(raw, str):
        return normalize([{"role": "user", "content": raw}]) if raw else []
    if not isinstance(raw, list):
        raise GatewayError(400, "input: expected a string or a list of items", param="input")
    messages: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant turn being assembled from consecutive items
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise GatewayError(400, f"{where}: expected an object", param=where)
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") != "assistant":
            turn = None
            role = item.get("role")
            if role not in ("user", "system", "developer"):
                raise GatewayError(400, f"{where}.role: {role!r} is not one of ['user', 'system', 'developer', "
                                        "'assistant']", param=f"{where}.role")
            messages.append({"role": role, "content": _parts(item.get("content"), f"{where}.content",
                                                             ("input_text",))})
        elif kind == "function_call_output":
            turn = None
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise GatewayError(400, f"{where}.call_id: the id of the call this output answers",
                                   param=f"{where}.call_id")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": _parts(item.get("output"), f"{where}.output", ("input_text", "output_text"))})
        elif kind in ("message", "reasoning", "function_call"):
            # one reply gives [reasoning] [message] [function_call...]: an item that cannot follow starts a new turn
            if turn is None or (kind == "reasoning" and (turn["text"] is not None or turn["calls"])) \
                    or (kind == "message" and (turn["text"] is not None or turn["calls"])):
                turn = {"turn": True, "reasoning": [], "sealed": None, "text": None, "calls": []}
                messages.append(turn)
            _add_to_turn(turn, item, kind, where)
        else:
            raise GatewayError(400, f"{where}.type: input item type {kind!r} is not supported (message, function_call, "
                                    "function_call_output, reasoning)", param=f"{where}.type")
    return normalize([_assistant(m) if m.get("turn") else m for m in messages]) if messages else []


def _add_to_turn(turn: dict[str, Any], item: Mapping[str, Any], kind: str, where: str) -> None:
    if kind == "reasoning":
        texts = [p.get("text") for p in (item.get("content") or []) if isinstance(p, Mapping)] or \
                [p.get("text") for p in (item.get("summary") or []) if isinstance(p, Mapping)]
        if not all(isinstance(t, str) for t in texts):
            raise GatewayError(400, f"{where}: reasoning parts need a 'text' string", param=where)
        turn["reasoning"].append("\n".join(texts))
        sealed = item.get("encrypted_content")
        if isinstance(sealed, str) and sealed.startswith(_REASONING_TAG):
            try:
                turn["sealed"] = base64.urlsafe_b64decode(sealed[len(_REASONING_TAG):]).decode()
            except (binascii.Error, UnicodeDecodeError):
                raise GatewayError(400, f"{where}.encrypted_content: not one this gateway wrote",
                                   param=f"{where}.encrypted_content") from None
    elif kind == "message":
        turn["text"] = _parts(item.get("content"), f"{where}.content", ("output_text", "refusal", "input_text"))
    else:
        name, args, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
        if not isinstance(name, str) or not isinstance(args, str) or not isinstance(call_id, str):
            raise GatewayError(400, f"{where}: a function_call needs 'call_id', 'name' and 'arguments' strings",
                               param=where)
        turn["calls"].append({"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})


def _assistant(turn: Mapping[str, Any]) -> dict[str, Any]:
    """One assistant turn as a chat message. Its content is the reply's text as recorded when a reasoning item
    carries it (our `encrypted_content`) and the visible text is unchanged; else the reasoning in `<think>` tags (the
    form thinking templates read) before the text."""
    text = turn["text"] or ""
    sealed = turn["sealed"]
    if sealed is not None and split_reasoning(sealed)[1] == text:
        content = sealed
    elif any(turn["reasoning"]):
        content = "<think>\n" + "\n".join(turn["reasoning"]) + "\n</think>\n\n" + text
    else:
        content = text
    return {"role": "assistant", "content": content, **({"tool_calls": turn["calls"]} if turn["calls"] else {})}


def _parts(content: Any, where: str, kinds: tuple[str, ...]) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise GatewayError(400, f"{where}: expected a string or a list of {'/'.join(kinds)} parts", param=where)
    out = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        text = part.get("text", part.get("refusal")) if isinstance(part, Mapping) else None
        if kind not in kinds or not isinstance(text, str):
            raise GatewayError(400, f"{where}[{k}]: part type {kind!r} is not supported here (text only: "
                                    f"{', '.join(kinds)})", param=f"{where}[{k}]")
        out.append(text)
    return "".join(out)


def split_reasoning(content: str) -> tuple[str | None, str]:
    """(the reasoning, the visible text) of a reply: a leading `<think>...</think>` block (or text up to `</think>`,
    where the generation prompt opened the block), else (None, content)."""
    close = content.find("</think>")
    if close < 0:
        return None, content
    start = content.find("<think>")
    if start > close or (start >= 0 and content[:start].strip()):
        return None, content
    inner = content[start + len("<think>") if start >= 0 else 0:close]
    return inner.strip(), content[close + len("</think>"):].lstrip()


# --- the reply -------------------------------------------------------------------------------------------------
def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_body(done: Completion, req: ResponsesRequest, response_id: str) -> dict[str, Any]:
    """The `response` object of a finished call."""
    reply = done.reply
    reasoning, text = split_reasoning(reply["content"] or "")
    calls = reply.get("tool_calls", ())
    output: list[dict[str, Any]] = []
    if reasoning is not None:
        sealed = _REASONING_TAG + base64.urlsafe_b64encode(reply["content"].encode()).decode()
        output.append({"id": _id("rs"), "type": "reasoning", "summary": [],
                       "content": [{"type": "reasoning_text", "text": reasoning}], "encrypted_content": sealed,
                       "status": "completed"})
    incomplete = done.finish_reason == "length"
    if text or not calls:
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
        if req.output_logprobs:
            part["logprobs"] = [{"token": t, "logprob": float(lp), "bytes": list(t.encode()), "top_logprobs": []}
                                for t, lp in zip(done.tokens, done.logprobs)]
        output.append({"id": _id("msg"), "type": "message", "role": "assistant",
                       "status": "incomplete" if incomplete else "completed", "content": [part]})
    output += [{"id": _id("fc"), "type": "function_call", "call_id": c["id"], "name": c["name"],
                "arguments": json.dumps(c["arguments"], ensure_ascii=False), "status": "completed"} for c in calls]
    return {"id": response_id, "object": "response", "created_at": done.created,
            "status": "incomplete" if incomplete else "completed", "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.instructions, "model": done.model, "output": output,
            **req.echo, "tools": req.tools_echo, "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": req.store, "text": {"format": {"type": "text"}},
            "truncation": "disabled", "completed_at": int(time.time()),
            "usage": {"input_tokens": done.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": done.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": done.prompt_tokens + done.completion_tokens}}


def events(body: Mapping[str, Any], done: Completion) -> Iterator[dict[str, Any]]:
    """The response as its stream of events (numbered); they reassemble to `body`. The message text comes token by
    token where the tokens spell it (with their log-probs if asked), else whole."""
    seq = iter(range(1 << 30))
    start = {**body, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None,
             "completed_at": None}

    def event(kind: str, **data: Any) -> dict[str, Any]:
        return {"type": kind, "sequence_number": next(seq), **data}

    yield event("response.created", response=start)
    yield event("response.in_progress", response=start)
    for n, item in enumerate(body["output"]):
        at = {"item_id": item["id"], "output_index": n}
        if item["type"] == "function_call":
            yield event("response.output_item.added", output_index=n,
                        item={**item, "arguments": "", "status": "in_progress"})
            yield event("response.function_call_arguments.delta", **at, delta=item["arguments"])
            yield event("response.function_call_arguments.done", **at, name=item["name"],
                        arguments=item["arguments"])
            yield event("response.output_item.done", output_index=n, item=item)
            continue
        (part,) = item["content"]
        empty = {k: ([] if k in ("annotations", "logprobs") else "" if k == "text" else v) for k, v in part.items()}
        yield event("response.output_item.added", output_index=n, item={**item, "content": [], "status": "in_progress"})
        yield event("response.content_part.added", **at, content_index=0, part=empty)
        if item["type"] == "reasoning":
            yield event("response.reasoning_text.delta", **at, content_index=0, delta=part["text"])
            yield event("response.reasoning_text.done", **at, content_index=0, text=part["text"])
        else:
            lps = part.get("logprobs")
            tokens = _spelling(done.tokens, part["text"])
            if tokens:
                for k, t in enumerate(tokens):
                    yield event("response.output_text.delta", **at, content_index=0, delta=t,
                                logprobs=[lps[k]] if lps else [])
            elif part["text"]:
                yield event("response.output_text.delta", **at, content_index=0, delta=part["text"],
                            logprobs=lps or [])
            yield event("response.output_text.done", **at, content_index=0, text=part["text"], logprobs=lps or [])
        yield event("response.content_part.done", **at, content_index=0, part=part)
        yield event("response.output_item.done", output_index=n, item=item)
    yield event("response.incomplete" if body["status"] == "incomplete" else "response.completed", response=body)


def _spelling(tokens: Sequence[str], text: str) -> list[str] | None:
    """The leading tokens whose texts spell `text` exactly (the end token left out), else None."""
    out, spelt = [], ""
    for t in tokens:
        if spelt == text or not text.startswith(spelt + t):
            break
        out.append(t)
        spelt += t
    return out if spelt == text and text else None


def record(req: ResponsesRequest, done: Completion) -> list[dict[str, Any]]:
    """What `previous_response_id` continues from: this response's conversation without its instructions, our reply
    last (as the conversation recorded it)."""
    return [*req.messages[1 if req.instructions else 0:], done.reply]
