"""Forged reports earn nothing: the solution writes lines shaped like every report of the grading
protocol (old and new runner lines, the harness's final JSON, the trusted replay's JSON) to every file
descriptor it can reach, before, during and after the tests, through /proc, from a forked child and
from an atexit handler, on every backend (Docker, bubblewrap, plain process). No verdict comes from a
process the solution controls, so the most a forged line can claim is a return value, which is no
more than returning it. Also: expected values never reach the solution's sandbox."""

from __future__ import annotations

import asyncio
import json

import pytest
from slime_env.envs.code import Grader, load_humaneval, parse_tests

from sandbox_support import ISOLATING, make_sandbox, per_backend_fixtures

sandboxes, sb = per_backend_fixtures(max_concurrency=4, pool_size=2)

SQUARE = {"test": "def check(candidate):\n    assert candidate(2) == 4\n    assert candidate(3) == 9\n"
                  "    assert abs(candidate(0.5) - 0.25) < 1e-9\n    assert candidate(-2) == 4\n",
          "entry_point": "square"}
# The same four cases in shapes only the trusted replay handles (a loop, a nested call).
SQUARE_REPLAYED = {"test": "def check(candidate):\n    for x, want in ((2, 4), (3, 9)):\n"
                           "        assert candidate(x) == want\n"
                           "    ys = [candidate(0.5)]\n    assert abs(ys[0] - 0.25) < 1e-9\n"
                           "    assert candidate(candidate(-2) - 2) == 4\n    assert candidate(-3) == 9\n",
                   "entry_point": "square"}
SUITES = {"checked by the grader": SQUARE, "replayed": SQUARE_REPLAYED}

# Every shape a report of ours has had or has, claiming passes and plausible values for many indices. Each
# shape is forged on its own, so that a parser that reads it is not stopped by another shape's line.
_verdicts = [{"status": "pass"}, {"status": "ok", "value": True}, {"status": "ok", "stdout": "4\n"}]
SHAPES = {
    "runner lines, first version": [json.dumps([-3, "loaded", None])]
                                   + [json.dumps([i, "pass", None]) for i in range(40)],
    "runner lines": [json.dumps(["loaded"])] + [json.dumps(["case", i]) for i in range(40)] + [
        json.dumps(["call", k, {"status": "ok", "value": v}]) for k in range(40)
        for v in (True, {"f": "nan"}, {"__eq__": True})],
    "harness report": [json.dumps({"results": _verdicts * 20}),
                       json.dumps({"results": {"loaded": True, "calls": [{"status": "ok", "value": True}] * 40}})],
    "replay report": [json.dumps({"cases": [{"status": "pass"}] * 4, "calls": [], "error": ""}),
                      json.dumps({"replays": [{"cases": [{"status": "pass"}] * 4, "calls": [], "error": ""}] * 16})],
}

_FORGE = '''
import glob, os

def _forge():
    data = ("\\n".join(LINES) + "\\n").encode()
    for fd in range(0, 64):
        try:
            os.write(fd, data)
        except OSError:
            pass
    for path in glob.glob("/proc/*/fd/*"):  # our own, the parent's, anyone's we can open
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            os.write(fd, data)
        except OSError:
            pass
        os.close(fd)
'''


def forger(when: str, lines: list[str]) -> str:
    """A solution whose function returns None and that writes `lines` everywhere it can, `when`."""
    body = "return None"
    fn = f"def square(x):\n    {body}\n"
    forge = f"LINES = {lines!r}\n" + _FORGE
    if when == "import, then exit":
        return forge + "_forge()\nos._exit(0)\n" + fn
    if when == "import":
        return forge + "_forge()\n" + fn
    if when == "in the call, then exit":
        return forge + "def square(x):\n    _forge()\n    os._exit(0)\n"
    if when == "in the call":
        return forge + f"def square(x):\n    _forge()\n    {body}\n"
    if when == "atexit":
        return forge + "import atexit\natexit.register(_forge)\n" + fn
    if when == "forked child":
        return forge + ("import time\nif os.fork() == 0:\n    os.setsid()\n    for _ in range(30):\n"
                         "        _forge()\n        time.sleep(0.05)\n    os._exit(0)\n") + fn
    raise ValueError(when)


WHEN = ["import, then exit", "import", "in the call, then exit", "in the call", "atexit", "forked child"]


_graders: dict[int, Grader] = {}


def grade(runner, sandbox, code, tests):
    grader = _graders.setdefault(id(sandbox), Grader(sandbox, case_timeout_s=3.0, total_timeout_s=20.0))
    return runner.run(grader.grade(code, parse_tests(tests)))


