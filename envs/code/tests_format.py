"""Code tests in the formats datasets ship, normalised into one `TestSuite`.

Accepted shapes (a dict, or its JSON string):
- APPS / TACO: `{"input_output": "{\\"inputs\\": [...], \\"outputs\\": [...], \\"fn_name\\": \\"f\\"}"}` (the
  inner object, as a string or a dict, is accepted on its own too). With `fn_name`: call-based (each
  input is the argument list), else stdin/stdout (inputs and outputs are strings, or lists of lines).
- CodeContests: `{"public_tests": {"input": [...], "output": [...]}, "private_tests": {...},
  "generated_tests": {...}}` — stdin/stdout; public cases are marked public.
- LiveCodeBench: `{"public_test_cases": [...], "private_test_cases": [...], "metadata": {"func_name": ...}}`
  with cases `{"input", "output", "testtype": "stdin" | "functional"}` (JSON strings, and LCB's
  base64-zlib-pickled private cases, are decoded); functional inputs are one JSON value per line.
- Generic: `{"tests": [{"input": ..., "output": ...}, ...], "fn_name": optional}` or just that list.
- HumanEval: `{"test": "def check(candidate): ...", "entry_point": "f", "prompt": optional}`; every
  statement of `check` that contains an `assert` is one test case, the others are setup. The helper
  functions a Python `prompt` defines (HumanEval's `poly`, `encode_cyclic`) are used by the tests as
  the prompt wrote them, never as the solution redefines them.
- MBPP: `{"test_list": ["assert f(1) == 2", ...], "test_setup_code": "..."}`; each assert is a case.
- Assert code: `{"test": "<code with top-level asserts>"}`.
"""

from __future__ import annotations

import ast
import base64
import builtins
import json
import pickle
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from slime_env.errors import InvalidInput


@dataclass(frozen=True)
class TestSuite:
    """`kind` stdio / call / assert. stdio: `inputs` and `outputs` are strings; call: `inputs` are
    argument lists, `outputs` the expected values, `fn_name` the function; assert: `support` (helpers
    from the prompt), `prelude` (module-level test code) and `statements` `(code, is_case)`, `stubs`
    (each name the tests use for a solution function -> that function, e.g. `candidate` -> the entry
    point) and `modules` (names used as `name.attr` without an import: modules the solution imported).
    `public[i]` marks cases the prompt shows."""

    kind: str
    inputs: list[Any] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)
    fn_name: str | None = None
    prelude: str = ""
    statements: list[tuple[str, bool]] = field(default_factory=list)
    entry_point: str | None = None
    support: str = ""
    stubs: dict[str, str] = field(default_factory=dict)
    modules: list[str] = field(default_factory=list)
    public: list[bool] = field(default_factory=list)

    def __len__(self) -> int:
        return sum(1 for _, is_case in self.statements if is_case) if self.kind == "assert" else len(self.inputs)

    def describe(self, i: int) -> str:
        """A short text of case `i` for feedback: its input (stdio / call) or its statement (assert)."""
        if self.kind == "assert":
            return [code for code, is_case in self.statements if is_case][i]
        return self.inputs[i] if self.kind == "stdio" else json.dumps(self.inputs[i])


def parse_tests(spec: Any, where: str = "tests") -> TestSuite:
    """Any accepted shape as a `TestSuite`; InvalidInput naming `where` and what is wrong."""
    spec = _json(spec, where)
    if isinstance(spec, TestSuite):
        return spec
    if isinstance(spec, list):
        spec = {"tests": spec}
    if not isinstance(spec, Mapping):
        raise InvalidInput(f"{where}: expected a tests object or list, got {type(spec).__name__}")
    try:
        if "input_output" in spec:
            return _apps(_json(spec["input_output"], f"{where}.input_output"), where, spec.get("fn_name"))
        if "inputs" in spec and "outputs" in spec:
            return _apps(spec, where, spec.get("fn_name"))
        if any(k in spec for k in ("public_tests", "private_tests", "generated_tests")):
            return _code_contests(spec, where)
        if "public_test_cases" in spec or "private_test_cases" in spec:
            return _livecodebench(spec, where)
        if "test_list" in spec:
            return _mbpp(spec, where)
        if "test" in spec:
            return _assert_code(str(spec["test"]), spec.get("entry_point"), spec.get("prompt"), where)
        if "tests" in spec:
            return _generic(spec["tests"], spec.get("fn_name"), where)
    except InvalidInput:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidInput(f"{where}: malformed tests ({type(e).__name__}: {e})") from None
    raise InvalidInput(f"{where}: no known test format (fields: {sorted(spec)}); see slime_env.envs.code.tests_format")


