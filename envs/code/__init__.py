"""Code env `Code-v0`: programs graded by unit tests in a sandbox, with multi-turn execution feedback.

Pieces usable alone: `parse_tests` (APPS/TACO, CodeContests, LiveCodeBench, HumanEval, MBPP, generic →
`TestSuite`), `Grader` (no verdict comes from the solution's sandbox: outputs are compared, and
assert-style tests checked or replayed, outside it), `load_code_tasks` and `load_humaneval`.
"""

from slime_env.envs.code.data import code_row_to_task, load_code_tasks, load_humaneval
from slime_env.envs.code.grader import CaseResult, GradeResult, Grader
from slime_env.envs.code.tests_format import TestSuite, parse_tests

__all__ = ["CaseResult", "GradeResult", "Grader", "TestSuite", "code_row_to_task", "load_code_tasks",
           "load_humaneval", "parse_tests"]
