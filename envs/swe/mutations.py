"""Bug injection in the manner of SWE-smith's procedural modifiers: AST-guided, each a minimal text edit of one
site in one function, so a task's diff is a line or two and the rest of the file is byte-for-byte the original.

`find_mutations(path, source)` lists every candidate site of a file, in source order, for these kinds:

- `flip_comparison`  a comparison at its boundary or negated: `<`→`<=`, `>=`→`>`, `==`→`!=`, `in`→`not in`
- `off_by_one`       an integer literal ±1, a slice bound or a `range(...)` argument ±1
- `drop_statement`   an assignment, augmented assignment or call statement deleted (the only one of a block: `pass`)
- `swap_arguments`   two adjacent positional arguments of a call swapped
- `wrong_default`    a parameter's default literal changed (an int ±1, a bool negated, a float doubled)
- `invert_if`        the bodies of an `if ...: ... else: ...` swapped (the condition kept)
- `change_operator`  a binary, boolean or augmented-assignment operator changed within its family (`+`↔`-`,
                     `and`↔`or`)

`plan(mutations, seed=)` orders candidates for validation: each kind's sites shuffled by the seed, kinds taken in
turn, at most `per_function` sites per function. The same sources and seed give the same plan (no hash
randomization is involved: `random.Random` seeded with a string is deterministic).
"""

from __future__ import annotations

import ast
import hashlib
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass

KINDS = ("flip_comparison", "off_by_one", "drop_statement", "swap_arguments", "wrong_default", "invert_if",
         "change_operator")

_FLIP = {ast.Lt: ("<", "<="), ast.LtE: ("<=", "<"), ast.Gt: (">", ">="), ast.GtE: (">=", ">"),
         ast.Eq: ("==", "!="), ast.NotEq: ("!=", "=="), ast.Is: ("is", "is not"), ast.IsNot: ("is not", "is"),
         ast.In: ("in", "not in"), ast.NotIn: ("not in", "in")}
_CMP_TOKEN = re.compile(r"not\s+in\b|is\s+not\b|<=|>=|==|!=|<|>|\bin\b|\bis\b")
_BINOP = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%",
          ast.BitAnd: "&", ast.BitOr: "|", ast.BitXor: "^", ast.LShift: "<<", ast.RShift: ">>", ast.Pow: "**"}
_FAMILY = {"+": ("-",), "-": ("+",), "*": ("//", "/"), "/": ("*", "//"), "//": ("/", "%", "*"), "%": ("//",),
           "&": ("|", "^"), "|": ("&", "^"), "^": ("&", "|"), "<<": (">>",), ">>": ("<<",), "**": ("*",)}
_BIN_TOKEN = re.compile(r"\*\*|//|<<|>>|[-+*/%&|^@]")
_AUG_TOKEN = re.compile(r"(\*\*|//|<<|>>|[-+*/%&|^@])=")
_BOOL_TOKEN = re.compile(r"\band\b|\bor\b")
# Calls whose positional arguments are symmetric, or whose swap only breaks a message or a type check loudly.
_NO_SWAP = {"max", "min", "print", "isinstance", "issubclass", "getattr", "setattr", "hasattr", "super", "warn",
            "format", "join", "zip_longest", "product", "chain", "union", "intersection", "add", "mul", "eq", "ne"}


@dataclass(frozen=True, slots=True)
class Mutation:
    """One candidate bug: `kind` at `file`:`line` (1-based) in `function` (qualified name), made by replacing the
    characters `start:end` of the file with `replacement`; `description` says what changed (teacher-only)."""

    kind: str
    file: str
    function: str
    line: int
    col: int
    start: int
    end: int
    replacement: str
    description: str

    def apply(self, source: str) -> str:
        return source[:self.start] + self.replacement + source[self.end:]

    @property
    def key(self) -> str:
        """A short stable id of this mutation (what it changes, not where the list put it)."""
        raw = f"{self.kind}|{self.file}|{self.start}|{self.end}|{self.replacement}"
        return hashlib.sha256(raw.encode()).hexdigest()[:8]


