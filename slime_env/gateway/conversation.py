"""An agent session's calls as exact token ledgers: continuation, branching, and the agent's messages checked.

A free-form agent sends the whole conversation on every call. A call whose messages are an earlier call's messages
plus the reply we gave plus new non-assistant messages (tool results, user turns) *continues* that branch: only the
new messages are rendered (the renderer's bridge after the ids the model generated, checked against a full render in
strict mode) and the ledger grows. Any other call starts a new branch rendered from scratch — the agent rewrote
history (summarised, truncated), a sub-agent opened its own context, two calls forked one branch, or the agent edited
a reply we gave (the edited turn is never attributed to the model: the new branch's prompt holds it with loss mask
0). Each branch becomes one trajectory; `parent` and `fork_at` link a branch to the one it shares a prefix with.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from slime_env.ledger import TokenLedger
from slime_env.parsers.prompts import tool_prompt, with_system_section
from slime_env.renderers.template import VerifiedPrefix
from slime_env.types import Generation, Message


class GatewayError(Exception):
    """A request the gateway refuses: HTTP `status`, OpenAI error `kind` and a message naming the field."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


ROLES = ("system", "developer", "user", "assistant", "tool")


def normalize(messages: Any) -> list[dict[str, Any]]:
    """OpenAI chat messages in one canonical form (text content; tool calls with parsed arguments), or a
    `GatewayError` naming the first bad field. Developer messages are system messages to a chat template."""
    if not isinstance(messages, list) or not messages:
        raise GatewayError(400, "messages: expected a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise GatewayError(400, f"{where}: expected an object", param=where)
        role = m.get("role")
        if role not in ROLES:
            raise GatewayError(400, f"{where}.role: {role!r} is not one of {list(ROLES)}", param=f"{where}.role")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                               "content": _text(m.get("content"), f"{where}.content")}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = [_tool_call(tc, f"{where}.tool_calls[{k}]") for k, tc in enumerate(m["tool_calls"])]
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise GatewayError(400, f"{where}.tool_call_id: a tool message needs the id of the call it answers",
                                   param=f"{where}.tool_call_id")
            msg["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise GatewayError(400, f"{where}[{k}]: only text parts are supported (type 'text' with 'text')",
                                   param=f"{where}[{k}]")
            parts.append(part["text"])
        return "".join(parts)
    raise GatewayError(400, f"{where}: expected a string, a list of text parts or null", param=where)


def _tool_call(tc: Any, where: str) -> dict[str, Any]:
    fn = tc.get("function") if isinstance(tc, Mapping) else None
    if not (isinstance(fn, Mapping) and isinstance(fn.get("name"), str)):
        raise GatewayError(400, f"{where}: expected {{'type': 'function', 'function': {{'name', 'arguments'}}}}",
                           param=where)
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except json.JSONDecodeError as e:
            raise GatewayError(400, f"{where}.function.arguments: not valid JSON ({e.msg})", param=where) from None
    if not isinstance(args, Mapping):
        raise GatewayError(400, f"{where}.function.arguments: expected a JSON object", param=where)
    return {"id": tc.get("id"), "name": fn["name"], "arguments": dict(args)}


