"""Assert statements the grader checks itself, with no test code run anywhere.

Most HumanEval and MBPP tests are `assert candidate(<literals>) == <literal>` or a close relative. Such a
statement splits into calls of the solution (made in its sandbox, which sees only the arguments) and a
check evaluated here on the plain values they returned. The checks this module accepts are built from:
literals and arithmetic on literals (`3 * 19`), calls of the solution with such arguments, `==` `!=` `<` `<=` `>`
`>=` `in` `not in`, `is` / `is not` against None / True / False, `not`, `and`, `+` `-`, unary `-`, the
pure built-ins in `BUILTINS` and `math.isclose` / `math.fabs` / `math.sqrt` / `math.floor` /
`math.ceil` / `math.isnan` / `math.isinf`. Nothing there can run long or allocate much on values the
solution chose (no `*`, no `**`, no ranges), and none of those names may be rebound by the test code.
Setup statements may only import (or be a bare constant or built-in name). A suite with any other statement goes to
`slime_env.envs.code.replay`.
"""

from __future__ import annotations

import ast
import builtins
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from slime_env.envs.code.tests_format import TestSuite, bound_names

BUILTINS = {f.__name__: f for f in (abs, all, any, bool, float, frozenset, int, len, list, max, min, round, set,
                                    sorted, str, sum, tuple)}
MATH = {f.__name__: f for f in (math.isclose, math.fabs, math.sqrt, math.floor, math.ceil, math.isnan, math.isinf)}
_COMPARE = {ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b, ast.Lt: lambda a, b: a < b,
            ast.LtE: lambda a, b: a <= b, ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b,
            ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
            ast.Is: lambda a, b: a is b, ast.IsNot: lambda a, b: a is not b}
_SINGLETONS = (None, True, False)


@dataclass(frozen=True)
class Check:
    """One case: the calls of the solution it makes (`fn`, `args`, `kwargs`) in evaluation order, their
    nodes in `test` (the assert's expression), and the statement's index in the suite."""

    statement: int
    calls: list[tuple[str, list[Any], dict[str, Any]]]
    call_nodes: list[ast.Call]
    test: ast.expr


class _Unsupported(Exception):
    pass


class Failed(Exception):
    """A call of the solution raised: the case fails with this text."""


class Lost(Exception):
    """A call of the solution never finished: the case gets `status`."""

    def __init__(self, status: str, error: str):
        super().__init__(error)
        self.status, self.error = status, error


def split(suite: TestSuite) -> list[Check] | None:
    """The suite's cases as checks, or None when any statement needs the replay."""
    trees = [ast.parse(suite.support), ast.parse(suite.prelude)]
    statements = [ast.parse(code).body for code, _ in suite.statements]
    rebound = bound_names(trees + [n for body in statements for n in body])
    imported: set[str] = set()
    checks = []
    try:
        for i, ((_, is_case), body) in enumerate(zip(suite.statements, statements)):
            if not is_case:
                for node in body:
                    if not isinstance(node, (ast.Import, ast.Pass)) and not _is_no_op(node, rebound):
                        raise _Unsupported()
                    if isinstance(node, ast.Import):
                        imported.update(a.asname or a.name for a in node.names)
                continue
            if len(body) != 1 or not isinstance(body[0], ast.Assert):
                raise _Unsupported()
            calls: list[tuple[str, list[Any], dict[str, Any]]] = []
            nodes: list[ast.Call] = []
            _scan(body[0].test, suite, rebound, imported, calls, nodes)
            checks.append(Check(i, calls, nodes, body[0].test))
    except _Unsupported:
        return None
    return checks


def _is_no_op(node: ast.stmt, rebound: set[str]) -> bool:
    """A constant or a built-in's name as a statement (HumanEval/129's stray `print`)."""
    value = node.value if isinstance(node, ast.Expr) else None
    return isinstance(value, ast.Constant) or (isinstance(value, ast.Name) and hasattr(builtins, value.id)
                                               and value.id not in rebound)


_FOLD = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
         ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_MAX_ITEMS = 1 << 20


