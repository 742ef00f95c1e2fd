"""Assert-style grading without trusting the solution's sandbox: the pieces alone (tagged values, checks
the grader evaluates itself, the replay of test code on a table of recorded calls, the harness's event
parser), then whole grades in a real sandbox (bubblewrap) for the test shapes that need more than one
call per case: loops, nested calls, calls expected to raise, arguments changed in place, prompt
helpers, modules the test does not import."""

from __future__ import annotations

import asyncio
import math

import pytest
from slime_env.envs.code import Grader, parse_tests
from slime_env.envs.code.checks import Failed, Lost, evaluate, split
from slime_env.envs.code.harness import parse_event
from slime_env.envs.code.replay import run as replay
from slime_env.envs.code.values import NotPlain, tag, untag

from sandbox_support import make_sandbox

# --- tagged values ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [0, -7, 10**40, 1.5, float("inf"), "x\udcff", b"\x00\xff", True, None, 1 + 2j,
                                   [1, [2.5]], (1, (2,)), {1, "a"}, frozenset({(1, 2)}), {"k": [1], 2: (3,)}, []])
def test_plain_values_round_trip_exactly(value):
    back = untag(tag(value))
    assert back == value and type(back) is type(value)
    if isinstance(value, dict):
        assert [type(k) for k in back] == [type(k) for k in value]


def test_nan_round_trips():
    assert math.isnan(untag(tag(float("nan"))))


class AlwaysEqual(int):
    def __eq__(self, other):
        return True


@pytest.mark.parametrize("value", [AlwaysEqual(1), [object()], {"k": lambda: 0}, (i for i in ()), type])
def test_anything_not_plain_is_refused(value):
    with pytest.raises(NotPlain):
        tag(value)


@pytest.mark.parametrize("data", [{"__eq__": True}, {"f": 1}, {"tuple": 3}, {"dict": [[1]]}, {"a": 1, "b": 2},
                                  {"complex": ["1"]}])
def test_malformed_tagged_data_is_refused(data):
    with pytest.raises(ValueError):
        untag(data)


# --- checks the grader evaluates itself -------------------------------------------------------------------

def mbpp(*tests, setup=""):
    return parse_tests({"test_list": list(tests), "test_setup_code": setup})


@pytest.mark.parametrize("statement", [
    "assert f(1, [2, (3,)], k={'a': None}) == {1: 'x'}", "assert not f(0)", "assert f(0) is None",
    "assert abs(f(0.5) - 0.25) < 1e-9", "assert set(f([1])) == {1}", "assert sorted(f('ba')) == ['a', 'b']",
    "assert f(1) == 2 and f(2) == 3", "assert 0 < f(3) <= 5", "assert -f(1) == -2", "assert 'a' in f('abc')",
    "assert f(1), 'a message'", "assert f(3 * 19, 2.0 / 3.0, 'ab' + 'c', -(2 ** 10)) == [3, 19]"])
def test_literal_asserts_are_checked_by_the_grader(statement):
    assert split(mbpp(statement)) is not None


@pytest.mark.parametrize("statements, setup", [
    (["assert f(f(1)) == 1"], ""), (["assert f(x) == 1"], ""), (["assert f(1) == 1 or f(2) == 2"], ""),
    (["assert f(1) * 10 ** 9 == 0"], ""), (["assert f(1) is 5"], ""), (["assert f(1) is 1.0"], ""),
    (["assert f(10 ** 10 ** 10) == 1"], ""), (["assert f('a' * 10 ** 9) == 1"], ""), (["assert helper(f(1)) == 2"], ""),
    (["assert abs(f(1)) == 1"], "abs = lambda v: 1"), (["assert f(*[1]) == 1"], ""),
    (["assert f(1) == 1", "x = 2"], ""), (["for i in range(3):\n    assert f(i) == i"], "")])
def test_everything_else_goes_to_the_replay(statements, setup):
    assert split(mbpp(*statements, setup=setup)) is None


