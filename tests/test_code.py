"""Code-v0: test formats, grading in a real sandbox (bubblewrap), all 164 HumanEval canonical solutions,
broken variants, stdin/stdout and call-based round trips, reward hacks, multi-turn feedback and tool mode."""

from __future__ import annotations

import asyncio
import base64
import json
import pickle
import zlib

import pytest
from slime_env.envs.code import Grader, load_code_tasks, load_humaneval, parse_tests

import slime_env
from slime_env import ScriptedPolicy, get_renderer, run_episode
from slime_env.errors import InvalidInput
from sandbox_support import make_sandbox


@pytest.fixture(scope="module")
def sandbox(runner):
    sb = make_sandbox("bwrap", max_concurrency=4)
    yield sb
    runner.run(sb.close())


@pytest.fixture(scope="module")
def grader(sandbox):
    return Grader(sandbox, case_timeout_s=2.0, total_timeout_s=20.0)


APPS_STDIO = {"input_output": json.dumps({"inputs": ["1 2\n", "10 -3\n", "5 5\n"], "outputs": ["3\n", "7\n", "10\n"]})}
APPS_CALL = {"input_output": json.dumps({"inputs": [[[3, 1, 2]], [[5, 4]], [[]]], "outputs": [[[1, 2, 3]], [4, 5], []],
                                         "fn_name": "sort_list"})}


def grade(runner, grader, code, tests):
    return runner.run(grader.grade(code, parse_tests(tests)))


# --- formats ---------------------------------------------------------------------------------------------

def test_formats_normalise():
    assert parse_tests(APPS_STDIO).kind == "stdio" and len(parse_tests(APPS_STDIO)) == 3
    call = parse_tests(APPS_CALL)
    assert call.kind == "call" and call.fn_name == "sort_list" and call.inputs[0] == [[3, 1, 2]]
    cc = parse_tests({"public_tests": {"input": ["1\n"], "output": ["2\n"]},
                      "private_tests": {"input": ["2\n", "3\n"], "output": ["3\n", "4\n"]}, "generated_tests": None})
    assert cc.kind == "stdio" and cc.public == [True, False, False]
    private = base64.b64encode(zlib.compress(pickle.dumps(json.dumps(
        [{"input": "[1, 2]\n3", "output": "6", "testtype": "functional"}])))).decode()
    lcb = parse_tests({"public_test_cases": json.dumps([{"input": "[1]\n2", "output": "3", "testtype": "functional"}]),
                       "private_test_cases": private, "metadata": json.dumps({"func_name": "f"})})
    assert (lcb.kind == "call" and lcb.inputs == [[[1], 2], [[1, 2], 3]] and lcb.outputs == [3, 6]
            and lcb.public == [True, False])
    mbpp = parse_tests({"test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"], "test_setup_code": ""})
    assert mbpp.kind == "assert" and len(mbpp) == 2 and mbpp.stubs == {"add": "add"}
    he = parse_tests({"test": "X = 1\n\ndef check(candidate):\n    import math\n    assert candidate(1) == 2\n"
                              "    for i in range(3):\n        assert candidate(i) == i + 1\n", "entry_point": "inc"})
    assert he.kind == "assert" and len(he) == 2 and he.prelude == "X = 1" and he.statements[0] == ("import math", False)
    generic = parse_tests([{"input": "a\n", "output": "A\n"}])
    assert generic.kind == "stdio" and len(generic) == 1


@pytest.mark.parametrize("bad, message", [
    ({"input_output": "{not json"}, "not valid JSON"),
    ({"input_output": {"inputs": ["1"], "outputs": []}}, "1 inputs but 0 outputs"),
    ({"test": "def check(candidate):\n    pass\n", "entry_point": "f"}, "has no assert"),
    ({"test": "def check(candidate):\n    assert candidate(1) == 2\n"}, "need 'entry_point'"),
    ({"test_list": ["assert f(1) =="]}, r"test_list\[0\]: does not parse"),
    ({"whatever": 1}, "no known test format"),
    ({"public_test_cases": "[]", "private_test_cases": "!!notbase64"}, "cannot decode"),
])
def test_malformed_tests_are_named(bad, message):
    with pytest.raises(InvalidInput, match=message):
        parse_tests(bad, "task.label")