class _Text:
    """A source with conversions from ast positions (1-based lines, UTF-8 byte columns) to string offsets."""

    def __init__(self, source: str):
        self.source = source
        self.lines = source.splitlines(keepends=True)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))

    def offset(self, lineno: int, col: int) -> int:
        line = self.lines[lineno - 1]
        return self.starts[lineno - 1] + len(line.encode()[:col].decode("utf-8", "replace"))

    def start(self, node: ast.AST) -> int:
        return self.offset(node.lineno, node.col_offset)

    def end(self, node: ast.AST) -> int:
        return self.offset(node.end_lineno, node.end_col_offset)

    def segment(self, node: ast.AST) -> str:
        return self.source[self.start(node):self.end(node)]

    def line_start(self, lineno: int) -> int:
        return self.starts[min(lineno - 1, len(self.lines))]

    def indent(self, lineno: int) -> str:
        line = self.lines[lineno - 1]
        return line[:len(line) - len(line.lstrip())]

    def owns_lines(self, node: ast.stmt) -> bool:
        """Whether `node` alone occupies its lines (nothing but indentation before it, a comment at most after)."""
        before = self.lines[node.lineno - 1][:self.offset(node.lineno, node.col_offset) - self.starts[node.lineno - 1]]
        after = self.source[self.end(node):self.line_start(node.end_lineno + 1)]
        return not before.strip() and (not after.strip() or after.strip().startswith("#"))


