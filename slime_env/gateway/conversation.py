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

from slime_env.errors import RenderMismatch
from slime_env.gateway.validation import GatewayError, check_json
from slime_env.ledger import TokenLedger
from slime_env.parsers.prompts import call_text, tool_prompt, with_system_section
from slime_env.renderers.template import VerifiedPrefix
from slime_env.types import Generation, Message


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
        calls = m.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            raise GatewayError(400, f"{where}.tool_calls: expected a list of tool calls, got {type(calls).__name__}",
                               param=f"{where}.tool_calls")
        if calls and role != "assistant":
            raise GatewayError(400, f"{where}.tool_calls: only assistant messages carry tool calls",
                               param=f"{where}.tool_calls")
        if calls:
            msg["tool_calls"] = [_tool_call(tc, f"{where}.tool_calls[{k}]") for k, tc in enumerate(calls)]
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
        except RecursionError:
            raise GatewayError(400, f"{where}.function.arguments: JSON nested too deeply", param=where) from None
        check_json(args, f"{where}.function.arguments")
    if not isinstance(args, Mapping):
        raise GatewayError(400, f"{where}.function.arguments: expected a JSON object", param=where)
    call_id = tc.get("id")
    if call_id is not None and not isinstance(call_id, str):
        raise GatewayError(400, f"{where}.id: expected a string, got {call_id!r}", param=f"{where}.id")
    return {"id": call_id, "name": fn["name"], "arguments": dict(args)}


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


def _key(m: Mapping[str, Any]) -> str:
    """What identifies an assistant reply as the agent echoes it (ids and argument order aside)."""
    calls = [(c["name"], json.dumps(c["arguments"], sort_keys=True)) for c in m.get("tool_calls", ())]
    return json.dumps([m["content"], calls])


@dataclass
class Branch:
    """One linear conversation of a session and its ledger. `index` is set when its first call is recorded (-1
    before); `origin` is the branch it was forked from (`parent`: its index), `why` the reason, naming the origin's
    index as `{origin}` (known only once that branch is recorded: concurrent calls finish in any order)."""

    index: int
    tools: list[dict[str, Any]] | None  # as the agent sent them
    messages: list[dict[str, Any]]  # canonical, as the agent sees them (our replies included)
    history: list[Message]  # as the renderer sees them (our replies as the text the model generated)
    ledger: TokenLedger
    origin: Branch | None = None
    fork_at: int = 0
    why: str = ""
    last_ids: list[int] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    busy: bool = False
    history_rewrites: list[str] = field(default_factory=list)
    verified: VerifiedPrefix = field(default_factory=VerifiedPrefix)  # strict mode's proved prefix of the ledger
    template_tools: list[dict[str, Any]] | None = None  # what the chat template gets (None: in the system message)

    @property
    def parent(self) -> int | None:
        return self.origin.index if self.origin is not None and self.origin.index >= 0 else None

    @property
    def reason(self) -> str:
        if self.origin is not None and self.origin.index < 0 and "{origin}" in self.why:
            return "forked: another call was answering the same messages (it was never recorded)"
        return self.why.format(origin=self.parent)


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
    stop_sequence: str | None = None  # set by `finish`: the agent's stop string the reply ended on


