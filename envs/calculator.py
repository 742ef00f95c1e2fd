"""Calculator-v0: arithmetic questions answered with the help of a calculator tool.

The smallest complete tool-use env (a `ToolEnv`): the model may call `calculator` (hermes tool calls,
`<tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>`), reads the
result as a tool message, and answers with `<answer>N</answer>`. Reward 1.0 for the right number,
0.0 otherwise; an optional `format_penalty` is subtracted for turns with malformed tool calls.
Tasks: `{"prompt": "What is 12 * 7 + 5?", "label": 89}`; without one, `sample_task` makes one.
"""

from __future__ import annotations

import math
import random
import re
import zlib
from collections.abc import Mapping
from typing import Any

from slime_env.envs.arithmetic import CalculatorError, evaluate  # noqa: F401 - re-exported: slime_env.envs.calculator.evaluate
from slime_env.envs.tools import calculator_tool

from slime_env import Action, Message, Task, ToolEnv
from slime_env.errors import InvalidInput

SYSTEM_PROMPT = (
    "You are a careful assistant with a calculator. To compute, reply with\n"
    '<tool_call>{"name": "calculator", "arguments": {"expression": "EXPRESSION"}}</tool_call>\n'
    "and wait for the result. When you know the answer, reply with <answer>NUMBER</answer>.")

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _number(text: str) -> float | None:
    try:
        return float(text.strip().replace(",", ""))
    except ValueError:
        return None


def numeric_label(task: Task, env_id: str) -> float:
    """The task's label as a number; InvalidInput naming the env and the field when it has none (a task without its
    answer cannot be scored, so an env refuses it at reset, as Math-v0 does)."""
    label = task.label
    number = _number(str(label)) if isinstance(label, (str, int, float)) and not isinstance(label, bool) else None
    if number is None:
        raise InvalidInput(f"{env_id} task's 'label' must be the answer as a number, got {label!r}"
                           + (f" (task {task.id!r})" if task.id else ""))
    return number


def random_task(rng: random.Random) -> Task:
    """An expression with two or three operations on small integers, and its value as the label."""
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 30)
    expr = rng.choice([f"{a} * {c} + {b}", f"({a} + {b}) * {c}", f"{a} * {b} - {c}", f"{a} + {b} * {c}"])
    return Task(prompt=f"What is {expr}?", label=evaluate(expr), metadata={"expression": expr})


class CalculatorEnv(ToolEnv):
    """Arithmetic with a calculator tool (hermes tool calls), reward 1/0 on the <answer>.

    A `ToolEnv` with one tool (`slime_env.envs.tools.calculator_tool`): a turn with an <answer> and no tool call
    ends the episode; `max_steps` bounds the env's own turns (then `truncated`); see the module docstring.
    """

    describe_tools = False  # its system prompt shows the tool-call format itself

    def __init__(self, *, max_steps: int = 6, format_penalty: float = 0.0, system_prompt: str = SYSTEM_PROMPT):
        super().__init__([calculator_tool()], system_prompt=system_prompt, max_turns=max_steps,
                         tool_timeout_s=5.0)
        self.max_steps = max_steps
        self.format_penalty = format_penalty

    def sample_task(self, rng: random.Random) -> Task:
        return random_task(rng)

    async def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None):
        messages, info = await super().reset(seed=seed, options=options)
        numeric_label(self.task, "Calculator-v0")  # refused now, not by float(None) at the answer
        return messages, {**info, "label": self.task.label}

    def is_done(self, action: Action) -> bool:
        return _ANSWER.search(action.text) is not None and not action.tool_calls

    def turn_reward(self, action: Action) -> float:
        return -self.format_penalty if action.parse_errors else 0.0

    async def finish(self, action: Action):
        answer = _ANSWER.search(action.text).group(1)
        got, want = _number(answer), float(self.task.label)
        correct = got is not None and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9)
        return [], 1.0 if correct else 0.0, True, False, {**self.step_info(), "correct": correct, "answer": answer}

    def no_tool_message(self) -> Message:
        return Message("user", "Call the calculator or reply with <answer>NUMBER</answer>.")

    def unknown_tool_message(self, name: str) -> str:
        return f"error: unknown tool {name!r}; the only tool is 'calculator'"


_QUESTION = re.compile(r"What is (.+?)\?")


def teacher_reply(context: str) -> str:
    """A scripted teacher for SFT warm-up data (`warmup.data.rollouts.policy: slime_env.envs.calculator:teacher_reply`):
    it calls the calculator on the question's expression, then answers with the number the tool returned."""
    questions = _QUESTION.findall(context)
    if not questions:
        return "<answer>0</answer>"
    expr = questions[-1].strip()
    after = context[context.rfind(questions[-1]):]
    if "</tool_call>" not in after:
        return '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>' % expr
    result = re.search(r"-?\d+(?:\.\d+)?", after[after.rfind("</tool_call>") + len("</tool_call>"):])
    return f"<answer>{result.group(0) if result else evaluate(expr)}</answer>"


def calculator_tasks(n: int, seed: int = 0, split: str | None = None) -> list[Task]:
    """`n` tasks of `random_task` from `seed` (a `train_data: {generator: slime_env.envs.calculator:calculator_tasks}`
    split). `split="train"` / `"test"` keeps only problems of that side of a fixed partition (a hash of the expression:
    one in five is a test problem), so a held-out split never shares a problem with a training split or SFT data."""
    if split not in (None, "train", "test"):
        raise ValueError(f"split must be 'train', 'test' or None, got {split!r}")
    rng = random.Random(seed)
    out: list[Task] = []
    while len(out) < n:
        task = random_task(rng)
        if split is None or (zlib.crc32(task.metadata["expression"].encode()) % 5 == 0) == (split == "test"):
            out.append(task)
    return out