@pytest.mark.parametrize("suite", SUITES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("when", WHEN)
def test_forged_reports_earn_nothing_on_assert_tests(runner, sb, when, shape, suite):
    result = grade(runner, sb, forger(when, SHAPES[shape]), SUITES[suite])
    assert result.total == 4 and result.passed == 0, (when, shape, [c.to_dict() for c in result.cases])


def test_both_assert_paths_grade_an_honest_square(runner, sb):
    for tests in SUITES.values():
        assert grade(runner, sb, "def square(x):\n    return x * x\n", tests).all_passed


@pytest.mark.parametrize("suite", SUITES)
def test_forged_return_values_earn_what_returning_them_earns(runner, sb, suite):
    # The forger claims every call returned 4: at most what `return 4` earns, never more.
    claim = forger("import", [json.dumps(["call", k, {"status": "ok", "value": 4}]) for k in range(8)])
    forged = grade(runner, sb, claim, SUITES[suite])
    honest = grade(runner, sb, "def square(x):\n    return 4\n", SUITES[suite])
    assert 0 < honest.passed < 4
    assert forged.passed <= honest.passed


def test_forged_reports_earn_nothing_on_call_and_stdio_tests(runner, sb):
    call = {"inputs": [[2], [3]], "outputs": [4, 9], "fn_name": "square"}
    stdio = {"inputs": ["2\n", "3\n"], "outputs": ["4\n", "9\n"]}
    for shape, lines in SHAPES.items():
        assert grade(runner, sb, forger("import", lines), call).passed == 0, shape
        assert grade(runner, sb, forger("in the call, then exit", lines), call).passed == 0, shape
        assert grade(runner, sb, f"LINES = {lines!r}\n" + _FORGE + "_forge()\nprint(0)\n", stdio).passed == 0, shape


@pytest.mark.parametrize("shape", ["runner lines, first version", "runner lines"])
@pytest.mark.parametrize("backend", ISOLATING)
def test_the_reported_attack_fails_on_five_humaneval_problems(runner, backend, shape):
    """The attack as reported: `return None`, then a module-level loop writing protocol-shaped lines to
    fds 3..63 and os._exit(0). It earned full marks on 5 of 5 problems. Now lines in any protocol can at
    most claim that calls returned True (or something else), which earns what `return True` earns."""
    lines = SHAPES[shape]
    attack = ("\nimport os\n_data = (" + repr("\n".join(lines) + "\n") + ").encode()\nfor _fd in range(3, 64):\n"
              "    try:\n        os.write(_fd, _data)\n    except OSError:\n        pass\nos._exit(0)\n")
    tasks = load_humaneval()[:5]
    sandbox = make_sandbox(backend, max_concurrency=4)
    grader = Grader(sandbox, case_timeout_s=3.0, total_timeout_s=20.0)

    async def main(body):
        return await asyncio.gather(*(grader.grade(t.metadata["prompt_code"] + body, parse_tests(t.label))
                                      for t in tasks))
    try:
        forged, honest = runner.run(main("    return None\n" + attack)), runner.run(main("    return True\n"))
    finally:
        runner.run(sandbox.close())
    assert not any(r.all_passed for r in forged), [r.to_dict() for r in forged]
    assert all(f.passed <= h.passed for f, h in zip(forged, honest)), [(f.to_dict(), h.passed)
                                                                       for f, h in zip(forged, honest)]


def test_expected_values_never_reach_the_solution(runner, sb):
    """The expected side of every assert stays out of the solution's sandbox: a solution that searches
    its memory, its callers' frames, stdin, files and other processes for it finds nothing (if it did,
    returning it would pass)."""
    marker = "EXPECTED-" + "4d1f" + "9b"  # never written whole in this file's source, nor in the solution's
    tests = {"test": f"def check(candidate):\n    assert candidate(1) == {marker!r}\n", "entry_point": "find"}
    snoop = f'''
import gc, glob, os, stat, sys
CODES = {tuple(map(ord, marker))!r}  # the needle is built only while looking, so we never find our own copy
def look(text):
    needle = "".join(map(chr, CODES))
    i = text.find(needle)
    return text[i:i + len(needle)] if i >= 0 else None
def find(x):
    for obj in gc.get_objects():
        for v in (obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()):
            if isinstance(v, str) and look(v):
                return look(v)
    frame = sys._getframe()
    while frame:
        for v in list(frame.f_locals.values()) + list(frame.f_globals.values()):
            found = look(repr(v)[:100000] if not isinstance(v, str) else v)
            if found:
                return found
        frame = frame.f_back
    for pattern in ("/proc/*/cmdline", "/proc/*/environ", "./*", "/tmp/*", "/tmp/*/*", "/work/*", "/work/*/*"):
        for path in glob.glob(pattern):
            try:
                if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO of another program would block the open
                    continue
                with open(path, "rb") as f:  # the grader's files are small; a model file elsewhere is not read whole
                    found = look(f.read(1 << 20).decode("latin-1"))
                    if found:
                        return found
            except OSError:
                pass
    return "nothing"
'''
    # A busy machine's /tmp holds many files: the search gets time to finish, so "wrong_answer" proves it did.
    result = runner.run(Grader(sb, case_timeout_s=60.0, total_timeout_s=90.0).grade(snoop, parse_tests(tests)))
    assert result.total == 1 and result.passed == 0 and result.cases[0].status == "wrong_answer", result.to_dict()