class Conversation:
    """The branches of one agent session (see the module docstring). `renderer`: the model's `TemplateRenderer`;
    `parser`: the family's tool-call parser (`slime_env.parsers`) or None, `parser_name` its name (the text form of
    tool calls the agent wrote itself); `strict` checks every bridge against a full render and raises
    `RenderMismatch` on any difference."""

    def __init__(self, renderer: Any, parser: Any = None, *, strict: bool = False, parser_name: str | None = None):
        self.renderer, self.parser, self.strict = renderer, parser, strict
        self.parser_name = parser_name
        self.branches: list[Branch] = []
        self._pending: list[Call] = []  # calls creating a branch, not yet finished or abandoned
        self._generated: dict[str, str] = {}  # our replies (`_key`) -> the text the model generated for them

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
        origin, shared, why = self._closest(messages, tools)
        r = self.renderer
        history = self._history(messages)
        template_tools = tools
        if tools and not r.renders_tools:
            # The template has no tool section: the model reads the tools in the system message, in the parser's own
            # format (what the env side does too); the agent's messages stay as it sent them.
            history = with_system_section(history, tool_prompt(self.parser_name, tools))
            template_tools = None
        text = r.render_text(history, tools=template_tools, add_generation_prompt=True)
        if self.strict:
            self._check_calls_shown(messages, history, template_tools, text)
        ids = r.render_prompt(history, tools=template_tools)  # special-token text in the agent's messages: plain
        b = Branch(-1, tools, list(messages), history, TokenLedger(ids), origin=origin, fork_at=shared, why=why,
                   busy=True, template_tools=template_tools)
        call = Call(b, list(ids), [], [], [], created=True)
        self._pending.append(call)
        return call

    def finish(self, call: Call, gen: Generation, latency_s: float, stop: Sequence[str] = ()) -> dict[str, Any]:
        """Record the call (its new messages, then the generation) on its branch; return the assistant message as
        the agent gets it (content, and `tool_calls` with parsed arguments when the parser found calls). A reply that
        ended on one of the agent's `stop` strings is shown up to it (`call.stop_sequence`); the ledger keeps what
        was generated."""
        b = call.branch
        if call.created:
            self._pending.remove(call)
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
        shown = text
        if gen.finish_reason == "stop" and stop:
            found = min(((text.find(s), s) for s in stop if s in text), default=None)
            if found is not None:
                shown, call.stop_sequence = text[:found[0]], found[1]
        content, calls = shown, []
        if self.parser is not None:
            parsed = self.parser(shown)
            if parsed.tool_calls:
                calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "name": c.name, "arguments": dict(c.arguments)}
                         for c in parsed.tool_calls]
                content = parsed.content if parsed.content is not None else \
                    _before_calls(shown, [c.raw for c in parsed.tool_calls])
        reply = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
        b.messages.append(reply)
        b.history.append(Message("assistant", text))
        self._generated[_key(reply)] = text
        b.last_ids = list(gen.token_ids)
        b.calls.append({"prompt_tokens": len(call.ids), "completion_tokens": len(gen.token_ids),
                        "finish_reason": gen.finish_reason, "latency_s": latency_s, "at": time.time(),
                        "weight_version": gen.weight_version})
        b.busy = False
        return reply

    def abandon(self, call: Call) -> None:
        """The call was refused, failed before a generation, or its client left before the reply: nothing of it is
        recorded, its branch is free."""
        call.branch.busy = False
        if call in self._pending:
            self._pending.remove(call)

    # --- new branches -----------------------------------------------------------------------------------------------
    def _history(self, messages: list[dict[str, Any]]) -> list[Message]:
        """A new branch's messages as the renderer sees them: an assistant turn as text the model could have
        generated — our own replies as generated, calls the agent wrote (or edited) in the parser's format — so no
        template that ignores structured `tool_calls` can drop them; tool results named after their calls."""
        names = {c["id"]: c["name"] for m in messages for c in m.get("tool_calls", ()) if c.get("id")}
        out = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                out.append(_as_message(m, names))
                continue
            text = self._generated.get(_key(m))
            if text is None and m.get("tool_calls"):
                text = call_text(self.parser_name, m["content"], m["tool_calls"])
                if text is None:  # no text form: the template writes the structured calls, if it can
                    if not self.renderer.renders_tool_calls:
                        raise GatewayError(400, f"messages[{i}].tool_calls: this model's chat template does not "
                                                f"render tool calls and parser {self.parser_name!r} has no text form "
                                                "for them; send the call in the message's content",
                                           param=f"messages[{i}].tool_calls")
                    out.append(_WithToolCalls("assistant", m["content"], template=template_dict(m)))
                    continue
            out.append(Message("assistant", m["content"] if text is None else text, name=m.get("name")))
        return out

    def _check_calls_shown(self, messages: list[dict[str, Any]], history: list[Message], tools: Any,
                           text: str) -> None:
        """Strict mode: every tool call of the history is in the rendered prompt `text` — each call's name appears
        more often than in a render with those assistant turns emptied (the tool section names them too) — so the
        trajectory's messages and its ids tell the same story."""
        names = [c["name"] for m in messages for c in m.get("tool_calls", ())]
        if not names:
            return
        skip = len(history) - len(messages)  # a system message the tool section added in front
        emptied = [Message("assistant", "") if k >= skip and messages[k - skip].get("tool_calls") else m
                   for k, m in enumerate(history)]
        try:
            control = self.renderer.render_text(emptied, tools=tools, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template that needs the calls there: their names must show at least
            control = ""
        for name in dict.fromkeys(names):
            if text.count(name) < control.count(name) + names.count(name):
                at = next(i for i, m in enumerate(messages) for c in m.get("tool_calls", ()) if c["name"] == name)
                raise RenderMismatch(f"strict mode: the chat template dropped tool call {name!r} of messages[{at}] "
                                     "from the prompt")

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

    def _closest(self, messages: list[dict], tools) -> tuple[Branch | None, int, str]:
        """(the branch sharing the longest message prefix with `messages` — recorded, or being created by a call in
        flight —, that length, why it is a new branch)."""
        best, shared = None, 0
        for b in self.branches + [c.branch for c in self._pending]:
            k = 0
            while k < min(len(b.messages), len(messages)) and _same(b.messages[k], messages[k]):
                k += 1
            if k > shared:
                best, shared = b, k
        if best is None:
            first = not self.branches and not self._pending
            return None, 0, "first call" if first else "no earlier call shares its first message"
        if best.tools != tools:
            return best, shared, "tools changed"
        if shared < len(best.messages):
            ours, theirs = best.messages[shared]["role"], messages[shared]["role"] if shared < len(messages) else None
            if ours == theirs == "assistant":
                return best, shared, f"the agent edited the reply at message {shared}"
            if shared > 0 and best.messages[shared - 1]["role"] == "assistant":
                return best, shared, f"forked after the reply at message {shared - 1}"
            return best, shared, f"history rewritten from message {shared}"
        if best.busy:
            return best, shared, "forked: branch {origin} was answering another call"
        if any(m["role"] == "assistant" for m in messages[shared:]):
            return best, shared, "the agent added an assistant message of its own"
        return best, shared, "forked"


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
