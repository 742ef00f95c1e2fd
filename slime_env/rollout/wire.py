"""JSON forms of what crosses a process boundary: actions, observations, tasks.

Both env transports (the HTTP env server and the Ray actors) run an env through `env_created`,
`run_reset` and `run_step` on the hosting side and read the answers with `reset_answer` and
`step_answer` on the calling side, so they speak the same payloads.
"""

from __future__ import annotations

from typing import Any

from slime_env.errors import InvalidInput
from slime_env.types import Action, Message, ParseError, Task, ToolCall, coerce_messages


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
                      tool_calls=tuple(ToolCall(c["name"], dict(c.get("arguments") or {}), c.get("raw", ""),
                                                c.get("id"))
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


def env_created(session_id: str, env: Any) -> dict[str, Any]:
    """What a new session reports: its id, and the env's parser, tools, stop strings and whether the runner describes
    its tools in the system message (the runner needs them all)."""
    return {"session_id": session_id, "parser": env.parser, "tools": list(env.tools) if env.tools else None,
            "stop": list(getattr(env, "stop", ()) or ()), "describe_tools": bool(getattr(env, "describe_tools", True))}


async def run_reset(env: Any, seed: int | None, task: Any) -> dict[str, Any]:
    options = {"task": Task.coerce(task, "task")} if task is not None else None
    obs, info = await env.reset(seed=seed, options=options)
    # Tools can be known only after reset (ToolEnv lists an MCP server's tools per episode).
    return {"observation": messages_to_list(obs, "reset observation"), "info": dict(info or {}),
            "tools": list(env.tools) if env.tools else None}


async def run_step(env: Any, action: Any) -> dict[str, Any]:
    obs, reward, terminated, truncated, info = await env.step(action_from_dict(action))
    return {"observation": messages_to_list(obs, "step observation"), "reward": float(reward),
            "terminated": bool(terminated), "truncated": bool(truncated), "info": dict(info or {})}


def task_payload(options: Any) -> Any:
    """The task of `reset(options=...)` as plain data for the wire."""
    task = (options or {}).get("task")
    return task.to_dict() if isinstance(task, Task) else task


def reset_answer(out: dict[str, Any], where: str) -> tuple[list[Message], dict[str, Any]]:
    return messages_from_list(out.get("observation"), f"{where} reset observation"), out.get("info") or {}


def step_answer(out: dict[str, Any], where: str) -> tuple[list[Message], Any, Any, Any, dict[str, Any]]:
    return (messages_from_list(out.get("observation"), f"{where} step observation"), out["reward"],
            out["terminated"], out["truncated"], out.get("info") or {})
