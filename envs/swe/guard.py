"""What a submission may change, checked host-side before any test runs (the first defence of the SWE reward).

A fix of a SWE task is an edit of existing `.py` files under the package's `source_dir`, and nothing else travels
to the reward's clean workspace. `review(...)` compares the agent's files with the ones it started from and
refuses (reward 0, the reason naming the file and the rule) a submission that

1. adds, deletes or changes a test (anything under the suite's folders, any `conftest.py`), a test or packaging
   configuration (`setup.py`, `setup.cfg`, `pyproject.toml`, `tox.ini`, `pytest.ini`), a startup hook (`*.pth`,
   `sitecustomize.py`, `usercustomize.py`), anything under `source_dir` that is not an existing `.py` file, or
   turns a file into a link;
2. changes a `.py` file so that it no longer parses, or whose changed code (`code_problems`):
   - uses a name of `HARD_DENY` (`exec`, `eval`, `open`, `exit`, `_exit`, `modules`, `__builtins__`, frame and
     code attributes, `pytest`, ...): nothing a fix of these tasks needs, everything a forged verdict needs;
   - uses a dunder name, or `sys`/`os`, more often in a function than the clean original function does;
   - calls or refers to reflection (`getattr`, `setattr`, `delattr`, `attrgetter`, `methodcaller`) other than
     exactly as the clean function did (same call, same arguments): no name built from strings at run time;
   - writes a dunder name inside a new string (`"{0.__globals__}"`) that the clean function does not have;
   - uses a name or attribute that the clean module does not use, is not in `SAFE_NAMES`, and that the new
     code does not bind itself (a new local variable or helper is fine; a new attribute of a foreign object not);
   - adds an import the clean module does not have.

Why a real fix never needs more: every task's bug is one small edit of one function (a flipped comparison, an
off-by-one, a dropped statement, swapped arguments, a changed default, swapped branches, a changed operator),
validated against the clean module; the clean function — the oracle — uses only the module's own names,
imports and reflection, and the build drops any task whose oracle this guard would refuse. Files outside the
package that none of these rules name (a reproduction script, notes) are ignored: they never reach the tests.
"""

from __future__ import annotations

import ast
import functools
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from slime_env.envs.swe.manifest import RepoSpec

HARD_DENY = frozenset({
    "exec", "eval", "compile", "__import__", "globals", "locals", "vars", "open", "exit", "_exit", "quit", "system",
    "popen", "Popen", "spawn", "fork", "kill", "killpg", "modules", "breakpoint", "input", "__builtins__",
    "builtins", "importlib", "subprocess", "ctypes", "signal", "atexit", "environ", "settrace", "setprofile",
    "_getframe", "f_back", "f_globals", "f_locals", "f_builtins", "f_code", "gi_frame", "cr_frame", "ag_frame",
    "tb_frame", "__globals__", "__code__", "__closure__", "__subclasses__", "__loader__", "__spec__",
    "_pytest", "pytest", "unittest", "sitecustomize", "usercustomize", "gc", "inspect", "threading",
})
SOFT_NAMES = frozenset({"sys", "os"})  # and every dunder: no more uses per function than the clean one has
REFLECTION = frozenset({"getattr", "setattr", "delattr", "attrgetter", "methodcaller"})
SAFE_NAMES = frozenset({
    # builtins a fix may reach for
    "abs", "all", "any", "bool", "callable", "dict", "divmod", "enumerate", "filter", "float", "frozenset", "hash",
    "int", "isinstance", "iter", "len", "list", "map", "max", "min", "next", "range", "repr", "reversed",
    "round", "set", "slice", "sorted", "str", "sum", "tuple", "zip", "None", "True", "False", "NotImplemented",
    "self", "cls", "ValueError", "TypeError", "IndexError", "KeyError", "StopIteration", "AttributeError",
    "RuntimeError", "ZeroDivisionError",
    # methods of builtin containers and strings
    "append", "extend", "pop", "insert", "remove", "index", "count", "copy", "clear", "get", "items", "keys",
    "values", "update", "add", "discard", "setdefault", "popitem", "join", "split", "strip", "lstrip",
    "rstrip", "startswith", "endswith", "lower", "upper", "replace", "format", "find",
})
CONFIG_NAMES = frozenset({"setup.py", "setup.cfg", "pyproject.toml", "tox.ini", "pytest.ini", ".pytest.ini"})
HOOK_NAMES = frozenset({"sitecustomize.py", "usercustomize.py"})
_DUNDER = re.compile(r"__[A-Za-z0-9_]+__")

