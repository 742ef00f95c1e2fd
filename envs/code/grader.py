"""`Grader`: runs a submission against a `TestSuite` in a sandbox and scores it.

No verdict comes from a process the solution controls, and no expected value enters its sandbox.
The solution's sandbox run (`slime_env.envs.code.harness`) only reports what the code printed or returned:
- stdin/stdout and call-based tests: one run; outputs are compared here (`slime_env.envs.code.compare`);
- assert-style tests (HumanEval, MBPP, `{"test": ...}`): the solution's run sees only the arguments of
  the calls the tests make, never the assertions. When every case is a check the grader can evaluate
  itself (`assert candidate(<literals>) == <literal>` and relatives, `slime_env.envs.code.checks`: 158 of
  HumanEval's 164 problems), that is the only run. Otherwise the test code runs in sandbox runs that
  hold no solution (`slime_env.envs.code.replay`), on the return values the solution's run recorded: a first
  replay, cached per suite, lists the calls; the solution's run makes them; a second replay gives the
  verdicts. Calls whose arguments depend on earlier results (`candidate(candidate(x))`) take another
  round, `max_rounds` at most.
So a forged report claims only outputs or return values: no more than printing or returning them.
The result has per-case outcomes, the pass rate and a status; a sandbox that fails marks every case
failed with the reason. Nothing here raises for what the submission does.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slime_env.envs.code import checks, values
from slime_env.envs.code.compare import MODES, stdout_matches, value_matches
from slime_env.envs.code.tests_format import TestSuite

from slime_env.errors import InvalidInput

_HERE = Path(__file__).parent
HARNESS_SOURCE = (_HERE / "harness.py").read_text()  # the solution's run
REPLAY_SOURCE = (_HERE / "replay.py").read_text()  # the trusted runs of assert-style tests
_VALUES_FILE = {"_grader_values.py": (_HERE / "values.py").read_text()}
_HARNESS_FILES = {**_VALUES_FILE, "_grader_runner.py": (_HERE / "runner.py").read_text()}
_LOST = ("timeout", "crash", "output_limit", "not_run")


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
    """Grades submissions in `sandbox` (default `slime_env.tools_sandbox.auto()`).

    `case_timeout_s` per case, `total_timeout_s` per submission (cases left when it runs out fail as
    `not_run`), `memory_mb` for the whole run, `compare` one of `lines` / `exact` / `tokens`,
    `float_tol` (None: floats must match as text in stdout; call-based values use 1e-9 when None).
    Assert-style tests: `max_rounds` solution runs at most, `max_calls` calls per round.
    """

    def __init__(self, sandbox: Any = None, *, case_timeout_s: float = 4.0, total_timeout_s: float = 30.0,
                 memory_mb: int = 1024, compare: str = "lines", float_tol: float | None = None,
                 output_cap_bytes: int = 1 << 20, max_rounds: int = 4, max_calls: int = 10_000):
        if compare not in MODES:
            raise ValueError(f"compare must be one of {MODES}, got {compare!r}")
        if max_rounds < 1 or max_calls < 1:
            raise ValueError(f"max_rounds and max_calls must be >= 1, got {max_rounds}, {max_calls}")
        self._sandbox = sandbox
        self.case_timeout_s, self.total_timeout_s, self.memory_mb = case_timeout_s, total_timeout_s, memory_mb
        self.compare, self.float_tol, self.output_cap_bytes = compare, float_tol, output_cap_bytes
        self.max_rounds, self.max_calls = max_rounds, max_calls
        self._checks: dict[str, list[checks.Check] | None] = {}  # suite digest -> its cases as checks, or None
        self._plans: dict[str, dict[str, Any]] = {}  # suite digest -> its first replay (same for every solution)
        self._planning: dict[tuple[int, str], asyncio.Task] = {}
        self._batchers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Batcher] = weakref.WeakKeyDictionary()

    @property
    def sandbox(self):
        if self._sandbox is None:
            from slime_env import tools_sandbox

            self._sandbox = tools_sandbox.auto()
        return self._sandbox

    async def grade(self, code: str, suite: TestSuite) -> GradeResult:
        t0 = time.perf_counter()
        if suite.kind == "assert":
            result = await self._grade_assert(code, suite)
        else:
            result = await self._grade_io(code, suite)
        return GradeResult(result.passed, result.total, result.cases, result.status, result.reason,
                           time.perf_counter() - t0)

    # --- stdin/stdout and call-based: one run, outputs compared here -------------------------------

    async def _grade_io(self, code: str, suite: TestSuite) -> GradeResult:
        spec: dict[str, Any] = {"kind": suite.kind, "inputs": suite.inputs}  # inputs only: never the outputs
        if suite.kind == "call":
            spec = {"kind": "calls", "calls": [{"case": i, "fn": suite.fn_name, "args": _tag_input(args, i),
                                                "kwargs": {"dict": []}} for i, args in enumerate(suite.inputs)]}
        report, reason = await self._run_solution(code, spec, self.total_timeout_s)
        if suite.kind == "stdio":
            outcomes = [_clean_stdio(o) for o in report] if isinstance(report, list) and len(report) == len(suite) \
                else None
        else:
            outcomes = _call_outcomes(report, len(suite))
        if outcomes is None:
            return _unrunnable(suite, reason)
        cases = [self._case(suite, i, o) for i, o in enumerate(outcomes)]
        return GradeResult(sum(c.passed for c in cases), len(cases), cases)

    def _case(self, suite: TestSuite, i: int, outcome: Mapping[str, Any]) -> CaseResult:
        status = outcome.get("status", "not_run")
        common = {"input": _short(suite.describe(i)), "public": _public(suite, i)}
        expected = suite.outputs[i]
        if suite.kind == "stdio":
            if status != "ok":
                return CaseResult(False, status, expected=_short(expected), got=_short(outcome.get("stdout", "")),
                                  error=_short(outcome.get("stderr", "") or outcome.get("error", "")), **common)
            passed = stdout_matches(str(outcome.get("stdout", "")), expected, self.compare, self.float_tol)
            return CaseResult(passed, "pass" if passed else "wrong_answer", expected=_short(expected),
                              got=_short(outcome.get("stdout", "")), **common)
        if status != "ok":
            return CaseResult(False, status, expected=_short(expected), error=_short(_error_text(outcome)), **common)
        passed = value_matches(outcome["value"], expected, self.float_tol or 1e-9)
        return CaseResult(passed, "pass" if passed else "wrong_answer", expected=_short(expected),
                          got=_short(outcome["value"]), **common)

    # --- assert-style: the tests replayed on recorded return values, without the solution ----------

    async def _grade_assert(self, code: str, suite: TestSuite) -> GradeResult:
        key = _digest(suite)
        if key not in self._checks:
            if len(self._checks) >= 4096:
                self._checks.pop(next(iter(self._checks)))
            self._checks[key] = checks.split(suite)
        if self._checks[key] is not None:  # every case checkable here: one sandbox run, no test code run
            return await self._grade_checks(code, suite, self._checks[key])
        return await self._grade_replayed(code, suite, key)

    async def _grade_checks(self, code: str, suite: TestSuite, cases: list[checks.Check]) -> GradeResult:
        calls = [{"case": c.statement, "fn": fn, "args": values.tag(args), "kwargs": values.tag(kwargs)}
                 for c in cases for fn, args, kwargs in c.calls]
        report, reason = await self._run_solution(code, {"kind": "calls", "calls": calls}, self.total_timeout_s)
        outcomes = _call_outcomes(report, len(calls))
        if outcomes is None:
            return _unrunnable(suite, reason)
        if report.get("loaded") is not True:
            return _load_failed(suite, report, outcomes)
        results, k = [], 0
        for i, case in enumerate(cases):
            returned = [_returned(o) for o in outcomes[k:k + len(case.calls)]]
            k += len(case.calls)
            common = {"input": _short(suite.describe(i)), "public": _public(suite, i)}
            try:
                passed = checks.evaluate(case, returned)
            except checks.Failed as e:
                results.append(CaseResult(False, "wrong_answer", error=_short(str(e)), **common))
            except checks.Lost as e:
                results.append(CaseResult(False, e.status, error=_short(e.error), **common))
            else:
                got = ", ".join(repr(v) for v in returned)  # what the solution returned, for feedback
                results.append(CaseResult(passed, "pass" if passed else "wrong_answer", got=_short(got),
                                          error="" if passed else "AssertionError", **common))
        return GradeResult(sum(c.passed for c in results), len(results), results)

    async def _grade_replayed(self, code: str, suite: TestSuite, key: str) -> GradeResult:
        verdict, reason = await self._plan(suite, key)
        table: list[dict[str, Any]] = []
        budget = self.total_timeout_s
        for _ in range(self.max_rounds):
            if verdict is None:
                return _unrunnable(suite, reason)
            calls = verdict["calls"]
            t0 = time.perf_counter()
            report, reason = await self._run_solution(
                code, {"kind": "calls", "calls": [{k: c[k] for k in ("case", "fn", "args", "kwargs")} for c in calls]},
                budget)
            budget = max(0.5, budget - (time.perf_counter() - t0))
            outcomes = _call_outcomes(report, len(calls))
            if outcomes is None:
                return _unrunnable(suite, reason)
            if report.get("loaded") is not True:  # nothing to replay: every case fails as the load did
                return _load_failed(suite, report, outcomes)
            if not calls:  # nothing to replay: the first replay already had every verdict
                break
            table += [{"key": c["key"], "n": c["n"], "outcome": o} for c, o in zip(calls, outcomes)]
            verdict, reason = await self._replay(suite, table)
            if verdict is not None and not verdict["calls"]:
                break
        if verdict is None:
            return _unrunnable(suite, reason)
        cases = [self._assert_case(suite, i, o) for i, o in enumerate(verdict["cases"])]
        return GradeResult(sum(c.passed for c in cases), len(cases), cases)

    def _assert_case(self, suite: TestSuite, i: int, outcome: Mapping[str, Any]) -> CaseResult:
        status, error = outcome["status"], outcome.get("error", "")
        if status == "pending":
            status, error = "not_run", f"the tests' calls to the solution did not settle in {self.max_rounds} rounds"
        elif status not in ("pass", "fail", "error", *_LOST):
            status, error = "error", f"unexpected status {status!r}"
        return CaseResult(status == "pass", {"fail": "wrong_answer"}.get(status, status), error=_short(error),
                          input=_short(suite.describe(i)), public=_public(suite, i))

    async def _plan(self, suite: TestSuite, key: str) -> tuple[dict[str, Any] | None, str]:
        """The replay with no recorded calls: which calls the tests make. Cached: it is the same for every
        solution, so a group of n samples of one prompt pays for it once."""
        if key in self._plans:
            return self._plans[key], ""
        loop = asyncio.get_running_loop()
        task = self._planning.get((id(loop), key))
        if task is None:
            task = self._planning[(id(loop), key)] = loop.create_task(self._replay(suite, []))
            task.add_done_callback(lambda _: self._planning.pop((id(loop), key), None))
        plan, reason = await asyncio.shield(task)
        if plan is not None:
            if len(self._plans) >= 4096:
                self._plans.pop(next(iter(self._plans)))
            self._plans[key] = plan
        return plan, reason

    async def _replay(self, suite: TestSuite, table: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, str]:
        spec = {"support": suite.support, "prelude": suite.prelude, "statements": suite.statements,
                "stubs": suite.stubs, "modules": suite.modules, "table": table, "max_new_calls": self.max_calls,
                "statement_timeout_s": self.case_timeout_s, "timeout_s": self.total_timeout_s}
        loop = asyncio.get_running_loop()
        batcher = self._batchers.get(loop)
        if batcher is None:
            slots = getattr(self.sandbox, "max_concurrency", 4)
            batcher = self._batchers[loop] = _Batcher(self._replay_batch, max_batch=16, max_running=max(1, slots // 2))
        verdict, reason = await batcher.submit(spec)
        if verdict is not None and len(verdict["cases"]) != len(suite):
            return None, f"the test replay reported {len(verdict['cases'])} cases for {len(suite)}"
        return verdict, reason

    async def _replay_batch(self, specs: list[dict[str, Any]]) -> list[tuple[dict[str, Any] | None, str]]:
        """Several replays in one sandbox run: one interpreter start-up for all of them."""
        for _ in range(2):  # the replay is deterministic and runs no solution: safe to retry once
            result = await self.sandbox.run(REPLAY_SOURCE, files=_VALUES_FILE, stdin=json.dumps({"replays": specs}),
                                            timeout_s=min(3600.0, self.total_timeout_s * len(specs) + 5.0),
                                            memory_mb=self.memory_mb,
                                            output_limit_bytes=max(4 << 20, self.output_cap_bytes * 4 * len(specs)))
            if result.status != "sandbox_error":  # a failure of the sandbox itself, not of the tests
                break
        report = _last_json(result.stdout)
        if not (isinstance(report, dict) and isinstance(report.get("replays"), list)
                and len(report["replays"]) == len(specs)):
            reason = f"the test replay failed ({result.status}): " + (
                result.reason or result.stderr.strip()[-300:] or "no report")
            return [(None, reason)] * len(specs)
        out = []
        for verdict in report["replays"]:
            if not (isinstance(verdict, dict) and isinstance(verdict.get("cases"), list)
                    and isinstance(verdict.get("calls"), list)):
                out.append((None, "the test replay reported nothing usable"))
            elif verdict.get("error"):
                out.append((None, str(verdict["error"])))
            else:
                out.append((verdict, ""))
        return out

    async def _run_solution(self, code: str, spec: dict[str, Any], total_timeout_s: float) -> tuple[Any, str]:
        """The solution's sandbox run: its report (observations only), or None and why there is none."""
        spec = {**spec, "case_timeout_s": self.case_timeout_s, "total_timeout_s": total_timeout_s,
                "output_cap": self.output_cap_bytes}
        result = await self.sandbox.run(HARNESS_SOURCE, files={"solution.py": code, **_HARNESS_FILES},
                                        stdin=json.dumps(spec), timeout_s=total_timeout_s + 5.0,
                                        memory_mb=self.memory_mb,
                                        output_limit_bytes=max(4 << 20, self.output_cap_bytes * 4))
        report = _last_json(result.stdout)
        if not isinstance(report, dict) or "results" not in report:
            return None, f"{result.status}: " + (result.reason or result.stderr.strip()[-300:]
                                                  or "the test harness produced no results")
        return report["results"], ""