# --- grading ---------------------------------------------------------------------------------------------

def test_all_humaneval_canonical_solutions_pass_and_broken_ones_fail(runner, grader):
    tasks = load_humaneval()
    assert len(tasks) == 164

    async def main(make_code):
        return await asyncio.gather(*(grader.grade(make_code(t), parse_tests(t.label)) for t in tasks))

    good = runner.run(main(lambda t: t.metadata["prompt_code"] + t.metadata["canonical_solution"]))
    failing = [(t.id, g.passed, g.total, g.reason) for t, g in zip(tasks, good) if not g.all_passed]
    assert not failing, failing
    broken = runner.run(main(lambda t: t.metadata["prompt_code"] + "    return None\n"))
    assert all(not g.all_passed for g in broken)
    assert sum(g.passed for g in broken) < sum(g.total for g in broken) // 4


def test_stdio_round_trip(runner, grader):
    ok = grade(runner, grader, "a, b = map(int, input().split())\nprint(a + b)", APPS_STDIO)
    assert ok.all_passed and ok.pass_rate == 1.0
    spaced = grade(runner, grader, "a, b = map(int, input().split())\nprint(a + b, end='  \\n\\n')", APPS_STDIO)
    assert spaced.all_passed  # trailing whitespace and blank lines are tolerated
    wrong = grade(runner, grader, "a, b = map(int, input().split())\nprint(a - b)", APPS_STDIO)
    assert wrong.passed == 0 and wrong.cases[0].status == "wrong_answer" and wrong.cases[0].got == "-1\n"
    floats = {"tests": [{"input": "", "output": "0.3333333\n"}]}
    assert not grade(runner, grader, "print(1/3)", floats).all_passed
    tolerant = Grader(grader.sandbox, float_tol=1e-6)
    assert runner.run(tolerant.grade("print(1/3)", parse_tests(floats))).all_passed


def test_call_based_round_trip(runner, grader):
    ok = grade(runner, grader, "def sort_list(xs):\n    return sorted(xs)", APPS_CALL)
    assert ok.all_passed, ok
    leetcode = grade(runner, grader, "class Solution:\n    def sort_list(self, xs):\n        return sorted(xs)",
                     APPS_CALL)
    assert leetcode.all_passed
    tuples = grade(runner, grader, "def sort_list(xs):\n    return tuple(sorted(xs))", APPS_CALL)
    assert tuples.all_passed  # a tuple equals the expected list
    wrong = grade(runner, grader, "def sort_list(xs):\n    return xs", APPS_CALL)
    assert wrong.passed == 1 and wrong.cases[0].status == "wrong_answer"
    missing = grade(runner, grader, "def other(xs):\n    return xs", APPS_CALL)
    assert missing.passed == 0 and "no function 'sort_list'" in missing.cases[0].error


def test_one_hanging_case_does_not_sink_the_others(runner, grader):
    code = "def sort_list(xs):\n    while not xs: pass\n    return sorted(xs)"
    result = grade(runner, grader, code, APPS_CALL)
    assert result.passed == 2 and result.cases[2].status == "timeout"
    stdio = grade(runner, grader, "a, b = map(int, input().split())\nwhile a == 10: pass\nprint(a + b)", APPS_STDIO)
    assert stdio.passed == 2 and stdio.cases[1].status == "timeout"


HE_TESTS = {"test": "def check(candidate):\n    assert candidate(2) == 4\n    assert candidate(3) == 9\n"
                    "    assert abs(candidate(0.5) - 0.25) < 1e-9\n", "entry_point": "square"}