Entry = bytes | str  # a regular file's bytes, or "link" / "dir" / "other"


@dataclass(frozen=True)
class Review:
    """The guard's answer: `accepted`, the `problems` that refuse it, the source files to carry to the clean
    workspace (`changed`: path -> new text) and the files it ignored (`ignored`: outside every rule)."""

    accepted: bool
    problems: tuple[str, ...] = ()
    changed: Mapping[str, str] = field(default_factory=dict)
    ignored: tuple[str, ...] = ()

    @property
    def reason(self) -> str:
        return "; ".join(self.problems) if self.problems else "accepted"


def watched(spec: RepoSpec, path: str) -> bool:
    """Whether a /repo-relative path is one the rules cover (read and compared); the rest is ignored."""
    p = PurePosixPath(path)
    return (PurePosixPath(spec.source_dir) in p.parents or spec.is_test_path(path) or p.name in CONFIG_NAMES
            or p.name in HOOK_NAMES or p.suffix == ".pth")


def review(spec: RepoSpec, start: Mapping[str, Entry], agent: Mapping[str, Entry], clean: Mapping[str, Entry],
           *, ignored: tuple[str, ...] = ()) -> Review:
    """Compare the agent's watched files (`agent`) with those it started from (`start`: the clean repository with
    the bug, less the hidden tests) and check each changed source file against the clean one (`clean`)."""
    problems: list[str] = []
    changed: dict[str, str] = {}
    ignored = list(ignored)
    for path in sorted(set(start) | set(agent)):
        before, after = start.get(path), agent.get(path)
        if before == after:
            continue
        if not watched(spec, path):
            ignored.append(path)
            continue
        what = "adds" if before is None else "deletes" if after is None else "changes"
        p = PurePosixPath(path)
        if p.name in HOOK_NAMES or p.suffix == ".pth":
            problems.append(f"{what} {path}: an interpreter startup hook is never part of a fix")
        elif spec.is_test_path(path):
            problems.append(f"{what} {path}: the tests are not part of a fix")
        elif p.name in CONFIG_NAMES:
            problems.append(f"{what} {path}: test and packaging configuration is not part of a fix")
        elif not spec.is_source_path(path):
            problems.append(f"{what} {path}: only existing .py files under {spec.source_dir}/ may change")
        elif what != "changes":
            problems.append(f"{what} {path}: a fix edits existing files only")
        elif not isinstance(after, bytes) or not isinstance(before, bytes):
            problems.append(f"changes {path} into a {after if isinstance(after, str) else 'file'}: a fix edits "
                            f"regular files only")
        else:
            try:
                new_text = after.decode("utf-8")
            except UnicodeDecodeError:
                problems.append(f"changes {path}: it is not UTF-8 text")
                continue
            original = clean.get(path)
            problems += [f"{path}: {p}" for p in code_problems(
                original.decode("utf-8") if isinstance(original, bytes) else "", before.decode("utf-8"), new_text)]
            changed[path] = new_text
    return Review(accepted=not problems, problems=tuple(problems), changed=changed if not problems else {},
                  ignored=tuple(dict.fromkeys(ignored)))


# --- the code rule ---------------------------------------------------------------------------------------------
def code_problems(clean: str, buggy: str, new: str) -> list[str]:
    """Why the change `buggy` -> `new` of one module is not a plain fix (empty: it is); `clean` is the original."""
    try:
        n_new = _names_of(new)
    except SyntaxError as e:
        return [f"does not parse (line {e.lineno}: {e.msg})"]
    n_buggy, n_clean = _names_of(buggy, strict=False), _names_of(clean, strict=False)
    problems: list[str] = []
    for imp in sorted(n_new.imports - n_clean.imports):
        problems.append(f"adds an import ({imp}) the original module does not have")
    added = n_new.uses - n_buggy.uses
    reported: set[str] = set()
    for (scope, name), _ in sorted(added.items()):
        if name in reported:
            continue
        why = None
        if name in HARD_DENY:
            why = f"uses `{name}`, which no fix of this task needs"
        elif _DUNDER.fullmatch(name) or name in SOFT_NAMES:
            if n_new.uses[(scope, name)] > n_clean.uses[(scope, name)]:
                why = f"uses `{name}` in {scope} more often than the original code there"
        elif name in REFLECTION:
            continue  # judged by call below
        elif not (name in n_clean.names or name in SAFE_NAMES or name in n_new.bound):
            why = f"uses `{name}`, a name the original module does not use"
        if why:
            reported.add(name)
            problems.append(why)
    for (scope, call), count in sorted((n_new.reflection - n_buggy.reflection).items()):
        if n_new.reflection[(scope, call)] > n_clean.reflection[(scope, call)]:
            problems.append(f"uses reflection in {scope} (`{call[:80]}`) that the original code there does not")
    for (scope, word), count in sorted((n_new.string_dunders - n_buggy.string_dunders).items()):
        if n_new.string_dunders[(scope, word)] > n_clean.string_dunders[(scope, word)]:
            problems.append(f"writes `{word}` in a string in {scope}, which the original code there does not")
    return problems


