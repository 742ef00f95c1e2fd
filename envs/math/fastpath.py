"""Exact verdicts without sympy for the answer shapes math RL sees most: numbers, fractions, polynomial and
rational expressions, radicals and pi, and finite sets of numbers.

A small parser reads a restricted LaTeX grammar — integers, `\\frac`/`\\dfrac`/`\\tfrac`, `+ - * / ^`,
`\\cdot`, `\\times`, implicit multiplication, parentheses and braces, `\\sqrt{}`, `\\sqrt[n]{}`, `\\pi`, and
single-letter variables (not `e` or `i`, which math-verify reads as constants). Then:
- without radicals or pi, both sides are evaluated with exact `Fraction`s at a few random rational
  points: equal polynomials / rational functions agree everywhere, unequal ones almost nowhere
  (Schwartz–Zippel) — the verdict math-verify's symbolic comparison reaches;
- with radicals or pi, only constant expressions are decided, by evaluating both at 60 significant
  digits (math-verify itself compares such expressions numerically, at 15 digits).
Anything outside the grammar, any decimal (math-verify rounds those), different variables on the two
sides, and radicals of variables are left to math-verify (None).
"""

from __future__ import annotations

import random
import re
from fractions import Fraction
from typing import Any

_TOKEN = re.compile(r"\s*(\d+\.\d*|\d*\.\d+|\d+|\\[dt]?frac|\\sqrt|\\pi|\\cdot|\\times|\\left|\\right|[a-zA-Z]|"
                    r"[-+*/^(){}\[\]])")
_VARIABLES = set("abcdfghjklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_MAX_POWER = 64
Node = tuple


class _Unsupported(Exception):
    pass


class _Parser:
    def __init__(self, text: str):
        self.toks: list[str] = []
        pos, text = 0, text.strip()
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if m is None:
                raise _Unsupported(text[pos:pos + 10])
            if m.group(1) not in ("\\left", "\\right"):
                self.toks.append(m.group(1))
            pos = m.end()
        self.i = 0
        self.variables: set[str] = set()
        self.real = False  # uses \sqrt or \pi

    def peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, expected: str | None = None) -> str:
        tok = self.peek()
        if tok is None or (expected is not None and tok != expected):
            raise _Unsupported(f"expected {expected!r}, got {tok!r}")
        self.i += 1
        return tok

    def parse(self) -> Node:
        node = self.expr()
        if self.peek() is not None:
            raise _Unsupported(f"trailing {self.peek()!r}")
        return node

    def expr(self) -> Node:
        terms = [self.term()]
        while self.peek() in ("+", "-"):
            sign = self.take()
            term = self.term()
            terms.append(term if sign == "+" else ("neg", term))
        return terms[0] if len(terms) == 1 else ("add", terms)

    def term(self) -> Node:
        node = self.unary()
        while True:
            tok = self.peek()
            if tok in ("*", "\\cdot", "\\times", "/"):
                self.take()
                node = ("div" if tok == "/" else "mul", node, self.unary())
            elif tok is not None and (tok[0].isdigit() or tok in _VARIABLES or tok in ("(", "{", "\\sqrt", "\\pi")
                                      or tok.endswith("frac")):
                node = ("mul", node, self.power())  # implicit multiplication: 2x, x(x+1), 2\sqrt{2}
            else:
                return node

    def unary(self) -> Node:
        if self.peek() in ("-", "+"):
            sign = self.take()
            inner = self.unary()
            return inner if sign == "+" else ("neg", inner)
        return self.power()

    def power(self) -> Node:
        base = self.atom()
        if self.peek() != "^":
            return base
        self.take()
        exponent = self.atom()
        try:
            n = _exact(exponent, {})
        except (KeyError, _NeedsReal, ZeroDivisionError):
            raise _Unsupported("exponent") from None
        if n.denominator != 1 or not 0 <= n <= _MAX_POWER:
            raise _Unsupported("exponent")
        return ("pow", base, int(n))

    def atom(self) -> Node:
        tok = self.take()
        if tok[0].isdigit() or tok[0] == ".":
            if "." in tok:
                raise _Unsupported("decimal")
            return ("num", int(tok))
        if tok in _VARIABLES:
            self.variables.add(tok)
            return ("var", tok)
        if tok in ("(", "{"):
            inner = self.expr()
            self.take(")" if tok == "(" else "}")
            return inner
        if tok.endswith("frac"):
            return ("div", self.group(), self.group())
        if tok == "\\sqrt":
            self.real = True
            root = 2
            if self.peek() == "[":
                self.take()
                root = int(self.take()) if (self.peek() or "").isdigit() else 0
                self.take("]")
                if not 2 <= root <= 10:
                    raise _Unsupported("root")
            return ("root", self.group(), root)
        if tok == "\\pi":
            self.real = True
            return ("pi",)
        raise _Unsupported(tok)

    def group(self) -> Node:
        self.take("{")
        inner = self.expr()
        self.take("}")
        return inner