@pytest.mark.parametrize("name, code", [
    ("raises", "def square(x):\n    raise ValueError('no')"),
    ("sys.exit(0) before the tests", "import sys\nsys.exit(0)\ndef square(x):\n    return x * x"),
    ("os._exit(0) before the tests", "import os\nos._exit(0)\ndef square(x):\n    return x * x"),
    ("exit() inside the function", "def square(x):\n    exit(0)"),
    ("os._exit(0) inside the function", "import os\ndef square(x):\n    os._exit(0)"),
    ("always-equal object", "class Eq:\n    def __eq__(self, o): return True\n    def __sub__(self, o): return 0\n"
                            "def square(x):\n    return Eq()"),
    ("subclass of int that equals anything", "class I(int):\n    def __eq__(self, o): return True\n"
                                             "    def __sub__(self, o): return 0\ndef square(x):\n    return I(0)"),
    ("patched builtins", "import builtins\nbuiltins.abs = lambda v: 0\ndef square(x):\n    builtins.abs = lambda v: 0\n"
                         "    return 0"),
    ("signals ignored, then hangs", "import signal\nfor s in (signal.SIGALRM, signal.SIGTERM):\n"
                                    "    signal.signal(s, signal.SIG_IGN)\ndef square(x):\n    while True: pass"),
])
def test_reward_hacks_earn_nothing(runner, grader, name, code):
    result = grade(runner, grader, code, HE_TESTS)
    assert result.passed == 0, (name, [c.to_dict() for c in result.cases])


def test_hardcoding_one_output_earns_only_that_case(runner, grader):
    result = grade(runner, grader, "print(3)", APPS_STDIO)  # the first case's answer, computed for none
    assert result.passed == 1 and result.pass_rate == pytest.approx(1 / 3)


def test_expected_outputs_never_enter_the_sandbox(runner, grader):
    marker = "EXPECTED-7f3a9c"
    tests = {"tests": [{"input": "x\n", "output": marker + "\n"}]}
    snoop = ("import os\nfound = []\nfor root in ('/work', '/tmp', '.'):\n    for d, _, fs in os.walk(root):\n"
             "        for f in fs:\n            try:\n"
             "                t = open(os.path.join(d, f), errors='ignore').read()\n"
             "            except OSError:\n                continue\n"
             # the needle is built at run time, so this source file itself never contains it
             f"            i = t.find('{marker[::-1]}'[::-1])\n            if i >= 0: found.append(t[i:i + 15])\n"
             "print(found[0] if found else 'nothing')")
    result = grade(runner, grader, snoop, tests)
    assert result.passed == 0 and result.cases[0].got.strip() == "nothing"


def test_a_sandbox_failure_fails_every_case_with_the_reason(runner):
    from slime_env.tools_sandbox.remote import RemoteSandbox

    broken = Grader(RemoteSandbox("http://127.0.0.1:9", max_retries=0))
    result = runner.run(broken.grade("print(1)", parse_tests(APPS_STDIO)))
    runner.run(broken.sandbox.close())
    assert result.status == "sandbox_error" and result.passed == 0 and "connection failed" in result.reason


# --- the env ---------------------------------------------------------------------------------------------

def test_multi_turn_feedback_then_fix(runner, smollm2_tok, sandbox):
    env = slime_env.make("Code-v0", max_attempts=3, sandbox=sandbox, case_timeout_s=2.0)
    wrong = "```python\na, b = map(int, input().split())\nprint(a * b)\n```"
    fixed = "Fixed:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    traj = runner.run(run_episode(env, ScriptedPolicy(smollm2_tok, [wrong, fixed]),
                                  {"prompt": "Read two integers, print their sum.", "label": APPS_STDIO},
                                  renderer=get_renderer(smollm2_tok, strict=True), max_turns=4))
    assert traj.status == "completed" and traj.reward == 1.0 and traj.num_turns == 2
    assert traj.turn_rewards == [0.0, 1.0]
    feedback = [m.content for m in traj.messages if m.role == "user"][-1]
    assert "passed 0 of 3 tests" in feedback and "Expected:\n3" in feedback and "Got:\n2" in feedback
    inserted = smollm2_tok.decode([t for t, m in zip(traj.response_ids, traj.loss_mask) if m == 0])
    assert "passed 0 of 3 tests" in inserted  # the feedback is in the ledger, masked
    generated = smollm2_tok.decode([t for t, m in zip(traj.response_ids, traj.loss_mask) if m == 1])
    assert "passed 0 of 3" not in generated
    assert traj.info["tests"]["pass_rate"] == 1.0
    traj.check()


