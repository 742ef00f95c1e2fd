"""JSON forms of what crosses a process boundary: actions, observations, tasks (env servers, Ray)."""

from __future__ import annotations

from typing import Any

from slime_env.errors import InvalidInput
from slime_env.types import Action, Message, ParseError, ToolCall, coerce_messages


def action_to_dict(action: Action) -> dict[str, Any]:
    return {"text": action.text, "token_ids": list(action.token_ids),
            "tool_calls": [c.to_dict() for c in action.tool_calls],
            "parse_errors": [e.to_dict() for e in action.parse_errors],
            "finish_reason": action.finish_reason, "agent_id": action.agent_id, "turn": action.turn}


def action_from_dict(d: Any) -> Action:
    if not isinstance(d, dict) or not isinstance(d.get("text"), str):
        raise InvalidInput("action must be an object with a 'text' string")
    try:
        return Action(text=d["text"], token_ids=tuple(int(t) for t in d.get("token_ids", ())),
                      tool_calls=tuple(ToolCall(c["name"], dict(c.get("arguments") or {}), c.get("raw", ""), c.get("id"))
                                       for c in d.get("tool_calls", ())),
                      parse_errors=tuple(ParseError(e["message"], e.get("raw", "")) for e in d.get("parse_errors", ())),
                      finish_reason=d.get("finish_reason", "stop"), agent_id=d.get("agent_id", "agent"),
                      turn=int(d.get("turn", 0)))
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidInput(f"malformed action: {e!r}") from None


def messages_to_list(messages: Any, where: str) -> list[dict[str, Any]]:
    return [m.to_dict() for m in coerce_messages(messages, where)]


def messages_from_list(data: Any, where: str) -> list[Message]:
    return coerce_messages(data or [], where)