class _Batcher:
    """Requests made while earlier ones run go out together, `max_batch` at a time, at most `max_running`
    batches at once: under load many replays share one sandbox run, alone a replay waits for nothing."""

    def __init__(self, run_batch: Callable[[list[Any]], Awaitable[list[Any]]], *, max_batch: int, max_running: int):
        self.run_batch, self.max_batch, self.max_running = run_batch, max_batch, max_running
        self.queue: list[tuple[Any, asyncio.Future]] = []
        self.running: set[asyncio.Task] = set()
        self.scheduled = False

    async def submit(self, item: Any) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.queue.append((item, future))
        if not self.scheduled:  # start on the next loop turn: requests made in this one join the batch
            self.scheduled = True
            loop.call_soon(self._start)
        return await future

    def _start(self) -> None:
        self.scheduled = False
        while self.queue and len(self.running) < self.max_running:
            batch, self.queue = self.queue[:self.max_batch], self.queue[self.max_batch:]
            task = asyncio.get_running_loop().create_task(self._run(batch))
            self.running.add(task)
            task.add_done_callback(self.running.discard)

    async def _run(self, batch: list[tuple[Any, asyncio.Future]]) -> None:
        try:
            results = await self.run_batch([item for item, _ in batch])
        except Exception as e:  # noqa: BLE001 - a failed batch fails its requests, never the caller's loop
            results = [(None, f"{type(e).__name__}: {e}")] * len(batch)
        for (_, future), result in zip(batch, results):
            if not future.done():
                future.set_result(result)
        asyncio.get_running_loop().call_soon(self._start)


