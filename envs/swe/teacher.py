"""A scripted teacher for SWE tasks (SFT warm-up data: `warmup.data.rollouts.policy:
slime_env.envs.swe.teacher:teacher_reply`). It reads the task's bug — which the student never sees — and plays the
episode an engineer who found it would: `search` for the function the report names, `view` the lines of the bug,
one `str_replace_editor` edit per hunk that reverts it (`patches.reverting_edits`), then `submit`. Replies are
hermes `<tool_call>`s.

A scripted policy sees only the conversation's text, so the teacher finds its task by the statement: the
instruction.md of a task folder under `$SLIME_ENV_SWE_TASKS` (folders separated by `:`; default: the shipped
examples/swe_tasks) that the conversation contains, and its step by the tool calls it already made.
"""

from __future__ import annotations

import json
import os
import re
from functools import lru_cache
from pathlib import Path

from slime_env.envs.swe.manifest import WORKDIR
from slime_env.envs.swe.patches import parse_patch, reverting_edits
from slime_env.envs.swe.task import SweTask, find_tasks, load_task

TASKS_ENV = "SLIME_ENV_SWE_TASKS"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "swe_tasks"


@lru_cache(maxsize=8)
def _index(folders: str) -> list[tuple[str, SweTask]]:
    """(normalised statement, task) of every task under `folders`, the longest statements first."""
    out = []
    for folder in folders.split(":"):
        for path in find_tasks(folder) if folder and Path(folder).is_dir() else []:
            task = load_task(path)
            out.append((_norm(task.instruction), task))
    return sorted(out, key=lambda x: -len(x[0]))


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def find_task(context: str) -> tuple[SweTask | None, str]:
    """The task whose statement the conversation `context` contains (None if none does), and the normalised text
    of the conversation after the statement."""
    text = _norm(context)
    for statement, task in _index(os.environ.get(TASKS_ENV) or str(EXAMPLES)):
        at = text.find(statement) if statement else -1
        if at >= 0:
            return task, text[at + len(statement):]
    return None, ""


def _call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def teacher_calls(task: SweTask) -> list[str]:
    """The teacher's whole episode on `task`: search, view, the reverting edits, submit."""
    calls = []
    function = str(task.mutation.get("function") or "").split(".")[-1]
    if function and function != "<module>":
        calls.append(_call("search", pattern=rf"def {re.escape(function)}\b", path=task.source_dir,
                           include="*.py"))
    for path, hunks in parse_patch(task.bug_patch):  # the bugged lines, as the agent's checkout has them
        for _, new_start, _, new in hunks:
            calls.append(_call("str_replace_editor", command="view", path=f"{WORKDIR}/{path}",
                               view_range=[new_start, new_start + max(len(new), 1) - 1]))
    for path, old, new in reverting_edits(task.bug_patch):
        calls.append(_call("str_replace_editor", command="str_replace", path=f"{WORKDIR}/{path}", old_str=old,
                           new_str=new))
    return calls + [_call("submit")]


def teacher_reply(context: str) -> str:
    """The teacher's next reply in a conversation (module docstring); `submit` when it knows no task."""
    task, after = find_task(context)
    if task is None:
        return _call("submit")
    calls = teacher_calls(task)
    return calls[min(after.count("</tool_call>"), len(calls) - 1)]