def find_mutations(path: str, source: str) -> list[Mutation]:
    """Every candidate mutation of one file, in source order; each parses and changes the file's AST."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    text = _Text(source)
    found: list[Mutation] = []
    for qualname, func in _functions(tree):
        if _trivial(func):
            continue
        sites = [*_wrong_defaults(text, func)]
        for stmt in func.body:  # the body's own statements (nested blocks come with their compound statement)
            sites += _drop_statement(text, stmt, alone=len(func.body) == 1)
        for node in _body_nodes(func.body):
            sites += _sites(text, node)
        snippet = _Snippet(text, func)
        for kind, start, end, replacement, description, line, col in sites:
            m = Mutation(kind, path, qualname, line, col, start, end, replacement, description)
            if snippet.changes(m):
                found.append(m)
    found.sort(key=lambda m: (m.start, m.end, m.kind, m.replacement))
    unique: list[Mutation] = []
    for m in found:
        if not unique or (m.start, m.end, m.replacement) != (unique[-1].start, unique[-1].end, unique[-1].replacement):
            unique.append(m)
    return unique


def plan(mutations: list[Mutation], *, seed: int | str, per_function: int = 2) -> list[Mutation]:
    """The order to validate candidates in: kinds in turn, each kind's sites shuffled by `seed`; at most
    `per_function` per function and one per (function, kind)."""
    by_kind: dict[str, list[Mutation]] = {k: [] for k in KINDS}
    for m in mutations:
        by_kind[m.kind].append(m)
    for kind, items in by_kind.items():
        random.Random(f"{seed}:{kind}").shuffle(items)
    ordered: list[Mutation] = []
    iters = [iter(by_kind[k]) for k in KINDS]
    while iters:
        for it in list(iters):
            m = next(it, None)
            if m is None:
                iters.remove(it)
            else:
                ordered.append(m)
    per: dict[tuple[str, str], int] = {}
    seen: set[tuple[str, str, str]] = set()
    out = []
    for m in ordered:
        fn = (m.file, m.function)
        if per.get(fn, 0) >= per_function or (m.file, m.function, m.kind) in seen:
            continue
        per[fn] = per.get(fn, 0) + 1
        seen.add((m.file, m.function, m.kind))
        out.append(m)
    return out


class _Snippet:
    """One function's source on its own (dedented), to check a mutation of it parses and changes its AST without
    parsing the whole module for every candidate (a 3,000-line module has a thousand candidates)."""

    def __init__(self, text: _Text, func: ast.FunctionDef | ast.AsyncFunctionDef):
        self.text = text
        first = min([func.lineno, *(d.lineno for d in func.decorator_list)])
        self.start, self.end = text.line_start(first), text.line_start(func.end_lineno + 1)
        self.indent = text.indent(func.lineno)
        self.original = self._dump(text.source[self.start:self.end])

    def _dump(self, snippet: str) -> str | None:
        lines = snippet.splitlines(keepends=True)
        if not all(line.startswith(self.indent) or not line.strip() for line in lines):
            return None
        try:
            return ast.dump(ast.parse("".join(line[len(self.indent):] for line in lines)))
        except SyntaxError:
            return None

    def changes(self, m: Mutation) -> bool:
        """Whether the mutated module parses and its AST differs from the original."""
        if self.original is not None and self.start <= m.start and m.end <= self.end:
            src = self.text.source
            mutated = self._dump(src[self.start:m.start] + m.replacement + src[m.end:self.end])
            if mutated is not None:
                return mutated != self.original
        try:  # the whole module: a snippet that does not stand alone (nonlocal, odd indentation)
            return ast.dump(ast.parse(m.apply(self.text.source))) != ast.dump(ast.parse(self.text.source))
        except SyntaxError:
            return False


# --- where functions are and what is inside them -------------------------------------------------------------
def _functions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    def visit(node: ast.AST, prefix: str) -> Iterator:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                yield name, child
                yield from visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                yield from visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.If, ast.Try, ast.With)) and not _type_checking(child):
                yield from visit(child, prefix)

    yield from visit(tree, "")


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test)


def _trivial(func: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A stub: docstring, `pass`, `...` or `raise NotImplementedError` only; or an @overload."""
    if any("overload" in ast.dump(d) for d in func.decorator_list):
        return True
    body = [s for s in func.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    return all(isinstance(s, (ast.Pass, ast.Raise)) for s in body)


def _body_nodes(stmts: list[ast.stmt]) -> Iterator[ast.AST]:
    """Every node of a function's body but those of nested functions and classes (visited on their own)."""
    stack: list[ast.AST] = list(reversed(stmts))
    while stack:
        node = stack.pop()
        yield node
        children = [c for c in ast.iter_child_nodes(node)
                    if not isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
        stack.extend(reversed(children))


# --- the sites of each kind ------------------------------------------------------------------------------------
Site = tuple[str, int, int, str, str, int, int]  # kind, start, end, replacement, description, line, col


def _rng(text: _Text, at: int) -> random.Random:
    return random.Random(f"{at}:{text.source[max(0, at - 40):at + 40]}")


def _sites(text: _Text, node: ast.AST) -> list[Site]:
    out: list[Site] = []
    if isinstance(node, ast.Compare):
        out += _flip_comparison(text, node)
    elif isinstance(node, ast.BinOp):
        out += _change_binop(text, node)
    elif isinstance(node, ast.BoolOp):
        out += _change_boolop(text, node)
    elif isinstance(node, ast.AugAssign):
        out += _change_augassign(text, node)
    elif isinstance(node, ast.Call):
        out += _swap_arguments(text, node) + _range_args(text, node)
    elif isinstance(node, ast.Slice):
        out += _slice_bounds(text, node)
    elif isinstance(node, ast.If):
        out += _invert_if(text, node)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        out += _int_constant(text, node)
    for block in _blocks(node):
        for stmt in block:
            out += _drop_statement(text, stmt, alone=len(block) == 1)
    return out


def _token_between(text: _Text, a: ast.AST, b: ast.AST, pattern: re.Pattern) -> tuple[int, int, str] | None:
    s, e = text.end(a), text.start(b)
    seg = text.source[s:e]
    if "#" in seg or "\\" in seg:
        return None
    m = pattern.search(seg)
    return (s + m.start(), s + m.end(), re.sub(r"\s+", " ", m.group())) if m else None


def _flip_comparison(text: _Text, node: ast.Compare) -> list[Site]:
    out = []
    operands = [node.left, *node.comparators]
    for i, op in enumerate(node.ops):
        want, new = _FLIP[type(op)]
        tok = _token_between(text, operands[i], operands[i + 1], _CMP_TOKEN)
        if tok and tok[2] == want:
            out.append(("flip_comparison", tok[0], tok[1], new, f"`{want}` -> `{new}`", node.lineno, node.col_offset))
    return out


def _is_text(node: ast.AST) -> bool:
    return isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)))


