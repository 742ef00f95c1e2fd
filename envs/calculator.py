"""Calculator-v0: arithmetic questions answered with the help of a calculator tool.

The smallest complete tool-use env: the model may call `calculator` (hermes tool calls,
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

from slime_env import Action, Env, Message, Task

SYSTEM_PROMPT = (
    "You are a careful assistant with a calculator. To compute, reply with\n"
    '<tool_call>{"name": "calculator", "arguments": {"expression": "EXPRESSION"}}</tool_call>\n'
    "and wait for the result. When you know the answer, reply with <answer>NUMBER</answer>.")

TOOL_SCHEMA = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}

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


class CalculatorEnv(Env):
    """Arithmetic with a calculator tool (hermes tool calls), reward 1/0 on the <answer>.

    `max_steps` bounds the env's own turns (then `truncated`); see the module docstring.
    """

    parser = "hermes"
    tools = (TOOL_SCHEMA,)

    def __init__(self, *, max_steps: int = 6, format_penalty: float = 0.0, system_prompt: str = SYSTEM_PROMPT):
        self.max_steps = max_steps
        self.format_penalty = format_penalty
        self.system_prompt = system_prompt
        self._task: Task | None = None
        self._steps = 0

    def sample_task(self, rng: random.Random) -> Task:
        return random_task(rng)

    async def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None):
        self._task = self.task_from(options, seed)
        self._steps = 0
        return self._task.messages(system=self.system_prompt), {"label": self._task.label}

    async def step(self, action: Action):
        if self._task is None:
            raise RuntimeError("CalculatorEnv.step called before reset")
        self._steps += 1
        penalty = self.format_penalty if action.parse_errors else 0.0
        answer = _ANSWER.search(action.text)
        if answer is not None and not action.tool_calls:
            got, want = _number(answer.group(1)), float(self._task.label)
            correct = got is not None and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9)
            return [], (1.0 if correct else 0.0) - penalty, True, False, {"correct": correct, "answer": answer.group(1)}
        obs = [Message("tool", self._run_tool(call.name, call.arguments)) for call in action.tool_calls]
        obs += [Message("tool", f"error: {e.message}") for e in action.parse_errors]
        if not obs:
            obs = [Message("user", "Call the calculator or reply with <answer>NUMBER</answer>.")]
        truncated = self._steps >= self.max_steps
        return obs, -penalty, False, truncated, {"tool_calls": len(action.tool_calls)}

    @staticmethod
    def _run_tool(name: str, arguments: dict[str, Any]) -> str:
        if name != "calculator":
            return f"error: unknown tool {name!r}; the only tool is 'calculator'"
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            return "error: 'expression' must be a string"
        try:
            return str(evaluate(expression))
        except CalculatorError as e:
            return f"error: {e}"