class _NeedsReal(Exception):
    pass


def _exact(node: Node, env: dict[str, Fraction]) -> Fraction:
    kind = node[0]
    if kind == "num":
        return Fraction(node[1])
    if kind == "var":
        return env[node[1]]
    if kind == "add":
        return sum((_exact(n, env) for n in node[1]), Fraction(0))
    if kind == "neg":
        return -_exact(node[1], env)
    if kind == "mul":
        return _exact(node[1], env) * _exact(node[2], env)
    if kind == "div":
        return _exact(node[1], env) / _exact(node[2], env)
    if kind == "pow":
        return _exact(node[1], env) ** node[2]
    raise _NeedsReal(kind)


def _real(node: Node, mp: Any) -> Any:
    kind = node[0]
    if kind == "num":
        return mp.mpf(node[1])
    if kind == "add":
        return mp.fsum(_real(n, mp) for n in node[1])
    if kind == "neg":
        return -_real(node[1], mp)
    if kind == "mul":
        return _real(node[1], mp) * _real(node[2], mp)
    if kind == "div":
        den = _real(node[2], mp)
        if den == 0:
            raise ZeroDivisionError
        return _real(node[1], mp) / den
    if kind == "pow":
        return _real(node[1], mp) ** node[2]
    if kind == "root":
        value = _real(node[1], mp)
        if value < 0:
            raise _Unsupported("root of a negative number")
        return mp.root(value, node[2])
    if kind == "pi":
        return +mp.pi
    raise _Unsupported(kind)


def _parse(text: str) -> _Parser | None:
    try:
        parser = _Parser(text)
        parser.node = parser.parse()
        return parser
    except (_Unsupported, RecursionError, ValueError):
        return None


def expressions_equal(gold: str, answer: str, *, points: int = 6, seed: int = 0) -> bool | None:
    """The verdict for two expressions in the grammar (see the module docstring); None when undecided."""
    g, a = _parse(gold), _parse(answer)
    if g is None or a is None or g.variables != a.variables:
        return None  # outside the grammar, or math-verify's strict variable matching decides
    if g.real or a.real:
        if g.variables:
            return None
        return _constants_equal(g.node, a.node)
    rng = random.Random(seed)
    tried = agreed = 0
    while agreed < points and tried < points * 3:
        tried += 1
        env = {v: Fraction(rng.randint(-10**6, 10**6), rng.randint(1, 997)) for v in g.variables}
        try:
            left, right = _exact(g.node, env), _exact(a.node, env)
        except ZeroDivisionError:
            continue
        if left != right:
            return False
        agreed += 1
        if not g.variables:
            return True  # constants: one exact evaluation decides
    return True if agreed == points else None


def _constants_equal(left: Node, right: Node) -> bool | None:
    import mpmath

    with mpmath.workdps(60):
        try:
            lv, rv = _real(left, mpmath.mp), _real(right, mpmath.mp)
        except (ZeroDivisionError, _Unsupported, OverflowError):
            return None
        scale = max(mpmath.mpf(1), abs(lv), abs(rv))
        return bool(abs(lv - rv) <= scale * mpmath.mpf(10) ** -45)


_SET = re.compile(r"^\\\{(.*)\\\}$")


def sets_equal(gold: str, answer: str) -> bool | None:
    """The verdict for two finite sets of rational numbers written `\\{a, b, ...\\}`; None otherwise."""
    mg, ma = _SET.match(gold.strip()), _SET.match(answer.strip())
    if not (mg and ma):
        return None
    values = []
    for inner in (mg.group(1), ma.group(1)):
        elements = set()
        for part in inner.split(","):
            parsed = _parse(part)
            if parsed is None or parsed.variables or parsed.real:
                return None
            try:
                elements.add(_exact(parsed.node, {}))
            except ZeroDivisionError:
                return None
        values.append(elements)
    return values[0] == values[1]
