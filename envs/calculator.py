"""Calculator-v0: arithmetic questions answered with the help of a calculator tool.

The smallest complete tool-use env (a `ToolEnv`): the model may call `calculator` (hermes tool calls,
`<tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>`), reads the
result as a tool message, and answers with `<answer>N</answer>`. Reward 1.0 for the right number,
0.0 otherwise; an optional `format_penalty` is subtracted for turns with malformed tool calls.
Tasks: `{"prompt": "What is 12 * 7 + 5?", "label": 89}`; without one, `sample_task` makes one.
"""

from __future__ import annotations

import ast
import math
import operator
import random
import re
from collections.abc import Mapping
from typing import Any

from slime_env import Action, Message, Task, ToolEnv

SYSTEM_PROMPT = (
    "You are a careful assistant with a calculator. To compute, reply with\n"
    '<tool_call>{"name": "calculator", "arguments": {"expression": "EXPRESSION"}}</tool_call>\n'
    "and wait for the result. When you know the answer, reply with <answer>NUMBER</answer>.")

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


class CalculatorError(ValueError):
    """An expression the calculator refuses (syntax, unsupported operation, too large)."""


def evaluate(expression: str) -> int | float:
    """Evaluate arithmetic safely: numbers, + - * / // % **, parentheses; no names, no calls."""
    if len(expression) > 200:
        raise CalculatorError("expression longer than 200 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"syntax error: {e.msg}") from None
    except (ValueError, RecursionError, MemoryError) as e:  # null bytes, absurd nesting
        raise CalculatorError(f"cannot parse: {type(e).__name__}") from None
    try:
        value = _eval(tree.body)
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except CalculatorError:
        raise
    except (OverflowError, RecursionError, TypeError, ValueError) as e:  # 2.0 ** 5000, complex results, ...
        raise CalculatorError(f"cannot evaluate: {type(e).__name__}") from None
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 10**6):
            raise CalculatorError("exponent too large")
        result = _OPS[type(node.op)](left, right)
        if isinstance(result, complex):
            raise CalculatorError("complex result")
        if isinstance(result, int) and abs(result) > 10**30 or isinstance(result, float) and not math.isfinite(result):
            raise CalculatorError("result too large")
        return result
    raise CalculatorError(f"unsupported element {type(node).__name__}")


def _number(text: str) -> float | None:
    try:
        return float(text.strip().replace(",", ""))
    except ValueError:
        return None


def random_task(rng: random.Random) -> Task:
    """An expression with two or three operations on small integers, and its value as the label."""
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 30)
    expr = rng.choice([f"{a} * {c} + {b}", f"({a} + {b}) * {c}", f"{a} * {b} - {c}", f"{a} + {b} * {c}"])
    return Task(prompt=f"What is {expr}?", label=evaluate(expr), metadata={"expression": expr})


class CalculatorEnv(ToolEnv):
    """Arithmetic with a calculator tool (hermes tool calls), reward 1/0 on the <answer>.

    A `ToolEnv` with one tool (`envs.tools.calculator_tool`): a turn with an <answer> and no tool call
    ends the episode; `max_steps` bounds the env's own turns (then `truncated`); see the module docstring.
    """

    def __init__(self, *, max_steps: int = 6, format_penalty: float = 0.0, system_prompt: str = SYSTEM_PROMPT):
        from envs.tools import calculator_tool

        super().__init__([calculator_tool()], system_prompt=system_prompt, max_turns=max_steps,
                         tool_timeout_s=5.0)
        self.max_steps = max_steps
        self.format_penalty = format_penalty

    def sample_task(self, rng: random.Random) -> Task:
        return random_task(rng)

    async def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None):
        messages, info = await super().reset(seed=seed, options=options)
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