def _digest(suite: TestSuite) -> str:
    return hashlib.sha256(json.dumps([suite.support, suite.prelude, suite.statements, suite.stubs,
                                      suite.modules]).encode()).hexdigest()


def _returned(outcome: dict[str, Any]) -> Any:
    """A cleaned call outcome as what the call gave the test: its value, or the exception to raise."""
    if outcome["status"] == "ok":
        return values.untag(outcome["value"])
    if outcome["status"] == "error":
        return checks.Failed(_error_text(outcome))
    return checks.Lost(outcome["status"], outcome.get("error", ""))


def _load_failed(suite: TestSuite, report: dict[str, Any], outcomes: list[dict[str, Any]]) -> GradeResult:
    status = outcomes[0]["status"] if outcomes else ("timeout" if report.get("status") == "timeout" else "error")
    failed = [CaseResult(False, status, input=_short(suite.describe(i)), error=_short(_load_error(report)),
                         public=_public(suite, i)) for i in range(len(suite))]
    return GradeResult(0, len(suite), failed)


def _public(suite: TestSuite, i: int) -> bool:
    return bool(suite.public[i]) if i < len(suite.public) else False


def _tag_input(args: Any, i: int) -> Any:
    try:
        return values.tag(list(args))
    except values.NotPlain as e:
        raise InvalidInput(f"tests: input {i} holds a {type(e.value).__name__}; only plain values can be "
                           f"passed to a solution") from None


