"""How a SWE task's tests are run and graded: one file, standard library only, so that the reward
(`slime_env.envs.swe.reward`) imports it and every task folder carries a verbatim copy as `tests/grade.py` (what
the task's `tests/test.sh` runs when Harbor itself verifies the task).

- `pytest_argv(targets, deselect, junit)`: the one pytest command line (no cache, xunit1 JUnit XML with files);
- `parse_junit(xml)`: outcome and message per pytest node id;
- `grade(outcomes, fail_to_pass, pass_to_pass)`: resolved iff every FAIL_TO_PASS and PASS_TO_PASS test passed (a
  test missing from the report failed);
- `tampered(repo, protected)`: what an agent changed of the tests, their configuration and the startup hooks;
- `python grade.py --spec spec.json`: Harbor's shared-mode verifier — refuse a tampered suite, restore the hidden
  tests into the repository, run the tests, write `reward.txt` and `verdict.json` to /logs/verifier. (Shared mode
  trusts the agent's container — its Python, its pytest; slime_env's reward runs on a clean copy instead.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

PASSED, FAILED, ERROR, SKIPPED, MISSING = "passed", "failed", "error", "skipped", "missing"
MESSAGE_CHARS = 2000
# The environment of every pytest run: string hashing fixed (set orders and messages stay the same run to run).
PYTEST_ENV = {"PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1", "HOME": "/tmp"}


def pytest_argv(targets, deselect=(), junit="/tmp/junit.xml", python="python", tb="short"):
    """The pytest command of every run (validation, reward, Harbor's test.sh): `targets` are paths or node ids;
    `tb="locals"`: long tracebacks with each frame's local variables (the build's statements read them)."""
    traceback = ["--tb=long", "--showlocals"] if tb == "locals" else ["--tb=" + tb]
    argv = [python, "-m", "pytest", "-p", "no:cacheprovider", "-o", "junit_family=xunit1", "-o", "addopts=",
            "--junitxml=" + junit, "-q", *traceback, "-rN", "--color=no"]
    for node in deselect:
        argv += ["--deselect", node]
    return argv + list(targets)


def _dotted(path):
    return re.sub(r"\.py$", "", path.replace("/", "."))


def node_id(file, classname, name, files=()):
    """A pytest node id from an xunit1 <testcase>. pytest writes classname = the node id's path, dotted, and file =
    where the test function is defined, which for a test inherited from a mixin is another file: so the test
    files of the suite (`files`) are matched first, the longest dotted path that prefixes classname winning."""
    for candidate in sorted(files, key=len, reverse=True):
        module = _dotted(candidate)
        if classname == module or classname.startswith(module + "."):
            rest = classname[len(module) + 1:]
            return "::".join([candidate, *(rest.split(".") if rest else []), name])
    if not file:
        return f"{classname}::{name}" if classname else name
    module = _dotted(file)
    if classname == module:
        rest = []
    elif classname.startswith(module + "."):
        rest = classname[len(module) + 1:].split(".")
    else:
        return f"{classname}::{name}" if classname else f"{file}::{name}"
    return "::".join([file, *rest, name])


def parse_junit(data, files=()):
    """{node id: (outcome, message)} of a pytest JUnit XML report (xunit1); `files`: the suite's test files (see
    `node_id`). A test reported twice (an error in its teardown) keeps its worst outcome."""
    root = ET.fromstring(data)
    files = sorted(set(files))
    out = {}
    rank = {PASSED: 0, SKIPPED: 1, FAILED: 2, ERROR: 3}
    for case in root.iter("testcase"):
        nid = node_id(case.get("file", ""), case.get("classname", ""), case.get("name", ""), files)
        outcome, message = PASSED, ""
        for child in case:
            tag = child.tag
            if tag in ("failure", "error", "skipped"):
                outcome = {"failure": FAILED, "error": ERROR, "skipped": SKIPPED}[tag]
                message = (child.get("message") or "")[:MESSAGE_CHARS]
                break
        if nid not in out or rank[outcome] > rank[out[nid][0]]:
            out[nid] = (outcome, message)
    return out


def failure_texts(data, files=()):
    """{node id: the traceback text} of the failed and errored tests of a JUnit report."""
    out = {}
    for case in ET.fromstring(data).iter("testcase"):
        for child in case:
            if child.tag in ("failure", "error") and child.text:
                nid = node_id(case.get("file", ""), case.get("classname", ""), case.get("name", ""), sorted(files))
                out.setdefault(nid, child.text)
    return out


def test_files(node_ids):
    """The test files named by node ids."""
    return sorted({n.split("::", 1)[0] for n in node_ids if n.split("::", 1)[0].endswith(".py")})


def grade(outcomes, fail_to_pass, pass_to_pass):
    """The verdict of one run: {"resolved", "reason", "fail_to_pass": {id: outcome}, "pass_to_pass_failed": {id:
    outcome}}. Resolved iff every listed test passed; a test absent from `outcomes` is `missing` (failed)."""
    f2p = {t: outcomes.get(t, (MISSING, ""))[0] for t in fail_to_pass}
    p2p_bad = {t: outcomes.get(t, (MISSING, ""))[0] for t in pass_to_pass
               if outcomes.get(t, (MISSING, ""))[0] != PASSED}
    f2p_bad = [t for t, o in f2p.items() if o != PASSED]
    reasons = []
    if f2p_bad:
        first = f2p_bad[0]
        msg = outcomes.get(first, (MISSING, ""))[1].splitlines()[:1]
        reasons.append(f"{len(f2p_bad)} of {len(f2p)} FAIL_TO_PASS tests did not pass ({first}: {f2p[first]}"
                       + (f": {msg[0][:200]}" if msg else "") + ")")
    if p2p_bad:
        first = next(iter(p2p_bad))
        reasons.append(f"{len(p2p_bad)} of {len(pass_to_pass)} PASS_TO_PASS tests did not pass "
                       f"({first}: {p2p_bad[first]})")
    return {"resolved": not reasons, "reason": "; ".join(reasons) or "every FAIL_TO_PASS and PASS_TO_PASS test passed",
            "fail_to_pass": f2p, "pass_to_pass_failed": p2p_bad}


def tampered(repo, protected):
    """What differs from the protected files (path -> sha256: the visible tests, test configuration, non-code
    files of the package) under `repo`, and any conftest.py, *.pth or site/usercustomize.py added there."""
    problems = []
    for rel, digest in sorted(protected.items()):
        try:
            with open(os.path.join(repo, rel), "rb") as f:
                data = f.read()
        except OSError:
            problems.append("deletes " + rel)
            continue
        if hashlib.sha256(data).hexdigest() != digest:
            problems.append("changes " + rel)
    for dirpath, dirnames, filenames in os.walk(repo):
        dirnames[:] = sorted(d for d in dirnames if d not in (".git", "__pycache__"))
        for name in sorted(filenames):
            rel = os.path.relpath(os.path.join(dirpath, name), repo)
            hook = name in ("conftest.py", "sitecustomize.py", "usercustomize.py") or name.endswith(".pth")
            if hook and rel not in protected:
                problems.append("adds " + rel)
    return problems


def main(argv=None):
    """Harbor's verifier (shared mode): runs in the task's own container after the agent, from tests/test.sh."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="/tests/spec.json")
    ap.add_argument("--repo", default="/repo")
    ap.add_argument("--out", default="/logs/verifier")
    ap.add_argument("--timeout", type=float, default=None)
    args = ap.parse_args(argv)
    spec = json.load(open(args.spec))
    os.makedirs(args.out, exist_ok=True)
    reward, verdict = 0, {"resolved": False, "reason": "the tests did not run"}
    try:
        problems = tampered(args.repo, spec.get("protected", {}))
        if problems:
            raise RuntimeError("the agent changed the test suite: " + "; ".join(problems[:5]))
        hidden = os.path.join(os.path.dirname(os.path.abspath(args.spec)), "hidden")
        for rel in spec["hidden_tests"]:
            target = os.path.join(args.repo, rel)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copyfile(os.path.join(hidden, rel), target)
        junit = os.path.join(args.out, "junit.xml")
        if os.path.exists(junit):
            os.remove(junit)
        argv_ = pytest_argv(spec["test_paths"], spec["deselect"], junit, python=sys.executable)
        with open(os.path.join(args.out, "pytest.txt"), "w") as log:
            proc = subprocess.run(argv_, cwd=args.repo, stdout=log, stderr=subprocess.STDOUT,
                                  env={**os.environ, **PYTEST_ENV},
                                  timeout=args.timeout or spec.get("timeout_sec", 600))
        with open(junit, "rb") as f:
            outcomes = parse_junit(f.read(), test_files(spec["fail_to_pass"] + spec["pass_to_pass"]))
        verdict = grade(outcomes, spec["fail_to_pass"], spec["pass_to_pass"])
        reward = int(verdict["resolved"] and proc.returncode == 0)
    except Exception as e:  # noqa: BLE001 - any failure is reward 0, with its reason
        verdict = {"resolved": False, "reason": f"{type(e).__name__}: {e}"}
    with open(os.path.join(args.out, "verdict.json"), "w") as f:
        json.dump(verdict, f, indent=1)
    with open(os.path.join(args.out, "reward.txt"), "w") as f:
        f.write(f"{reward}\n")
    print(f"reward {reward}: {verdict['reason']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
