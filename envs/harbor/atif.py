"""Export a `Trajectory` as Harbor's ATIF (Agent Trajectory Interchange Format, `ATIF-v1.8`, the version `harbor`
0.26 writes): `to_atif(trajectory) -> dict`, `write_atif(trajectory, path)`.

Messages become steps: system and user messages `system` / `user` steps, each assistant message an `agent` step,
and the tool messages after it that step's `observation` (one result per message, `source_call_id` the call it
answers). Tool calls come from parsing the assistant text with the episode's parser (`parser=`: a name such as
"hermes", or a callable); a call the parser gave no id takes the id of the tool message answering it, so results
and calls match. Each generated turn's tokens ride on its agent step, exactly as sampled: `metrics.prompt_token_ids`
(everything the engine was given for that turn), `completion_token_ids`, `logprobs`; `metrics.extra.loss_mask`
where a turn holds off-policy tokens. What ATIF has no field for goes to `extra`: the trajectory's status, reason,
reward, turn rewards and ledger spans (the loss-mask layout over `response_ids`).

Assistant messages that were part of the prompt (few-shot history) are marked `is_copied_context` (ATIF: "should
not be included in training data") and carry no metrics.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import Any

from slime_env.trajectory import Trajectory
from slime_env.types import Message, jsonable

SCHEMA_VERSION = "ATIF-v1.8"


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("slime_env")
    except Exception:  # noqa: BLE001 - running from a source tree
        return "0"


def _turn_tokens(traj: Trajectory) -> list[dict[str, Any]]:
    """Per generated turn, in order: its prompt ids, completion ids, log-probs and loss mask."""
    turns: dict[int, list] = {}
    for span in traj.spans:
        if span.kind in ("generated", "offpolicy"):
            turns.setdefault(span.turn, []).append(span)
    out = []
    for turn in sorted(turns):
        spans = turns[turn]
        ids = [i for s in spans for i in traj.response_ids[s.start:s.end]]
        out.append({"turn": turn,
                    "prompt": list(traj.prompt_ids) + list(traj.response_ids[:spans[0].start]),
                    "completion": ids,
                    "logprobs": [float(x) for s in spans for x in traj.rollout_logprobs[s.start:s.end]],
                    "mask": [int(x) for s in spans for x in traj.loss_mask[s.start:s.end]]})
    return out


def to_atif(traj: Trajectory, *, parser: str | Callable | None = None, agent_name: str = "slime_env",
            agent_version: str | None = None, model_name: str | None = None,
            tools: Sequence[dict[str, Any]] | None = None, session_id: str | None = None) -> dict[str, Any]:
    """The trajectory as an ATIF `Trajectory` dict (see the module); `tools`: the OpenAI-style tool schemas the
    agent had (`agent.tool_definitions`)."""
    from slime_env.parsers import get_parser

    parse = get_parser(parser) if parser is not None else None
    messages: list[Message] = list(traj.messages)
    turns = _turn_tokens(traj)
    n_assistant = sum(m.role == "assistant" for m in messages)
    first_generated = n_assistant - len(turns)  # assistant messages before it came with the prompt
    steps: list[dict[str, Any]] = []
    assistant_i = 0
    i = 0
    while i < len(messages):
        m = messages[i]
        i += 1
        if m.role in ("system", "user"):
            steps.append({"step_id": len(steps) + 1, "source": m.role, "message": m.content})
            continue
        if m.role != "assistant":  # a tool message with no agent step before it
            steps.append({"step_id": len(steps) + 1, "source": "system", "message": "",
                          "observation": {"results": [_result(m, set())]}})
            continue
        results = []
        while i < len(messages) and messages[i].role in ("tool", "ipython"):
            results.append(messages[i])
            i += 1
        step: dict[str, Any] = {"step_id": len(steps) + 1, "source": "agent", "message": m.content}
        if model_name:
            step["model_name"] = model_name
        if parse is not None:
            parsed = parse(m.content)
            if parsed.content is not None:
                step["message"] = parsed.content
            calls = []
            for k, call in enumerate(parsed.tool_calls):
                call_id = call.id or (results[k].tool_call_id if k < len(results) and results[k].tool_call_id
                                      else f"call_{assistant_i}_{k}")
                calls.append({"tool_call_id": call_id, "function_name": call.name,
                              "arguments": call.arguments if isinstance(call.arguments, dict)
                              else {"value": call.arguments}})
            if calls:
                step["tool_calls"] = calls
            if parsed.errors:
                step["extra"] = {"parse_errors": [e.to_dict() for e in parsed.errors]}
        if results:
            ids = {c["tool_call_id"] for c in step.get("tool_calls", [])}
            step["observation"] = {"results": [_result(r, ids) for r in results]}
        k = assistant_i - first_generated
        if 0 <= k < len(turns):
            t = turns[k]
            metrics: dict[str, Any] = {"prompt_tokens": len(t["prompt"]), "completion_tokens": len(t["completion"]),
                                       "prompt_token_ids": t["prompt"], "completion_token_ids": t["completion"],
                                       "logprobs": t["logprobs"], "extra": {"turn": t["turn"]}}
            if any(x != 1 for x in t["mask"]):
                metrics["extra"]["loss_mask"] = t["mask"]
            step["metrics"] = metrics
            step["llm_call_count"] = 1
        else:
            step["is_copied_context"] = True
        steps.append(step)
        assistant_i += 1
    if not steps:  # ATIF needs one step at least
        steps.append({"step_id": 1, "source": "user", "message": ""})
    agent: dict[str, Any] = {"name": agent_name, "version": agent_version or _version()}
    if model_name:
        agent["model_name"] = model_name
    if tools:
        agent["tool_definitions"] = [dict(t) for t in tools]
    total_prompt = sum(len(t["prompt"]) for t in turns)
    total_completion = sum(len(t["completion"]) for t in turns)
    out: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION, "agent": agent, "steps": steps,
        "final_metrics": {"total_prompt_tokens": total_prompt, "total_completion_tokens": total_completion,
                          "total_steps": len(steps)},
        "extra": jsonable({"status": traj.status, "reason": traj.reason, "reward": traj.reward,
                            "turn_rewards": list(traj.turn_rewards), "num_turns": traj.num_turns,
                            "agent_id": traj.agent_id, "task_id": traj.task.id,
                            "spans": [s.to_dict() for s in traj.spans],
                            "prompt_length": len(traj.prompt_ids), "response_length": len(traj.response_ids),
                            "timings": dict(traj.timings)}),
    }
    if session_id is not None:
        out["session_id"] = session_id
    return out


def _result(m: Message, ids: set[str]) -> dict[str, Any]:
    result: dict[str, Any] = {"source_call_id": m.tool_call_id if m.tool_call_id in ids else None,
                              "content": m.content}
    extra = {k: v for k, v in (("name", m.name), ("tool_call_id", m.tool_call_id)) if v is not None}
    if extra and result["source_call_id"] is None:
        result["extra"] = extra
    return result


def write_atif(traj: Trajectory, path: str | os.PathLike, **kw) -> None:
    """`to_atif` written as JSON to `path` (Harbor's agents write /logs/agent/trajectory.json)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(to_atif(traj, **kw), f, ensure_ascii=False)
