"""Safe arithmetic: `evaluate(expression)` for + - * / // % ** and parentheses, nothing else (no names, no calls),
with bounds on exponents and sizes. Used by the calculator tool (`slime_env.envs.tools.calculator_tool`) and
Calculator-v0."""

from __future__ import annotations

import ast
import math
import operator

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