@functools.lru_cache(maxsize=64)
def _names_of(source: str, strict: bool = True) -> _Names:
    """The names of a module (cached: the clean and buggy modules of a task recur at every reward)."""
    try:
        return _Names(ast.parse(source))
    except SyntaxError:
        if strict:
            raise
        return _Names(ast.Module(body=[], type_ignores=[]))


class _Names(ast.NodeVisitor):
    """Identifier uses per scope (function qualname or <module>), reflection calls, dunders inside strings,
    imports, every identifier of the module (`names`), and the names the module binds itself (`bound`)."""

    def __init__(self, tree: ast.Module):
        self.uses: Counter[tuple[str, str]] = Counter()
        self.reflection: Counter[tuple[str, str]] = Counter()
        self.string_dunders: Counter[tuple[str, str]] = Counter()
        self.imports: set[str] = set()
        self.bound: set[str] = set()
        self.scope = ["<module>"]
        self._reflection_funcs: set[int] = set()
        self.visit(tree)
        self.names = {name for _, name in self.uses}

    def _use(self, name: str | None) -> None:
        if name:
            self.uses[(self.scope[-1], name)] += 1

    def _scoped(self, node, name: str) -> None:
        self._use(name)
        self.bound.add(name)
        qual = name if self.scope[-1] == "<module>" else f"{self.scope[-1]}.{name}"
        self.scope.append(qual)
        self.generic_visit(node)
        self.scope.pop()

    def visit_FunctionDef(self, node):
        self._scoped(node, node.name)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node):
        self._scoped(node, node.name)

    def visit_Name(self, node):
        self._use(node.id)
        if isinstance(node.ctx, ast.Store):
            self.bound.add(node.id)
        if node.id in REFLECTION and id(node) not in self._reflection_funcs:
            self.reflection[(self.scope[-1], ast.dump(node))] += 1

    def visit_Attribute(self, node):
        self._use(node.attr)
        if isinstance(node.ctx, ast.Store):
            self.bound.add(node.attr)
        if node.attr in REFLECTION and id(node) not in self._reflection_funcs:
            self.reflection[(self.scope[-1], ast.unparse(node))] += 1
        self.generic_visit(node)

    def visit_Call(self, node):
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        if name in REFLECTION:
            self.reflection[(self.scope[-1], ast.unparse(node))] += 1
            self._reflection_funcs.add(id(f))
        self.generic_visit(node)

    def visit_arg(self, node):
        self._use(node.arg)
        self.bound.add(node.arg)
        self.generic_visit(node)

    def visit_keyword(self, node):
        self._use(node.arg)
        self.generic_visit(node)

    def visit_ExceptHandler(self, node):
        if node.name:
            self._use(node.name)
            self.bound.add(node.name)
        self.generic_visit(node)

    def visit_Global(self, node):
        for n in node.names:
            self._use(n)

    visit_Nonlocal = visit_Global

    def visit_Constant(self, node):
        if isinstance(node.value, str):
            for word in _DUNDER.findall(node.value):
                self.string_dunders[(self.scope[-1], word)] += 1

    def visit_Import(self, node):
        for a in node.names:
            self.imports.add(f"import {a.name}" + (f" as {a.asname}" if a.asname else ""))
            for part in a.name.split("."):
                self._use(part)
            self._use(a.asname)

    def visit_ImportFrom(self, node):
        module = "." * node.level + (node.module or "")
        for a in node.names:
            self.imports.add(f"from {module} import {a.name}" + (f" as {a.asname}" if a.asname else ""))
            self._use(a.name)
            self._use(a.asname)
        for part in (node.module or "").split("."):
            self._use(part)
