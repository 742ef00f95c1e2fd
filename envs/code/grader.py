"""`Grader`: runs a submission against a `TestSuite` in a sandbox and scores it.

One sandbox run per submission: the harness (`envs.code.harness`) executes every case inside it with
its own time limit, and the outputs are compared here, outside (`envs.code.compare`). The result has
per-case outcomes, the pass rate and a status; a sandbox that fails marks every case failed with the
reason. Nothing here raises for what the submission does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from envs.code.compare import MODES, stdout_matches, value_matches
from envs.code.harness import HARNESS_SOURCE
from envs.code.tests_format import TestSuite


@dataclass(frozen=True)
class CaseResult:
    """One test case: `passed`, `status` (pass / wrong_answer / error / timeout / crash / output_limit /
    not_run), and for feedback `input`, `expected`, `got` (short texts) and `error`."""

    passed: bool
    status: str
    input: str = ""
    expected: str = ""
    got: str = ""
    error: str = ""
    public: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "status": self.status, "input": self.input, "expected": self.expected,
                "got": self.got, "error": self.error, "public": self.public}


@dataclass(frozen=True)
class GradeResult:
    """`passed` of `total` cases; `status` is ok, or sandbox_error with `reason` (then nothing passed)."""

    passed: int
    total: int
    cases: list[CaseResult] = field(default_factory=list)
    status: str = "ok"
    reason: str = ""
    duration_s: float = 0.0

    @property
    def pass_rate(self) -> float:
        return self.passed / self.total if self.total else 0.0

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "total": self.total, "pass_rate": self.pass_rate, "status": self.status,
                "reason": self.reason, "duration_s": self.duration_s, "cases": [c.to_dict() for c in self.cases]}


def _short(text: Any, n: int = 300) -> str:
    text = text if isinstance(text, str) else json.dumps(text, default=repr)
    return text if len(text) <= n else text[:n] + f"... [{len(text) - n} more characters]"


class Grader:
    """Grades submissions in `sandbox` (default `tools_sandbox.auto()`).

    `case_timeout_s` per case, `total_timeout_s` per submission (cases left when it runs out fail as
    `not_run`), `memory_mb` for the whole run, `compare` one of `lines` / `exact` / `tokens`,
    `float_tol` (None: floats must match as text in stdout; call-based values use 1e-9 when None).
    """

    def __init__(self, sandbox: Any = None, *, case_timeout_s: float = 4.0, total_timeout_s: float = 30.0,
                 memory_mb: int = 1024, compare: str = "lines", float_tol: float | None = None,
                 output_cap_bytes: int = 1 << 20):
        if compare not in MODES:
            raise ValueError(f"compare must be one of {MODES}, got {compare!r}")
        self._sandbox = sandbox
        self.case_timeout_s, self.total_timeout_s, self.memory_mb = case_timeout_s, total_timeout_s, memory_mb
        self.compare, self.float_tol, self.output_cap_bytes = compare, float_tol, output_cap_bytes

    @property
    def sandbox(self):
        if self._sandbox is None:
            import tools_sandbox

            self._sandbox = tools_sandbox.auto()
        return self._sandbox

    async def grade(self, code: str, suite: TestSuite) -> GradeResult:
        spec: dict[str, Any] = {"kind": suite.kind, "case_timeout_s": self.case_timeout_s,
                                "total_timeout_s": self.total_timeout_s, "output_cap": self.output_cap_bytes}
        if suite.kind == "assert":
            spec.update(prelude=suite.prelude, statements=suite.statements, entry_point=suite.entry_point,
                        guard=suite.guard)
        else:
            spec.update(inputs=suite.inputs, fn_name=suite.fn_name)  # inputs only: never the expected outputs
        result = await self.sandbox.run(HARNESS_SOURCE, files={"solution.py": code}, stdin=json.dumps(spec),
                                        timeout_s=self.total_timeout_s + 5.0, memory_mb=self.memory_mb,
                                        output_limit_bytes=max(4 << 20, self.output_cap_bytes * 4))
        outcomes = _harness_results(result.stdout)
        if outcomes is None or len(outcomes) != len(suite):
            reason = result.reason or result.stderr.strip()[-300:] or "the test harness produced no results"
            failed = [CaseResult(False, "not_run", error=reason) for _ in range(len(suite))]
            return GradeResult(0, len(suite), failed, "sandbox_error", f"{result.status}: {reason}", result.duration_s)
        cases = [self._case(suite, i, o) for i, o in enumerate(outcomes)]
        return GradeResult(sum(c.passed for c in cases), len(cases), cases, duration_s=result.duration_s)

    def _case(self, suite: TestSuite, i: int, outcome: Mapping[str, Any]) -> CaseResult:
        status = outcome.get("status", "not_run")
        public = bool(suite.public[i]) if i < len(suite.public) else False
        common = {"input": _short(suite.describe(i)), "public": public}
        if suite.kind == "assert":
            passed = status == "pass"
            return CaseResult(passed, "pass" if passed else ("wrong_answer" if status == "fail" else status),
                              error=_short(outcome.get("error", "")), **common)
        expected = suite.outputs[i]
        if suite.kind == "stdio":
            if status not in ("ok",):
                return CaseResult(False, status, expected=_short(expected), got=_short(outcome.get("stdout", "")),
                                  error=_short(outcome.get("stderr", "") or outcome.get("error", "")), **common)
            passed = stdout_matches(outcome["stdout"], expected, self.compare, self.float_tol)
            return CaseResult(passed, "pass" if passed else "wrong_answer", expected=_short(expected),
                              got=_short(outcome["stdout"]), **common)
        if status != "ok":
            return CaseResult(False, status, expected=_short(expected), error=_short(outcome.get("error", "")), **common)
        passed = value_matches(outcome["value"], expected, self.float_tol or 1e-9)
        return CaseResult(passed, "pass" if passed else "wrong_answer", expected=_short(expected),
                          got=_short(outcome["value"]), **common)


def _harness_results(stdout: str) -> list[Mapping[str, Any]] | None:
    for line in reversed(stdout.strip().splitlines()):
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict) and isinstance(data.get("results"), list):
            return data["results"]
        return None
    return None