def _json(value: Any, where: str) -> Any:
    if isinstance(value, (str, bytes)):
        try:
            return json.loads(value)
        except ValueError as e:
            raise InvalidInput(f"{where}: not valid JSON ({e})") from None
    return value


def _text(value: Any) -> str:
    if isinstance(value, list):
        return "\n".join(str(v) for v in value) + ("\n" if value else "")
    return str(value)


def _check_lengths(inputs: Sequence, outputs: Sequence, where: str) -> None:
    if len(inputs) != len(outputs):
        raise InvalidInput(f"{where}: {len(inputs)} inputs but {len(outputs)} outputs")
    if not inputs:
        raise InvalidInput(f"{where}: no test cases")


def _apps(io: Any, where: str, fn_name: str | None) -> TestSuite:
    if not isinstance(io, Mapping) or "inputs" not in io or "outputs" not in io:
        raise InvalidInput(f"{where}: input_output needs 'inputs' and 'outputs'")
    inputs, outputs = list(io["inputs"]), list(io["outputs"])
    _check_lengths(inputs, outputs, where)
    fn = io.get("fn_name") or fn_name
    if fn:
        return TestSuite("call", [a if isinstance(a, list) else [a] for a in inputs], outputs, fn_name=fn,
                         public=[False] * len(inputs))
    return TestSuite("stdio", [_text(x) for x in inputs], [_text(x) for x in outputs], public=[False] * len(inputs))


def _code_contests(spec: Mapping, where: str) -> TestSuite:
    inputs, outputs, public = [], [], []
    for key in ("public_tests", "private_tests", "generated_tests"):
        part = spec.get(key) or {}
        ins, outs = list(part.get("input", [])), list(part.get("output", []))
        if len(ins) != len(outs):
            raise InvalidInput(f"{where}.{key}: {len(ins)} inputs but {len(outs)} outputs")
        inputs += [_text(x) for x in ins]
        outputs += [_text(x) for x in outs]
        public += [key == "public_tests"] * len(ins)
    _check_lengths(inputs, outputs, where)
    return TestSuite("stdio", inputs, outputs, public=public)


def _lcb_cases(value: Any, where: str) -> list[Mapping]:
    if isinstance(value, str) and value and not value.lstrip().startswith("["):
        try:  # LiveCodeBench ships private cases as base64(zlib(pickle(json string)))
            value = pickle.loads(zlib.decompress(base64.b64decode(value)))  # noqa: S301 - dataset's own format
        except Exception as e:  # noqa: BLE001
            raise InvalidInput(f"{where}: cannot decode compressed test cases ({e})") from None
    cases = _json(value or "[]", where)
    if not isinstance(cases, list):
        raise InvalidInput(f"{where}: expected a list of test cases")
    return cases


def _livecodebench(spec: Mapping, where: str) -> TestSuite:
    public = _lcb_cases(spec.get("public_test_cases"), f"{where}.public_test_cases")
    private = _lcb_cases(spec.get("private_test_cases"), f"{where}.private_test_cases")
    cases = public + private
    if not cases:
        raise InvalidInput(f"{where}: no test cases")
    metadata = _json(spec.get("metadata") or {}, f"{where}.metadata")
    flags = [True] * len(public) + [False] * len(private)
    if all(c.get("testtype") == "functional" for c in cases):
        fn = metadata.get("func_name") or spec.get("fn_name")
        if not fn:
            raise InvalidInput(f"{where}: functional tests need metadata.func_name")
        inputs = [[json.loads(line) for line in str(c["input"]).splitlines() if line.strip()] for c in cases]
        return TestSuite("call", inputs, [json.loads(c["output"]) for c in cases], fn_name=fn, public=flags)
    return TestSuite("stdio", [str(c["input"]) for c in cases], [str(c["output"]) for c in cases], public=flags)


def _generic(tests: Any, fn_name: str | None, where: str) -> TestSuite:
    if not isinstance(tests, list) or not all(isinstance(t, Mapping) and "input" in t and "output" in t
                                              for t in tests):
        raise InvalidInput(f"{where}.tests: expected a list of {{'input': ..., 'output': ...}}")
    inputs, outputs = [t["input"] for t in tests], [t["output"] for t in tests]
    _check_lengths(inputs, outputs, where)
    public = [bool(t.get("public", False)) for t in tests]
    if fn_name:
        return TestSuite("call", [a if isinstance(a, list) else [a] for a in inputs], outputs, fn_name=fn_name,
                         public=public)
    return TestSuite("stdio", [_text(x) for x in inputs], [_text(x) for x in outputs], public=public)


