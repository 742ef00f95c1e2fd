"""Every registered env refuses, at reset, a task it cannot score (issue 58, item 19): a task without its label is an
`InvalidInput` naming the env and the field before the episode starts, never a crash (`float(None)`) or a silent 0
at the answer. Envs whose tasks carry no label, or are not prompts at all, are listed with the reason; an env added
to the registry is checked by default."""

from __future__ import annotations

import asyncio
import re
from importlib.metadata import entry_points

import pytest

from slime_env import Task, make
from slime_env.errors import InvalidInput
from slime_env.multi_agent import MultiAgentEnv
from slime_env.registry import ENTRY_POINT_GROUP

# The envs slime_env ships and plugins declare (entry points): not the test envs other test modules register
# in this process at collection (AsyncGate-v0, ...).
DECLARED = sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})

# Games score moves, not an answer: a label-less task is theirs (Taboo draws its secret word when none is given).
NO_LABEL = {"RockPaperScissors-v0", "SplitItems-v0", "Taboo-v0", "TicTacToe-v0"}
# Tasks that are not a prompt with a label: refused at reset for what they lack instead.
NOT_A_PROMPT = {"Harbor-v0": "metadata['harbor_task']", "Workspace-v0": "metadata['workspace']",
                "Terminal-v0": "metadata['harbor_task']",  # a Harbor task folder, generated
                # pictures drawn from a seed (and a kind): the answer comes from the drawing, not a label
                "VisualReasoning-v0": "needs metadata kind", "VisualSearch-v0": "needs an int metadata seed"}
NEEDS_KWARGS = {"Agent-v0"}  # built around an agent object: nothing to make from the registry alone
AGENT_PROGRAMS = {"Harness-v0"}  # a harness binary runs the episode (AgentEnv.run): there is no reset to refuse at
LABELLESS = Task(prompt="What is 2 + 3?")


async def _reset(env_id: str) -> None:
    env = make(env_id)
    try:
        await env.reset(seed=0, options={"task": LABELLESS})
    finally:
        await env.close()


@pytest.mark.parametrize("env_id", DECLARED)
def test_a_task_without_its_label_is_refused_at_reset(env_id):
    if env_id in NEEDS_KWARGS:
        pytest.skip(f"{env_id} is made with an agent")
    if env_id in AGENT_PROGRAMS:
        pytest.skip(f"{env_id} runs an agent program, not reset/step")
    if env_id in NO_LABEL:
        asyncio.run(_reset(env_id))  # accepted: nothing in these games reads a label
        assert isinstance(make(env_id), MultiAgentEnv) or env_id == "Taboo-v0"
        return
    # the message names the env and the field; the non-prompt tasks name what they need instead
    expected = re.escape(NOT_A_PROMPT[env_id]) if env_id in NOT_A_PROMPT else rf"^{re.escape(env_id)} .*'label'"
    with pytest.raises(InvalidInput, match=expected):
        asyncio.run(_reset(env_id))


def test_calculator_refuses_a_label_that_is_not_a_number():
    """Calculator-v0 compares numbers: a label it cannot read as one is refused by name at reset (before: a task
    without a label started, and the answer crashed on float(None))."""
    with pytest.raises(InvalidInput, match=r"Calculator-v0 task's 'label' must be the answer as a number, got 'five'"):
        asyncio.run(make("Calculator-v0").reset(options={"task": Task(prompt="2 + 3?", label="five")}))
