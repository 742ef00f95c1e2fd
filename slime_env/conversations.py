"""Chat conversations as token trajectories: the data of supervised fine-tuning (SFT).

`load_conversations(path)` reads the standard SFT shape — one `{"messages": [...], "tools": [...]}` per JSONL line
or Parquet row; assistant messages may carry OpenAI `tool_calls` — and `conversation_trajectory(conv, renderer)`
turns one into a `Trajectory` laid out exactly as a rollout of the same conversation would be: the first prompt
rendered by the model's chat template, each assistant turn as the ids the model would generate (its text, then the
end-of-turn token; loss mask 1), and between turns the renderer's bridge (the turn's close, the tool / user
messages, the next generation prompt; loss mask 0). So SFT teaches precisely the tokens RL later samples and
scores, and nothing the template or the environment writes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slime_env.errors import InvalidInput, RenderError
from slime_env.ledger import TokenLedger
from slime_env.task_files import read_rows
from slime_env.trajectory import Trajectory
from slime_env.types import ROLES, Message, Task


@dataclass(frozen=True)
class Conversation:
    """One SFT example: template-ready `messages` (tool-call arguments as objects), optional `tools` (JSON schemas),
    and `where` it came from (file:line) for error messages."""

    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] | None = None
    where: str = "conversation"

    @classmethod
    def coerce(cls, value: Conversation | Mapping[str, Any], where: str = "conversation") -> Conversation:
        """A `Conversation` from `{"messages": [...], "tools": [...]}`; InvalidInput naming `where` and the message."""
        if isinstance(value, Conversation):
            return value
        if not isinstance(value, Mapping) or not isinstance(value.get("messages"), (list, tuple)):
            raise InvalidInput(f"{where}: expected an object with a 'messages' list")
        messages = tuple(_message(m, f"{where}: messages[{i}]") for i, m in enumerate(value["messages"]))
        if not any(m["role"] == "assistant" for m in messages):
            raise InvalidInput(f"{where}: no assistant message (nothing to learn)")
        if messages[0]["role"] == "assistant":
            raise InvalidInput(f"{where}: messages[0] is an assistant turn; a conversation starts with a prompt")
        tools = value.get("tools")
        if tools is not None and (not isinstance(tools, (list, tuple))
                                  or not all(isinstance(t, Mapping) for t in tools)):
            raise InvalidInput(f"{where}: 'tools' must be a list of JSON schemas")
        return cls(messages, tuple(dict(t) for t in tools) if tools else None, where)


def load_conversations(path: str | Path) -> list[Conversation]:
    """Every row of a `.jsonl` or `.parquet` file as a `Conversation` (errors name the file and line)."""
    convs = [Conversation.coerce(row, where) for where, _, row in read_rows(path)]
    if not convs:
        raise InvalidInput(f"{path}: no conversations")
    return convs


def conversation_trajectory(conv: Conversation | Mapping[str, Any], renderer: Any) -> Trajectory:
    """The token trajectory of `conv` under `renderer` (a `TemplateRenderer`; see the module docstring). Messages
    after the last assistant turn are dropped (no loss on them). RenderError-free templates only: InvalidInput when
    the template renders an assistant turn so that it is not the continuation of its prompt (the message index
    is named).

    Tool-call arguments given as a JSON string stay that string wherever the template prints a string as given
    (Qwen3's, DeepSeek's, Kimi-K2's): the bytes trained are the data's. Templates that need an object (they iterate
    its items, or would quote the string again) get the decoded object. A template that moves system messages to the
    front (DeepSeek's) gets a later system message moved there too, recorded in `metadata["history_rewrites"]`; one
    whose template would drop it (gpt-oss's) refuses it. Reasoning given as `thinking` or `reasoning_content` reaches
    the template under the key it reads (`renderer.reasoning_key`)."""
    conv = Conversation.coerce(conv)
    try:
        return _trajectory(conv, renderer)
    except RenderError as e:  # the template's own refusal ("System message must be at the beginning"): name the data
        raise RenderError(f"{conv.where}: {e}") from e


def _trajectory(conv: Conversation, renderer: Any) -> Trajectory:
    eot = renderer.end_of_turn_id
    next_header = getattr(renderer, "stop_closes_turn", False) and eot is None
    if eot is None and not next_header:
        raise InvalidInput("the chat template has no end-of-turn token after an assistant turn: a conversation "
                           "cannot be cut into generated turns")
    msgs = _reasoning_for_template(list(conv.messages), renderer, conv.where)
    tools = list(conv.tools) if conv.tools else None
    notes: list[str] = []
    dropped = next((i for i, m in enumerate(msgs) if i and m["role"] == "system"), None)
    if dropped is not None and getattr(renderer, "drops_late_system", False):
        raise InvalidInput(f"{conv.where}: messages[{dropped}] is a system message after the first message: the "
                           f"{renderer.family} chat template renders only messages[0] as the system (developer) "
                           "message and drops any later one, so the model would never see it (merge it into "
                           "messages[0], or send it as a user message)")
    if getattr(renderer, "hoists_system", False):
        late = [i for i, m in enumerate(msgs) if m["role"] == "system" and any(x["role"] != "system" for x in msgs[:i])]
        if late:
            msgs = [m for m in msgs if m["role"] == "system"] + [m for m in msgs if m["role"] != "system"]
            notes.append(f"{renderer.family} template moves system messages to the start: messages{late} moved "
                         "to the front, as the template renders them")
    msgs = _arguments_for_template(msgs, tools, renderer, conv.where)
    stops = [eot] if eot is not None else []
    stops += [i for i in renderer.stop_token_ids if i not in stops]
    stop_texts = [(i, renderer.tokenizer.convert_ids_to_tokens(i)) for i in stops]
    turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    first = turns[0]
    prompt = renderer.encode(renderer.render_text(msgs[:first], tools=tools, add_generation_prompt=True))
    ledger = TokenLedger(prompt)
    history = [_history(m, msgs) for m in msgs[:first]]
    last_ids: list[int] = []
    for k, i in enumerate(turns):
        if k:  # the messages since the previous assistant turn, as the renderer bridges them in a rollout
            obs = [_history(m, msgs) for m in msgs[turns[k - 1] + 1:i]]
            ledger.add_inserted(renderer.bridge(last_ids, obs, history), k - 1)
            history.extend(obs)
        before = renderer.render_text(msgs[:i], tools=tools, add_generation_prompt=True)
        full = renderer.render_text(msgs[:i + 1], tools=tools, add_generation_prompt=False)
        start = len(before) if full.startswith(before) else _after_deleted_history(renderer, msgs, i, before, full,
                                                                                  tools)
        if start is None:
            raise InvalidInput(f"{conv.where}: messages[{i}]: the template renders this assistant turn so that it "
                               "does not continue its own prompt; it cannot be cut into a generated turn")
        if start != len(before):
            notes.append(f"{renderer.family} template re-renders earlier turns once messages[{i}] follows them "
                         f"({'; '.join(renderer.rewrites_history)}); the ledger keeps them as the model saw them")
        span = full[start:]
        _check_calls_rendered(renderer, msgs, i, span, tools, conv.where)
        if next_header:  # GLM: the turn ends on the header that follows it (<|observation|> / <|user|>)
            text, stop = span, _next_header(renderer, msgs, i, conv.where)
        else:
            cut, stop = max(((span.rfind(t), j) for j, t in stop_texts), default=(-1, None))
            if cut < 0:
                raise InvalidInput(f"{conv.where}: messages[{i}]: the rendered turn has no end-of-turn token "
                                   f"{renderer.tokenizer.convert_ids_to_tokens(eot)!r}")
            text = span[:cut]
        last_ids = renderer.encode(text) + [stop]
        ledger.add_generated(last_ids, [0.0] * len(last_ids), k)
        history.append(Message("assistant", text))
    first_messages = tuple(Message.coerce({k: v for k, v in m.items() if k != "tool_calls"}) for m in msgs[:first])
    metadata = {"source": "conversation", "where": conv.where}
    if notes:
        metadata["history_rewrites"] = notes
    return Trajectory(task=Task(prompt=first_messages), prompt_ids=ledger.prompt_ids,
                      response_ids=ledger.response_ids, loss_mask=ledger.loss_mask,
                      rollout_logprobs=ledger.rollout_logprobs, spans=ledger.spans, turn_rewards=[0.0] * len(turns),
                      reward=0.0, status="completed", num_turns=len(turns), messages=history,
                      metadata=metadata)


def _after_deleted_history(renderer: Any, msgs: list[dict], i: int, before: str, full: str, tools) -> int | None:
    """Where turn `i` starts in `full` when the template, once turn `i` follows, deletes a piece of the earlier
    history that its prompt `before` shows (gpt-oss drops a call turn's analysis once a final answer follows: a
    declared rewrite): the smallest deletion after which `full` continues as `before` does. None for any other
    difference, or for a template that declares no history rewrites."""
    if not renderer.rewrites_history:
        return None
    bare = renderer.render_text(msgs[:i], tools=tools, add_generation_prompt=False)
    prompt = len(before) - len(bare) if before.startswith(bare) else 1  # the generation prompt must survive whole
    common = next((k for k, (a, b) in enumerate(zip(before, full)) if a != b), min(len(before), len(full)))
    for deleted in range(1, len(before) - common - prompt + 1):
        if full.startswith(before[common + deleted:], common):
            return len(before) - deleted
    return None


def _check_calls_rendered(renderer: Any, msgs: list[dict], i: int, span: str, tools, where: str) -> None:
    """Refuse turn `i` if the template leaves out any of its calls: by name when it writes no calls at all, else the
    first call whose rendering adds nothing (gpt-oss's template writes only a message's first call, so a second call
    to the same function would vanish while its name is still in the turn)."""
    calls = msgs[i].get("tool_calls") or []
    missing = [c["function"]["name"] for c in calls if c["function"]["name"] not in span]
    if missing:
        raise InvalidInput(f"{where}: messages[{i}]: this chat template does not render tool_calls "
                           f"({missing} absent from the turn); write the call into the content, in the format "
                           "the env parses (e.g. <tool_call>{...}</tool_call>)")
    previous = None
    for k in range(1, len(calls) + 1):
        text = renderer.render_text([*msgs[:i], {**msgs[i], "tool_calls": calls[:k]}], tools=tools,
                                    add_generation_prompt=False)
        if text == previous:
            raise InvalidInput(f"{where}: messages[{i}].tool_calls[{k - 1}] ({calls[k - 1]['function']['name']!r}): "
                               f"the {renderer.family} chat template writes at most {k - 1} call(s) of a message "
                               "and drops this one; put each call in its own assistant message")
        previous = text


def _next_header(renderer: Any, msgs: list[dict], i: int, where: str) -> int:
    """The stop token a template without an end-of-turn token (GLM) closes turn `i` with: the first id the template
    writes after an assistant turn for the message that follows it (the next header; `<|user|>` after the last)."""
    after = [_history(m, msgs).to_dict() for m in msgs[i + 1:i + 2]] or [{"role": "user", "content": "U"}]
    ids = renderer.encode(renderer._after_sentinel(after, add_generation_prompt=False))
    if not ids or ids[0] not in renderer.stop_token_ids:
        role = msgs[i + 1]["role"] if i + 1 < len(msgs) else "end"
        stops = "/".join(renderer.tokenizer.convert_ids_to_tokens(list(renderer.stop_token_ids)))
        raise InvalidInput(f"{where}: messages[{i + 1}]: the {renderer.family} template writes none of its stop "
                           f"tokens ({stops}) between assistant turn messages[{i}] and this {role} message, so the "
                           "model could never end that turn there; send it as a user message")
    return ids[0]


def _reasoning_for_template(msgs: list[dict], renderer: Any, where: str) -> list[dict]:
    """Each message's reasoning under the key the template reads (`thinking` for gpt-oss, `reasoning_content` for
    the others), whichever of the two the data used: a template silently ignores the key it does not know."""
    key = getattr(renderer, "reasoning_key", "reasoning_content")
    other = "thinking" if key == "reasoning_content" else "reasoning_content"
    out = []
    for i, m in enumerate(msgs):
        if other in m:
            if key in m and m[key] != m[other]:
                raise InvalidInput(f"{where}: messages[{i}] has both 'thinking' and 'reasoning_content', and they "
                                   "differ; give the reasoning once")
            m = {**{k: v for k, v in m.items() if k != other}, key: m.get(key, m[other])}
        out.append(m)
    return out


def _arguments_for_template(msgs: list[dict], tools, renderer: Any, where: str) -> list[dict]:
    """The messages with each call's arguments in the form the template takes (see `conversation_trajectory`)."""
    if not any(m.get("tool_calls") for m in msgs):
        return msgs
    given = [_arguments(m, "given") for m in msgs]
    raw = [c["function"]["arguments"] for m in given for c in m.get("tool_calls", ())
           if isinstance(c["function"]["arguments"], str)]
    if raw:  # strings as given: kept where the template prints each verbatim
        try:
            text = renderer.render_text(given, tools=tools, add_generation_prompt=False)
            if all(a in text for a in raw):
                return given
        except Exception:  # noqa: BLE001 - the template needs objects: tried next
            pass
    objects = [_arguments(m, "object") for m in msgs]
    try:
        renderer.render_text(objects, tools=tools, add_generation_prompt=False)
        return objects
    except RenderError:  # the template refused the conversation itself (raise_exception), whatever the arguments
        raise
    except Exception:  # noqa: BLE001 - DeepSeek-R1's concatenates a JSON string: its error is shown if that fails
        return [_arguments(m, "string") for m in msgs]


def _arguments(m: dict[str, Any], form: str) -> dict[str, Any]:
    """`m` with its calls' arguments as given ("given"), decoded ("object") or JSON text ("string"; as given when
    the data gave a string)."""
    if not m.get("tool_calls"):
        return m
    calls = []
    for c in m["tool_calls"]:
        args, raw = c["function"]["arguments"], c["function"].get("raw")
        value = raw if form == "given" and raw is not None else args
        if form == "string":
            value = raw if raw is not None else json.dumps(args, ensure_ascii=False)
        calls.append({**c, "function": {"name": c["function"]["name"], "arguments": value}})
    return {**m, "tool_calls": calls}


def _message(m: Any, where: str) -> dict[str, Any]:
    if not isinstance(m, Mapping) or m.get("role") not in ROLES:
        raise InvalidInput(f"{where}: expected a message with a role in {sorted(ROLES)}")
    content = m.get("content")
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise InvalidInput(f"{where}.content: expected text, got {type(content).__name__}")
    out: dict[str, Any] = {"role": m["role"], "content": content}
    for key in ("name", "tool_call_id", "reasoning_content", "thinking"):  # templates differ on the reasoning key
        if m.get(key) is not None:
            out[key] = m[key]
    if m.get("tool_calls"):
        if m["role"] != "assistant":
            raise InvalidInput(f"{where}: only assistant messages carry tool_calls")
        out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{k}]") for k, c in enumerate(m["tool_calls"])]
    return out


def _tool_call(c: Any, where: str) -> dict[str, Any]:
    fn = c.get("function") if isinstance(c, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise InvalidInput(f"{where}: expected {{'type': 'function', 'function': {{'name': ..., 'arguments': ...}}}}")
    args = fn.get("arguments", {})
    if isinstance(args, str):  # OpenAI sends a JSON string: validated here; kept for templates that print it
        try:
            args = json.loads(args or "{}")
        except ValueError as e:
            raise InvalidInput(f"{where}.function.arguments: not valid JSON ({e})") from None
    if not isinstance(args, Mapping):
        raise InvalidInput(f"{where}.function.arguments: expected a JSON object")
    function = {"name": fn["name"], "arguments": dict(args)}
    if isinstance(fn.get("arguments"), str) and fn["arguments"]:
        function["raw"] = fn["arguments"]  # the JSON text as the data gave it (see _arguments_for_template)
    return {"id": c.get("id") or "", "type": "function", "function": function}


def _history(m: Mapping[str, Any], msgs: Sequence[Mapping[str, Any]]) -> Message:
    """A non-assistant message as the renderer's bridge takes it (a tool result gets its call's name)."""
    name = m.get("name")
    if m["role"] == "tool" and name is None and m.get("tool_call_id"):
        name = next((c["function"]["name"] for x in msgs for c in x.get("tool_calls", ())
                     if c.get("id") == m["tool_call_id"]), None)
    return Message(m["role"], m["content"], name=name, tool_call_id=m.get("tool_call_id"))