def _contains_assert(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Assert) for n in ast.walk(node))


def bound_names(nodes: Sequence[ast.AST]) -> set[str]:
    """Every name the code binds anywhere (an over-approximation: scopes are ignored)."""
    bound = set()
    for node in nodes:
        for n in ast.walk(node):
            if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
                bound.add(n.id)
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bound.add(n.name)
            elif isinstance(n, ast.arg):
                bound.add(n.arg)
            elif isinstance(n, ast.alias):
                bound.add((n.asname or n.name).split(".")[0])
            elif isinstance(n, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and n.name:
                bound.add(n.name)
    return bound


def _free_names(nodes: Sequence[ast.AST], bound: set[str]) -> tuple[list[str], list[str]]:
    """Names the code reads but never binds and Python does not provide: (functions, modules), where a
    module-like name is only ever used as `name.attr`."""
    attribute_bases = {id(n.value) for node in nodes for n in ast.walk(node) if isinstance(n, ast.Attribute)}
    uses: dict[str, bool] = {}
    for node in nodes:
        for n in ast.walk(node):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in bound \
                    and not hasattr(builtins, n.id):
                uses[n.id] = uses.get(n.id, True) and id(n) in attribute_bases
    return [name for name, module in uses.items() if not module], [name for name, module in uses.items() if module]


def _prompt_helpers(prompt: Any, entry_point: str | None) -> str:
    """The prompt's module-level code without the function to write: imports and helper functions."""
    try:
        tree = ast.parse(str(prompt))
    except SyntaxError:  # a prose prompt: no helpers
        return ""
    return "\n".join(ast.unparse(n) for n in tree.body if not (
        isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == entry_point))


def _assert_suite(prelude: str, body: Sequence[ast.stmt], stubs: dict[str, str], support: str,
                  entry_point: str | None, where: str, shown: int = 0) -> TestSuite:
    """An assert-style suite; its first `shown` cases are public (the prompt shows them)."""
    statements = [(ast.unparse(n), _contains_assert(n)) for n in body]
    n_cases = sum(1 for _, is_case in statements if is_case)
    if not n_cases:
        raise InvalidInput(f"{where}: the test code has no assert")
    trees = [ast.parse(support), ast.parse(prelude), *body]
    functions, modules = _free_names(trees, bound_names(trees))
    stubs = {**{name: name for name in functions + modules}, **stubs}  # a module-like name may be the solution's
    return TestSuite("assert", prelude=prelude, statements=statements, entry_point=entry_point, support=support,
                     stubs=stubs, modules=modules, public=[i < shown for i in range(n_cases)])


def _assert_code(code: str, entry_point: str | None, prompt: Any, where: str) -> TestSuite:
    try:
        tree = ast.parse(code)
    except SyntaxError as e:
        raise InvalidInput(f"{where}: test code does not parse: {e}") from None
    support = _prompt_helpers(prompt, entry_point) if prompt else ""
    check = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"), None)
    if check is None:  # top-level asserts
        return _assert_suite("", tree.body, {}, support, entry_point, where)
    # HumanEval: check(candidate) holds the tests; its parameter is the function under test
    if not entry_point:
        raise InvalidInput(f"{where}: tests with check(candidate) need 'entry_point', the function to test")
    if len(check.args.args) != 1:
        raise InvalidInput(f"{where}: check() must take one argument, the function under test")
    prelude = "\n".join(ast.unparse(n) for n in tree.body if n is not check)
    return _assert_suite(prelude, check.body, {check.args.args[0].arg: entry_point}, support, entry_point, where)


def _mbpp(spec: Mapping, where: str) -> TestSuite:
    tests = list(spec["test_list"]) + list(spec.get("challenge_test_list") or [])
    if not tests:
        raise InvalidInput(f"{where}.test_list: no test cases")
    body = []
    for i, t in enumerate(tests):
        try:
            body += ast.parse(t).body
        except SyntaxError as e:
            raise InvalidInput(f"{where}.test_list[{i}]: does not parse: {e}") from None
    setup = str(spec.get("test_setup_code") or "")
    try:
        ast.parse(setup)
    except SyntaxError as e:
        raise InvalidInput(f"{where}.test_setup_code: does not parse: {e}") from None
    return _assert_suite(setup, body, {}, "", None, where, shown=3)