def test_checks_evaluate_like_python():
    (check,) = split(mbpp("assert abs(f(0.5) - 0.25) < 1e-9"))
    assert check.calls == [("f", [0.5], {})]
    assert evaluate(check, [0.25]) and not evaluate(check, [0.3])
    with pytest.raises(Failed, match="TypeError"):
        evaluate(check, [None])  # abs(None - 0.25) raises, as the assert would
    with pytest.raises(Lost):
        evaluate(check, [Lost("timeout", "time limit")])
    (both,) = split(mbpp("assert not (f(1) == 0 and f(2) == 0) and f(3) == 3"))
    assert evaluate(both, [1, 0, 3])  # the skipped f(2) does not shift f(3)'s value
    assert not evaluate(both, [0, 0, 3])


# --- the replay, run here (it is trusted code: it never runs a solution) --------------------------------

def spec(statements, table=(), stubs=None, **kw):
    return {"support": kw.get("support", ""), "prelude": kw.get("prelude", ""),
            "statements": [(s, "assert" in s) for s in statements], "stubs": stubs or {"candidate": "f"},
            "modules": kw.get("modules", []), "table": list(table), "statement_timeout_s": 5.0,
            "max_new_calls": kw.get("max_new_calls", 1000)}


def answer(calls, fn):
    """The table a solution `fn` would produce for `calls`."""
    out = []
    for c in calls:
        try:
            value = fn(*untag(c["args"]), **untag(c["kwargs"]))
            outcome = {"status": "ok", "value": tag(value)}
        except Exception as e:  # noqa: BLE001
            outcome = {"status": "error", "type": type(e).__name__, "error": str(e)}
        out.append({"key": c["key"], "n": c["n"], "outcome": outcome})
    return out


def settle(statements, fn, rounds=5, **kw):
    table, result = [], replay(spec(statements, **kw))
    for _ in range(rounds):
        if not result["calls"]:
            return result
        table += answer(result["calls"], fn)
        result = replay(spec(statements, table, **kw))
    raise AssertionError("did not settle")


def test_a_loop_shows_all_its_calls_at_once():
    plan = replay(spec(["for i in range(50):\n    assert candidate(i) == i * i"]))
    assert [c["args"] for c in plan["calls"]] == [[i] for i in range(50)]
    assert plan["cases"] == [{"status": "pending", "error": ""}]


def test_verdicts_come_from_the_recorded_values():
    statements = ["assert candidate(2) == 4", "assert candidate(3) == 9", "assert abs(candidate(0.5) - 0.25) < 1e-9"]
    assert [c["status"] for c in settle(statements, lambda x: x * x)["cases"]] == ["pass"] * 3
    wrong = settle(statements, lambda x: x + 2)["cases"]
    assert [c["status"] for c in wrong] == ["pass", "fail", "fail"]


def test_nested_calls_take_another_round():
    plan = replay(spec(["assert candidate(candidate(3)) == 3"]))
    assert [c["args"] for c in plan["calls"]] == [[3]]  # the outer call waits for the inner result
    assert settle(["assert candidate(candidate(3)) == 3"], lambda x: -x)["cases"][0]["status"] == "pass"


def test_repeated_calls_are_told_apart_by_occurrence():
    counter = iter(range(10))
    result = settle(["assert [candidate() for _ in range(3)] == [0, 1, 2]"], lambda: next(counter))
    assert result["cases"][0]["status"] == "pass"


def test_exceptions_come_back_as_their_builtin_class():
    def f(x):
        if x < 0:
            raise ValueError("negative")
        return x
    statements = ["try:\n    candidate(-1)\n    assert False\nexcept ValueError:\n    pass",
                  "assert candidate(-2) == 0"]
    cases = settle(statements, f)["cases"]
    assert cases[0]["status"] == "pass" and cases[1] == {"status": "fail", "error": "ValueError: negative"}


def test_exits_and_lost_calls_fail_whatever_the_test_catches():
    key = '["f", [1], {"dict": []}]'
    table = [{"key": key, "n": 0, "outcome": {"status": "error", "type": "SystemExit", "error": "0"}}]
    catching = ["try:\n    assert candidate(1) == 1\nexcept BaseException:\n    pass"]
    assert replay(spec(catching, table))["cases"][0]["status"] == "fail"
    lost = [{"key": key, "n": 0, "outcome": {"status": "timeout", "error": "time limit"}}]
    assert replay(spec(catching, lost))["cases"][0] == {"status": "timeout", "error": "time limit"}