def _change_binop(text: _Text, node: ast.BinOp) -> list[Site]:
    sym = _BINOP.get(type(node.op))
    if sym is None or (sym in "+%" and (_is_text(node.left) or _is_text(node.right))):
        return []
    tok = _token_between(text, node.left, node.right, _BIN_TOKEN)
    if not tok or tok[2] != sym:
        return []
    new = _rng(text, tok[0]).choice(_FAMILY[sym])
    return [("change_operator", tok[0], tok[1], new, f"`{sym}` -> `{new}`", node.lineno, node.col_offset)]


def _change_boolop(text: _Text, node: ast.BoolOp) -> list[Site]:
    out = []
    for a, b in zip(node.values, node.values[1:]):
        tok = _token_between(text, a, b, _BOOL_TOKEN)
        if tok:
            new = "or" if tok[2] == "and" else "and"
            out.append(("change_operator", tok[0], tok[1], new, f"`{tok[2]}` -> `{new}`", a.lineno, a.col_offset))
    return out


def _change_augassign(text: _Text, node: ast.AugAssign) -> list[Site]:
    sym = _BINOP.get(type(node.op))
    if sym is None:
        return []
    s, e = text.end(node.target), text.start(node.value)
    m = _AUG_TOKEN.search(text.source[s:e])
    if not m or m.group(1) != sym:
        return []
    new = _rng(text, s).choice(_FAMILY[sym])
    return [("change_operator", s + m.start(), s + m.end(), f"{new}=", f"`{sym}=` -> `{new}=`", node.lineno,
             node.col_offset)]


def _int_constant(text: _Text, node: ast.Constant) -> list[Site]:
    raw = text.segment(node)
    if not raw.isdigit():
        return []
    v = node.value
    new = v + 1 if v == 0 else v + _rng(text, text.start(node)).choice((-1, 1))
    return [("off_by_one", text.start(node), text.end(node), str(new), f"`{v}` -> `{new}`", node.lineno,
             node.col_offset)]


def _shifted(text: _Text, node: ast.expr, at: int) -> tuple[str, str]:
    raw = text.segment(node)
    sign = _rng(text, at).choice(("+", "-"))
    atom = isinstance(node, (ast.Name, ast.Attribute, ast.Call, ast.Subscript)) or (
        isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv)))
    new = f"{raw} {sign} 1" if atom else f"({raw}) {sign} 1"
    return new, f"`{raw}` -> `{new}`"


def _slice_bounds(text: _Text, node: ast.Slice) -> list[Site]:
    out = []
    for bound in (node.lower, node.upper):
        if bound is not None and not isinstance(bound, ast.Constant) and "\n" not in text.segment(bound):
            new, desc = _shifted(text, bound, text.start(bound))
            out.append(("off_by_one", text.start(bound), text.end(bound), new, desc, bound.lineno, bound.col_offset))
    return out


def _range_args(text: _Text, node: ast.Call) -> list[Site]:
    if not (isinstance(node.func, ast.Name) and node.func.id == "range"):
        return []
    out = []
    for arg in node.args[:2]:
        if not isinstance(arg, (ast.Constant, ast.Starred, ast.UnaryOp)) and "\n" not in text.segment(arg):
            new, desc = _shifted(text, arg, text.start(arg))
            out.append(("off_by_one", text.start(arg), text.end(arg), new, desc, arg.lineno, arg.col_offset))
    return out