def _literal(node: ast.expr) -> Any:
    """A constant the test wrote: a literal, or arithmetic on literals (`3 * 19`, `2.0 / 3.0`, `'ab' + 'c'`),
    folded here within size limits (a hostile dataset must not make the grader compute 10 ** 10 ** 10)."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        items = [_literal(e) for e in node.elts]
        try:
            return {ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)](items)
        except TypeError:  # an unhashable set member
            raise _Unsupported() from None
    if isinstance(node, ast.Dict) and None not in node.keys:
        try:
            return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
        except TypeError:
            raise _Unsupported() from None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if type(value) not in (int, float, complex):
            raise _Unsupported()
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _FOLD:
        left, right = _literal(node.left), _literal(node.right)
        if isinstance(node.op, ast.Pow) and not (type(right) is int and 0 <= right <= 256 and type(left) in (int, float)
                                                and abs(left) <= 1 << 64):
            raise _Unsupported()
        if isinstance(node.op, ast.Mult) and any(isinstance(v, (str, bytes, list, tuple)) for v in (left, right)):
            size = [len(v) if isinstance(v, (str, bytes, list, tuple)) else v for v in (left, right)]
            if not all(type(v) is int for v in size) or size[0] * size[1] > _MAX_ITEMS:
                raise _Unsupported()
        try:
            return _FOLD[type(node.op)](left, right)
        except (ArithmeticError, TypeError, ValueError):
            raise _Unsupported() from None
    raise _Unsupported()


def _scan(node: ast.expr, suite: TestSuite, rebound: set[str], imported: set[str],
          calls: list[tuple[str, list[Any], dict[str, Any]]], nodes: list[ast.Call]) -> None:
    """Accept `node` or raise _Unsupported; collect the solution calls in evaluation order."""
    def scan(n: ast.expr) -> None:
        _scan(n, suite, rebound, imported, calls, nodes)

    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Name) and func.id in suite.stubs and func.id not in suite.modules:
            if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
                raise _Unsupported()
            calls.append((suite.stubs[func.id], [_literal(a) for a in node.args],
                          {k.arg: _literal(k.value) for k in node.keywords}))
            nodes.append(node)
            return
        builtin = isinstance(func, ast.Name) and func.id in BUILTINS and func.id not in rebound
        from_math = (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "math"
                     and func.attr in MATH and "math" not in rebound - imported
                     and ("math" in imported or "math" in suite.modules))
        if not (builtin or from_math):
            raise _Unsupported()
        for a in [*node.args, *(k.value for k in node.keywords)]:
            if isinstance(a, ast.Starred):
                raise _Unsupported()
            scan(a)
        if any(k.arg is None for k in node.keywords):
            raise _Unsupported()
        return
    if isinstance(node, ast.Compare):
        for op, right in zip(node.ops, node.comparators):
            if isinstance(op, (ast.Is, ast.IsNot)):
                sides = (node.left, right)
                if not any(isinstance(s, ast.Constant) and any(s.value is v for v in _SINGLETONS) for s in sides):
                    raise _Unsupported()
            elif type(op) not in _COMPARE:
                raise _Unsupported()
        for n in (node.left, *node.comparators):
            scan(n)
        return
    if isinstance(node, ast.BoolOp):
        if not isinstance(node.op, ast.And):  # `or` would skip calls the sandbox has made anyway
            raise _Unsupported()
        for n in node.values:
            scan(n)
        return
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
        scan(node.operand)
        return
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
        scan(node.left)
        scan(node.right)
        return
    _literal(node)


def evaluate(check: Check, returned: Sequence[Any]) -> bool:
    """The check's truth, given what each of its calls produced: a value, or Failed / Lost to raise.
    Raises Failed (with the Python error) when evaluating it raises, as the assert would."""
    by_node = {id(node): value for node, value in zip(check.call_nodes, returned)}  # each node runs once at most

    def ev(node: ast.expr) -> Any:
        if isinstance(node, ast.Call):
            if id(node) in by_node:
                outcome = by_node[id(node)]
                if isinstance(outcome, BaseException):
                    raise outcome
                return outcome
            func = node.func
            fn = BUILTINS[func.id] if isinstance(func, ast.Name) else MATH[func.attr]
            return fn(*[ev(a) for a in node.args], **{k.arg: ev(k.value) for k in node.keywords})
        if isinstance(node, ast.Compare):
            left = ev(node.left)
            for op, right_node in zip(node.ops, node.comparators):
                right = ev(right_node)
                if not _COMPARE[type(op)](left, right):
                    return False
                left = right
            return True
        if isinstance(node, ast.BoolOp):
            value = True
            for n in node.values:
                value = ev(n)
                if not value:
                    return value
            return value
        if isinstance(node, ast.UnaryOp):
            return (not ev(node.operand)) if isinstance(node.op, ast.Not) else -ev(node.operand)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
            left, right = ev(node.left), ev(node.right)
            return left + right if isinstance(node.op, ast.Add) else left - right
        return _literal(node)

    try:
        return bool(ev(check.test))
    except (Failed, Lost):
        raise
    except Exception as e:  # noqa: BLE001 - e.g. abs(None - 1): the assert raises, the case fails
        raise Failed(f"{type(e).__name__}: {str(e)[:300]}") from None