def _error_text(outcome: Mapping[str, Any]) -> str:
    kind = outcome.get("type")
    return f"{kind}: {outcome.get('error', '')}" if kind else str(outcome.get("error", ""))


def _unrunnable(suite: TestSuite, reason: str) -> GradeResult:
    failed = [CaseResult(False, "not_run", error=reason) for _ in range(len(suite))]
    return GradeResult(0, len(suite), failed, "sandbox_error", reason)


def _call_outcomes(report: Any, n_calls: int) -> list[dict[str, Any]] | None:
    """The solution run's per-call outcomes, checked and reduced to what the grader may use; a run where
    the solution did not load gives every call that failure. None when there is no usable report."""
    if not isinstance(report, dict) or not isinstance(report.get("calls"), list) or len(report["calls"]) != n_calls:
        return None
    if report.get("loaded") is not True:
        status = "timeout" if report.get("status") == "timeout" else "error"
        return [{"status": status, "error": _load_error(report)}] * n_calls
    return [_clean_outcome(o) for o in report["calls"]]


def _clean_stdio(outcome: Any) -> dict[str, Any]:
    """A program's run as the harness reported it, reduced to known statuses and texts."""
    if not isinstance(outcome, dict) or outcome.get("status") not in ("ok", "error", *_LOST):
        return {"status": "crash", "error": "the solution's run reported nothing usable for this case"}
    return {"status": outcome["status"], "stdout": str(outcome.get("stdout", "")),
            "stderr": str(outcome.get("stderr", "")), "error": str(outcome.get("error", ""))}


