"""The scripted teacher of the terminal tasks (SFT warm-up data: `warmup.data.rollouts.policy:
slime_env.envs.terminal.teacher:teacher_reply`). A scripted policy sees only the conversation's text: the teacher
reads the task's kind and fields back from the instruction (each kind's templates), counts the bash calls it already
made after it, and replies with the kind's next command (reading the last tool output where the kind needs it, as
`fix_typo` reads Python's NameError) or, when the work is done, with `submit`. Replies are hermes `<tool_call>`s.
"""

from __future__ import annotations

import json
import re

from slime_env.envs.terminal.kinds import find_instruction

_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
# SmolLM2's ChatML turns: a tool result is the text of the turn after the assistant's call
_TURN = re.compile(r"<\|im_start\|>(\w+)\n(.*?)(?:<\|im_end\|>|$)", re.DOTALL)


def call(name: str, **arguments: str) -> str:
    """One hermes tool call."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def teacher_reply(context: str) -> str:
    """The teacher's next reply for the conversation `context` (module docstring); `submit` when it finds no task."""
    found = find_instruction(context)
    if found is None:
        return call("submit")
    kind, fields, start = found
    after = context[start:]
    calls = [c for c in _CALL.findall(after) if '"bash"' in c]
    outputs = [text for role, text in _TURN.findall(after) if role == "tool"]
    last_output = outputs[-1] if outputs else ""
    command = kind.solve(fields, len(calls), last_output)
    return call("bash", command=command) if command is not None else call("submit")