def _callee(node: ast.Call) -> str:
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _swap_arguments(text: _Text, node: ast.Call) -> list[Site]:
    name = _callee(node)
    if (len(node.args) < 2 or any(isinstance(a, ast.Starred) for a in node.args) or name in _NO_SWAP
            or name.endswith(("Error", "Exception", "Warning"))):
        return []
    out = []
    for a, b in zip(node.args, node.args[1:]):
        ta, tb = text.segment(a), text.segment(b)
        middle = text.source[text.end(a):text.start(b)]
        if ta == tb or "#" in middle:
            continue
        out.append(("swap_arguments", text.start(a), text.end(b), tb + middle + ta,
                    f"`{name}({ta}, {tb})` -> `{name}({tb}, {ta})`", a.lineno, a.col_offset))
    return out


def _wrong_defaults(text: _Text, func: ast.FunctionDef | ast.AsyncFunctionDef) -> list[Site]:
    a = func.args
    params = [*a.posonlyargs, *a.args]
    pairs = list(zip(params[len(params) - len(a.defaults):], a.defaults)) + [
        (p, d) for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
    out = []
    for param, default in pairs:
        value = default.value if isinstance(default, ast.Constant) else None
        if isinstance(default, ast.UnaryOp) and isinstance(default.op, ast.USub) and isinstance(
                default.operand, ast.Constant) and type(default.operand.value) in (int, float):
            value = -default.operand.value
        if type(value) is bool:
            new = repr(not value)
        elif type(value) is int:
            new = str(value - 1 if value > 0 else value + 1)
        elif type(value) is float:
            new = repr(value * 2 if value else 1.0)
        else:
            continue
        out.append(("wrong_default", text.start(default), text.end(default), new,
                    f"default of `{param.arg}`: `{text.segment(default)}` -> `{new}`", default.lineno,
                    default.col_offset))
    return out


def _blocks(node: ast.AST) -> list[list[ast.stmt]]:
    blocks = []
    for field in ("body", "orelse", "finalbody"):
        value = getattr(node, field, None)
        if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
            blocks.append(value)
    return blocks


def _drop_statement(text: _Text, stmt: ast.stmt, *, alone: bool) -> list[Site]:
    droppable = isinstance(stmt, (ast.Assign, ast.AugAssign)) or (
        isinstance(stmt, ast.AnnAssign) and stmt.value is not None) or (
        isinstance(stmt, ast.Expr) and isinstance(stmt.value, (ast.Call, ast.Await)))
    if not droppable or not text.owns_lines(stmt):
        return []
    first = text.segment(stmt).splitlines()[0]
    desc = f"dropped `{first.strip()}`" + (" (replaced by `pass`)" if alone else "")
    if alone:
        return [("drop_statement", text.start(stmt), text.end(stmt), "pass", desc, stmt.lineno, stmt.col_offset)]
    return [("drop_statement", text.line_start(stmt.lineno), text.line_start(stmt.end_lineno + 1), "", desc,
             stmt.lineno, stmt.col_offset)]


def _invert_if(text: _Text, node: ast.If) -> list[Site]:
    body, orelse = node.body, node.orelse
    if not orelse or body[0].lineno <= node.test.end_lineno:
        return []
    else_line = next((n for n in range(body[-1].end_lineno + 1, orelse[0].lineno)
                      if re.match(r"\s*else\s*:", text.lines[n - 1])), None)
    if else_line is None or orelse[0].lineno <= else_line:
        return []  # an elif chain, or `else: x` on one line
    if text.indent(body[0].lineno) != text.indent(orelse[0].lineno):
        return []
    if not (text.owns_lines(body[-1]) and text.owns_lines(orelse[-1])):
        return []
    b0, b1 = text.line_start(body[0].lineno), text.line_start(body[-1].end_lineno + 1)
    e0, e1 = text.line_start(orelse[0].lineno), text.line_start(orelse[-1].end_lineno + 1)
    body_text, middle, else_text = text.source[b0:b1], text.source[b1:e0], text.source[e0:e1]
    if body_text == else_text:
        return []
    cond = text.segment(node.test).splitlines()[0]
    return [("invert_if", b0, e1, else_text + middle + body_text, f"swapped the branches of `if {cond}:`",
             node.lineno, node.col_offset)]