def _load_error(report: dict[str, Any]) -> str:
    return str(report.get("error") or "the solution did not load")[:300]


def _clean_outcome(outcome: Any) -> dict[str, Any]:
    """Only what a call can legitimately produce passes: a plain value, an exception's name and text, or
    the way it was lost. Anything else (a forged or broken line) is the solution's failure."""
    status = outcome.get("status") if isinstance(outcome, dict) else None
    if status == "ok":
        try:
            values.untag(outcome["value"])
            after = outcome.get("args_after")
            if after is not None and type(values.untag(after)) is not list:
                raise ValueError("args_after is not a list")
        except (KeyError, ValueError, TypeError, RecursionError):
            return {"status": "error", "type": "TypeError", "error": "the solution's run reported a malformed value"}
        return {"status": "ok", "value": outcome["value"], **({"args_after": after} if after is not None else {})}
    if status == "error":
        return {"status": "error", "type": str(outcome.get("type", "Exception"))[:100],
                "error": str(outcome.get("error", ""))[:300]}
    if status in _LOST:
        return {"status": status, "error": str(outcome.get("error", ""))[:300]}
    return {"status": "crash", "error": "the solution's run reported nothing usable for this call"}


def _last_json(stdout: str) -> Any:
    for line in reversed(stdout.strip().splitlines()):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None