def _same(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Two canonical messages say the same thing (tool-call ids and argument spacing aside)."""
    calls = [[(c["name"], c["arguments"]) for c in m.get("tool_calls", ())] for m in (a, b)]
    return (a["role"], a["content"], a.get("tool_call_id")) == (b["role"], b["content"], b.get("tool_call_id")) \
        and calls[0] == calls[1]


def template_dict(m: Mapping[str, Any]) -> dict[str, Any]:
    """A canonical message as Hugging Face chat templates take it (tool-call arguments as objects)."""
    d: dict[str, Any] = {"role": m["role"], "content": m["content"]}
    if m.get("tool_calls"):
        d["tool_calls"] = [{"id": c["id"], "type": "function",
                            "function": {"name": c["name"], "arguments": c["arguments"]}} for c in m["tool_calls"]]
    for key in ("tool_call_id", "name"):
        if m.get(key) is not None:
            d[key] = m[key]
    return d


def _as_message(m: Mapping[str, Any], calls: Mapping[str, str]) -> Message:
    """A new (user / tool / system) message for the renderer's bridge; a tool result gets its call's name."""
    name = m.get("name") or (calls.get(m["tool_call_id"]) if m["role"] == "tool" else None)
    return Message(m["role"], m["content"], name=name, tool_call_id=m.get("tool_call_id"))


@dataclass
class Branch:
    """One linear conversation of a session and its ledger."""

    index: int
    tools: list[dict[str, Any]] | None  # as the agent sent them
    messages: list[dict[str, Any]]  # canonical, as the agent sees them (our replies included)
    history: list[Message]  # as the renderer sees them (our replies as the text the model generated)
    ledger: TokenLedger
    parent: int | None = None
    fork_at: int = 0
    reason: str = ""
    last_ids: list[int] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    busy: bool = False
    history_rewrites: list[str] = field(default_factory=list)
    verified: VerifiedPrefix = field(default_factory=VerifiedPrefix)  # strict mode's proved prefix of the ledger
    template_tools: list[dict[str, Any]] | None = None  # what the chat template gets (None: in the system message)


@dataclass
class Call:
    """A planned call: its branch, the ids the engine is given, and what `finish` records (the new messages, as
    the agent sent them and as rendered, and the bridge ids), or a branch `created` by this call."""

    branch: Branch
    ids: list[int]
    new: list[dict[str, Any]]
    observations: list[Message]
    bridge: list[int]
    created: bool = False
    rewrite: str | None = None  # strict mode: a known history rewrite of the template, noted on the branch
    verified: VerifiedPrefix | None = None  # strict mode: the branch's proved prefix once this call is recorded


class Conversation:
    """The branches of one agent session (see the module docstring). `renderer`: the model's `TemplateRenderer`;
    `parser`: the family's tool-call parser (`slime_env.parsers`) or None; `strict` checks every bridge against a
    full render and raises `RenderMismatch` on any difference."""

    def __init__(self, renderer: Any, parser: Any = None, *, strict: bool = False, parser_name: str | None = None):
        self.renderer, self.parser, self.strict = renderer, parser, strict
        self.parser_name = parser_name
        self.branches: list[Branch] = []

    def begin(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Call:
        """Plan a call with canonical `messages`: the branch it continues (busy until `finish` or `abandon`, so no
        other call continues it meanwhile) and the rendered new messages, or a new branch. Nothing is recorded
        until `finish`: a call refused or failed before a generation leaves the session as it was."""
        tools = tools or None
        for b in reversed(self.branches):
            new = self._continues(b, messages, tools)
            if new is not None:
                calls = {c["id"]: c["name"] for m in b.messages for c in m.get("tool_calls", ()) if c.get("id")}
                obs = [_as_message(m, calls) for m in new]
                bridge = self.renderer.bridge(b.last_ids, obs, b.history)
                ids = b.ledger.ids + bridge
                note, verified = None, VerifiedPrefix(b.verified.text, b.verified.ids)
                if self.strict:  # the checks run before the engine is called: a mismatch records nothing
                    note = self.renderer.check_full(b.history + obs, ids, tools=b.template_tools, verified=verified)
                    if note is not None:  # a known rewrite of history: the bridge is checked on its own
                        self.renderer.check_bridge(b.history, b.last_ids, obs, bridge, tools=b.template_tools)
                b.busy = True
                return Call(b, ids, new, obs, bridge, rewrite=note, verified=verified)
        parent, shared, reason = self._closest(messages, tools)
        r = self.renderer
        history = [self._history_message(m) for m in messages]
        template_tools = tools
        if tools and not r.renders_tools:
            # The template has no tool section: the model reads the tools in the system message, in the parser's own
            # format (what the env side does too); the agent's messages stay as it sent them.
            history = with_system_section(history, tool_prompt(self.parser_name, tools))
            template_tools = None
            ids = r.encode(r.render_text(history, tools=None, add_generation_prompt=True))
        else:
            ids = r.encode(r.render_text([template_dict(m) for m in messages], tools=tools, add_generation_prompt=True))
        b = Branch(len(self.branches), tools, list(messages), history, TokenLedger(ids), parent=parent,
                   fork_at=shared, reason=reason, busy=True, template_tools=template_tools)
        return Call(b, list(ids), [], [], [], created=True)

    def finish(self, call: Call, gen: Generation, latency_s: float) -> dict[str, Any]:
        """Record the call (its new messages, then the generation) on its branch; return the assistant message as
        the agent gets it (content, and `tool_calls` with parsed arguments when the parser found calls)."""
        b = call.branch
        if call.created:
            b.index = len(self.branches)
            self.branches.append(b)
        else:
            b.ledger.add_inserted(call.bridge, len(b.calls) - 1)
            b.history.extend(call.observations)
            b.messages.extend(call.new)
            if call.rewrite is not None:
                b.history_rewrites.append(call.rewrite)
            if call.verified is not None:
                b.verified = call.verified
        turn = len(b.calls)
        b.ledger.add_generated(gen.token_ids, gen.logprobs, turn)
        text = self.renderer.assistant_text(gen.token_ids)
        content, calls = text, []
        if self.parser is not None:
            parsed = self.parser(text)
            if parsed.tool_calls:
                calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "name": c.name, "arguments": dict(c.arguments)}
                         for c in parsed.tool_calls]
                content = parsed.content if parsed.content is not None else \
                    _before_calls(text, [c.raw for c in parsed.tool_calls])
        reply = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
        b.messages.append(reply)
        b.history.append(Message("assistant", text))
        b.last_ids = list(gen.token_ids)
        b.calls.append({"prompt_tokens": len(call.ids), "completion_tokens": len(gen.token_ids),
                        "finish_reason": gen.finish_reason, "latency_s": latency_s, "at": time.time(),
                        "weight_version": gen.weight_version})
        b.busy = False
        return reply

    def abandon(self, call: Call) -> None:
        """The call was refused or failed before a generation: nothing of it is recorded, its branch is free."""
        call.branch.busy = False

    # --- matching a call to a branch ----------------------------------------------------------------------------
    def _continues(self, b: Branch, messages: list[dict], tools) -> list[dict] | None:
        """The new messages if `messages` continue `b` (idle, same tools, our last reply echoed as given, at least
        one new message, none of them an assistant turn); else None."""
        n = len(b.messages)
        if b.busy or b.tools != tools or len(messages) <= n or not b.calls:
            return None
        if not all(_same(a, m) for a, m in zip(b.messages, messages)):
            return None
        new = messages[n:]
        if any(m["role"] == "assistant" for m in new):
            return None
        return new

    def _closest(self, messages: list[dict], tools) -> tuple[int | None, int, str]:
        """(the branch sharing the longest message prefix with `messages`, that length, why it is a new branch)."""
        best, shared = None, 0
        for b in self.branches:
            k = 0
            while k < min(len(b.messages), len(messages)) and _same(b.messages[k], messages[k]):
                k += 1
            if k > shared:
                best, shared = b, k
        if best is None:
            return None, 0, "first call" if not self.branches else "no earlier call shares its first message"
        if best.tools != tools:
            return best.index, shared, "tools changed"
        if shared < len(best.messages):
            ours, theirs = best.messages[shared]["role"], messages[shared]["role"] if shared < len(messages) else None
            if ours == theirs == "assistant":
                return best.index, shared, f"the agent edited the reply at message {shared}"
            if shared > 0 and best.messages[shared - 1]["role"] == "assistant":
                return best.index, shared, f"forked after the reply at message {shared - 1}"
            return best.index, shared, f"history rewritten from message {shared}"
        if best.busy:
            return best.index, shared, f"forked: branch {best.index} was answering another call"
        if any(m["role"] == "assistant" for m in messages[shared:]):
            return best.index, shared, "the agent added an assistant message of its own"
        return best.index, shared, "forked"

    def _history_message(self, m: Mapping[str, Any]) -> Message:
        # A new branch's earlier turns are prompt (mask 0), rendered from what the agent sent, tool calls included
        # (a `Message` has no field for them: `_WithToolCalls` carries them to the template).
        if m.get("tool_calls"):
            return _WithToolCalls(m["role"], m["content"], name=m.get("name"), tool_call_id=m.get("tool_call_id"),
                                  template=template_dict(m))
        return Message(m["role"], m["content"], name=m.get("name"), tool_call_id=m.get("tool_call_id"))


class _WithToolCalls(Message):
    """A history message whose template form carries structured tool calls (an assistant turn the agent sent)."""

    def __init__(self, *args: Any, template: dict[str, Any], **kwargs: Any):
        super().__init__(*args, **kwargs)
        object.__setattr__(self, "_template", template)

    def to_dict(self) -> dict[str, Any]:
        return dict(self._template)


def _before_calls(text: str, raws: Sequence[str]) -> str:
    """The assistant text without its tool-call blocks (what an OpenAI client shows as `content`)."""
    for raw in raws:
        if raw:
            text = text.replace(raw, "")
    return text.strip()