def test_arguments_changed_in_place_are_seen_by_the_test():
    def sort_in_place(xs):
        xs.sort()
    statements = ["xs = [3, 1, 2]", "candidate(xs)", "assert xs == [1, 2, 3]"]
    table = []
    result = replay(spec(statements))
    for c in result["calls"]:
        args = untag(c["args"])
        sort_in_place(*args)
        table.append({"key": c["key"], "n": c["n"],
                      "outcome": {"status": "ok", "value": None, "args_after": tag(args)}})
    assert replay(spec(statements, table))["cases"] == [{"status": "pass", "error": ""}]


def test_setup_failures_fail_the_cases_after_them():
    result = settle(["x = candidate(0)", "assert x == 1", "assert candidate(1) == 1"], lambda v: 1 // v)
    assert [c["status"] for c in result["cases"]] == ["fail", "fail"]
    assert "ZeroDivisionError" in result["cases"][0]["error"]


def test_prompt_helpers_and_untaken_imports_are_the_tests_own():
    support = "def double(x):\n    return 2 * x"
    statements = ["assert candidate(double(2)) == math.sqrt(16)"]
    result = settle(statements, lambda x: float(x), support=support, modules=["math"],
                    stubs={"candidate": "f", "math": "math"})
    assert result["cases"][0]["status"] == "pass"


def test_arguments_that_are_not_plain_fail_the_case():
    result = replay(spec(["assert candidate(lambda: 1) == 1"]))
    assert result["cases"][0]["status"] == "fail" and "only plain built-in values" in result["cases"][0]["error"]


def test_the_call_budget_leaves_cases_pending():
    result = replay(spec(["while True:\n    assert candidate(1)"], max_new_calls=20))
    assert len(result["calls"]) == 20 and result["cases"][0]["status"] == "pending"


def test_broken_test_code_is_reported_not_raised():
    assert "NameError" in replay(spec(["assert candidate(1)"], prelude="undefined_name"))["error"]


# --- the harness's view of the runner's lines -------------------------------------------------------------

@pytest.mark.parametrize("line, event", [
    (b'["loaded"]', ("loaded",)), (b'["case", 3]', ("case", 3)),
    (b'["call", 1, {"status": "ok", "value": 1}]', ("call", 1, {"status": "ok", "value": 1})),
    (b'["call", 9, {}]', None), (b'["call", -1, {}]', None), (b'[0, "pass", null]', None), (b"not json", None),
    (b'{"results": []}', None)])
def test_runner_lines_are_parsed_strictly(line, event):
    assert parse_event(line, n_calls=5) == event


# --- whole grades in a sandbox ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def grader(runner):
    sandbox = make_sandbox("bwrap", max_concurrency=4)
    yield Grader(sandbox, case_timeout_s=2.0, total_timeout_s=20.0)
    runner.run(sandbox.close())


def grade(runner, grader, code, tests):
    return runner.run(grader.grade(code, parse_tests(tests)))


def test_humaneval_helpers_come_from_the_prompt_not_the_solution(runner, grader):
    prompt = ("def poly(xs, x):\n    return sum(c * x ** i for i, c in enumerate(xs))\n\n"
              "def find_zero(xs):\n    '''...'''\n")
    tests = {"entry_point": "find_zero", "prompt": prompt,
             "test": "def check(candidate):\n    for xs in ([-1, 1], [-4, 0, 1]):\n"
                     "        assert abs(poly(xs, candidate(xs))) < 1e-6\n"}
    honest = prompt + "    lo, hi = -100.0, 100.0\n    for _ in range(200):\n        mid = (lo + hi) / 2\n" \
                      "        if poly(xs, lo) * poly(xs, mid) <= 0:\n            hi = mid\n        else:\n" \
                      "            lo = mid\n    return lo\n"
    assert grade(runner, grader, honest, tests).all_passed
    cheat = "def poly(xs, x):\n    return 0\n\ndef find_zero(xs):\n    return 0.0\n"
    assert grade(runner, grader, cheat, tests).passed == 0


def test_mbpp_tests_use_modules_the_solution_imported(runner, grader):
    tests = {"test_list": ["assert math.isclose(area(1), 3.14159, rel_tol=1e-3)", "assert area(0) == 0"]}
    result = grade(runner, grader, "import math\ndef area(r):\n    return math.pi * r * r", tests)
    assert result.all_passed, [c.to_dict() for c in result.cases]


def test_a_hanging_call_loses_its_case_only(runner, grader):
    tests = {"test": "def check(candidate):\n    assert candidate(1) == 1\n    assert candidate(2) == 2\n"
                     "    assert candidate(3) == 3\n", "entry_point": "f"}
    result = grade(runner, grader, "def f(x):\n    while x == 2:\n        pass\n    return x", tests)
    assert [c.status for c in result.cases] == ["pass", "timeout", "pass"]
    crash = grade(runner, grader, "import os\ndef f(x):\n    if x == 1:\n        os._exit(3)\n    return x", tests)
    assert [c.status for c in crash.cases] == ["crash", "pass", "pass"]


def test_calls_that_never_settle_are_not_run(runner):
    sandbox = make_sandbox("process")
    grader = Grader(sandbox, case_timeout_s=2.0, total_timeout_s=20.0, max_rounds=2)
    tests = {"test": "def check(candidate):\n    assert candidate(candidate(candidate(1))) == 1\n", "entry_point": "f"}
    result = runner.run(grader.grade("def f(x):\n    return x", parse_tests(tests)))
    assert result.cases[0].status == "not_run" and "did not settle in 2 rounds" in result.cases[0].error
    grader.max_rounds = 3
    assert runner.run(grader.grade("def f(x):\n    return x", parse_tests(tests))).all_passed


def test_a_solution_that_does_not_load_fails_every_case(runner, grader):
    tests = {"test_list": ["assert f(1) == 1", "assert f(2) == 2"]}
    result = grade(runner, grader, "def f(x):\n    return x\nraise SystemExit(0)", tests)
    assert [c.status for c in result.cases] == ["error", "error"]
    syntax = grade(runner, grader, "def f(x) return x", tests)
    assert syntax.passed == 0 and "SyntaxError" in syntax.cases[0].error


def test_leetcode_style_entry_points(runner, grader):
    tests = {"test": "def check(candidate):\n    assert candidate([2, 7, 11], 9) == [0, 1]\n",
             "entry_point": "Solution().twoSum"}
    code = "class Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n" \
           "        for i, x in enumerate(nums):\n" \
           "            if target - x in seen:\n                return [seen[target - x], i]\n            seen[x] = i\n"
    assert grade(runner, grader, code, tests).all_passed


def test_checks_and_replay_agree_on_every_humaneval_case(runner, monkeypatch):
    """The two assert paths are the same judge: every HumanEval problem's canonical solution and a broken
    one (`return None`), graded case by case through the grader's own checks and through the replay."""
    from slime_env.envs.code import grader as grader_module
    from slime_env.envs.code import load_humaneval

    tasks = load_humaneval()
    sandbox = make_sandbox("process", max_concurrency=4)

    async def grade_all(grader):
        submissions = [(t.metadata["prompt_code"] + body, parse_tests(t.label)) for t in tasks
                       for body in (t.metadata["canonical_solution"], "    return None\n")]
        results = await asyncio.gather(*(grader.grade(code, suite) for code, suite in submissions))
        return [[c.passed for c in r.cases] for r in results]

    # No case here hangs (canonical solutions pass, `return None` fails at once): the limits only have to be out of
    # reach of a busy machine, where 3 s cut a slow case on one path and not the other.
    checked = runner.run(grade_all(Grader(sandbox, case_timeout_s=60.0, total_timeout_s=300.0)))
    monkeypatch.setattr(grader_module.checks, "split", lambda suite: None)  # every suite through the replay
    replayed = runner.run(grade_all(Grader(sandbox, case_timeout_s=60.0, total_timeout_s=300.0)))
    runner.run(sandbox.close())
    # the differing submissions by index (pytest's own diff of two 328-item nested lists runs for minutes)
    differ = [(i, tasks[i // 2].metadata.get("task_id", i // 2), c, r)
              for i, (c, r) in enumerate(zip(checked, replayed)) if c != r]
    assert len(replayed) == len(checked) and not differ, differ[:5]
    assert sum(map(all, checked[0::2])) == len(tasks) and not any(map(all, checked[1::2]))