def test_attempts_run_out_with_last_or_best_reward(runner, smollm2_tok, sandbox):
    half = "```python\na, b = map(int, input().split())\nprint(a + b if a < 6 else 0)\n```"  # passes 2 of 3
    none = "```python\nprint(0)\n```"
    for final, want in (("last", 0.0), ("best", 2 / 3)):
        env = slime_env.make("Code-v0", max_attempts=2, final_reward=final, sandbox=sandbox)
        traj = runner.run(run_episode(env, ScriptedPolicy(smollm2_tok, [half, none]),
                                      {"prompt": "sum", "label": APPS_STDIO},
                                      renderer=get_renderer(smollm2_tok), max_turns=4))
        assert traj.status == "completed" and traj.reward == pytest.approx(want)
    strict = slime_env.make("Code-v0", reward="all_or_nothing", sandbox=sandbox)
    traj = runner.run(run_episode(strict, ScriptedPolicy(smollm2_tok, [half]), {"prompt": "sum", "label": APPS_STDIO},
                                  renderer=get_renderer(smollm2_tok)))
    assert traj.reward == 0.0 and traj.info["pass_rate"] == pytest.approx(2 / 3)


def test_tool_mode_run_code_then_submit(runner, smollm2_tok, sandbox):
    env = slime_env.make("Code-v0", mode="tool", sandbox=sandbox)
    scratch = '<tool_call>{"name": "run_code", "arguments": {"code": "print(sorted([3, 1, 2]))"}}</tool_call>'
    submit = ('<tool_call>{"name": "submit_solution", "arguments": '
              '{"code": "def sort_list(xs):\\n    return sorted(xs)"}}</tool_call>')
    traj = runner.run(run_episode(env, ScriptedPolicy(smollm2_tok, [scratch, submit]),
                                  {"prompt": "Write sort_list(xs).", "label": APPS_CALL},
                                  renderer=get_renderer(smollm2_tok, strict=True), max_turns=4))
    assert traj.status == "completed" and traj.reward == 1.0 and traj.num_turns == 2
    assert [m.content for m in traj.messages if m.role == "tool"] == ["[1, 2, 3]"]
    traj.check()


def test_loader_reads_dataset_rows(tmp_path):
    rows = [{"question": "Sum two ints.", "input_output": APPS_STDIO["input_output"], "starter_code": ""},
            {"description": "Echo.", "public_tests": {"input": ["a\n"], "output": ["a\n"]}},
            {"text": "Add.", "test_list": ["assert add(1, 2) == 3"], "task_id": 7},
            {"prompt": "def f(): ...", "test": HE_TESTS["test"], "entry_point": "square", "task_id": "HumanEval/x"}]
    path = tmp_path / "code.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    tasks = load_code_tasks(path)
    assert [parse_tests(t.label).kind for t in tasks] == ["stdio", "stdio", "assert", "assert"]
    assert "assert add(1, 2) == 3" in tasks[2].prompt and tasks[3].id == "HumanEval/x"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"question": "x", "input_output": "{oops"}) + "\n")
    with pytest.raises(InvalidInput, match=r"bad\.jsonl:2 tests\.input_output: not valid JSON"):
        load_code_tasks(bad)
