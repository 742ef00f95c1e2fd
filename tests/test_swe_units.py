"""slime_env.envs.swe without Docker: mutations, patches, grading, the guard, statements, task folders, manifest."""

from __future__ import annotations

import ast
import json
import tomllib

import pytest
from slime_env.envs.swe import grade
from slime_env.envs.swe.guard import code_problems, review
from slime_env.envs.swe.manifest import (RepoSpec, load_manifest, repo_dockerfile, repo_image_tag, repo_lines_of)
from slime_env.envs.swe.mutations import KINDS, find_mutations, plan
from slime_env.envs.swe.patches import PatchError, apply_patch, make_patch
from slime_env.envs.swe.statement import clean_message, subject_of, write_statement
from slime_env.envs.swe.task import SweTask, load_task, write_task
from slime_env.errors import InvalidInput

SOURCE = '''\
import operator


def window(seq, n=2, *, fill=False):
    """Sliding windows."""
    out = []
    for i in range(len(seq) - n + 1):
        out.append(tuple(seq[i:i + n]))
    if fill:
        out.append(seq[-n:])
    else:
        out = list(out)
    return out


def clamp(x, lo, hi):
    total = 0
    total += x
    if x < lo or x > hi:
        return max(lo, min(x, hi))
    return operator.sub(total, 0)


class Box:
    def __init__(self, items):
        self.items = list(items)

    def first(self):
        return self.items[0] if self.items != [] else None
'''


# --- mutations -----------------------------------------------------------------------------------------------
def test_every_kind_is_found_and_each_mutant_is_one_small_valid_edit():
    found = find_mutations("pkg/mod.py", SOURCE)
    assert {m.kind for m in found} == set(KINDS)
    for m in found:
        mutant = m.apply(SOURCE)
        assert ast.dump(ast.parse(mutant)) != ast.dump(ast.parse(SOURCE)), m
        changed = [line for line in make_patch("pkg/mod.py", SOURCE, mutant).splitlines()
                   if line[:1] in "+-" and not line.startswith(("+++", "---"))]
        limit = 16 if m.kind == "invert_if" else 2
        assert 1 <= len(changed) <= limit, (m, changed)
        assert m.function in {"window", "clamp", "Box.__init__", "Box.first"}


def test_mutation_kinds_make_the_edits_they_name():
    by = {}
    for m in find_mutations("m.py", SOURCE):
        by.setdefault(m.kind, []).append(m)
    descs = {k: [m.description for m in v] for k, v in by.items()}
    assert "`<` -> `<=`" in descs["flip_comparison"] and "`!=` -> `==`" in descs["flip_comparison"]
    assert any("default of `n`: `2` -> `1`" == d for d in descs["wrong_default"])
    assert any("default of `fill`: `False` -> `True`" == d for d in descs["wrong_default"])
    assert any(d.startswith("dropped `total += x`") for d in descs["drop_statement"])
    assert any("min(x, hi)" in d for d in descs["swap_arguments"]) is False  # min/max are symmetric: never swapped
    assert any("`sub(total, 0)` -> `sub(0, total)`" == d
               for d in descs["swap_arguments"])
    assert any(d == "`or` -> `and`" for d in descs["change_operator"])
    inv = by["invert_if"][0].apply(SOURCE)
    assert "    if fill:\n        out = list(out)\n    else:\n        out.append(seq[-n:])\n" in inv
    # the only statement of a block becomes `pass`
    only = [m for m in by["drop_statement"] if m.function == "Box.__init__"]
    assert only and "self.items = list(items)" not in only[0].apply(SOURCE) and "pass" in only[0].apply(SOURCE)


def test_off_by_one_covers_constants_slices_and_range():
    descs = [m.description for m in find_mutations("m.py", SOURCE) if m.kind == "off_by_one"]
    assert any(d.startswith("`1` -> ") for d in descs)
    assert any(d.startswith("`i + n` -> ") for d in descs)  # slice bound
    assert any(d.startswith("`len(seq) - n + 1` -> ") for d in descs)  # range argument


def test_mutations_skip_stubs_and_strings_and_are_deterministic():
    stub = 'def f(x):\n    """Doc."""\n    raise NotImplementedError\n\n\ndef g(s):\n    return "a" + s % 3\n'
    found = find_mutations("m.py", stub)
    assert all(m.function == "g" for m in found)
    assert not any(m.kind == "change_operator" and m.description.startswith("`+`") for m in found)
    assert find_mutations("m.py", SOURCE) == find_mutations("m.py", SOURCE)
    assert find_mutations("m.py", "def broken(:\n") == []


def test_plan_is_seeded_round_robin_with_a_per_function_cap():
    found = find_mutations("m.py", SOURCE)
    a, b, c = plan(found, seed=1), plan(found, seed=1), plan(found, seed=2)
    assert a == b and a != c
    per_fn = {}
    for m in a:
        per_fn[m.function] = per_fn.get(m.function, 0) + 1
    assert max(per_fn.values()) <= 2
    assert len({(m.function, m.kind) for m in a}) == len(a)
    assert len({m.kind for m in a[:4]}) == 4  # kinds take turns


# --- patches -------------------------------------------------------------------------------------------------
def test_patch_round_trip_reverse_and_strictness():
    mutant = find_mutations("pkg/mod.py", SOURCE)[3].apply(SOURCE)
    patch = make_patch("pkg/mod.py", SOURCE, mutant)
    assert patch.startswith("diff --git a/pkg/mod.py b/pkg/mod.py\n--- a/pkg/mod.py\n+++ b/pkg/mod.py\n@@ ")
    assert apply_patch({"pkg/mod.py": SOURCE}, patch) == {"pkg/mod.py": mutant}
    assert apply_patch({"pkg/mod.py": mutant}, patch, reverse=True) == {"pkg/mod.py": SOURCE}
    with pytest.raises(PatchError, match="does not apply"):
        apply_patch({"pkg/mod.py": SOURCE.replace("out = []", "out = [0]")}, patch)
    with pytest.raises(PatchError, match="not among the files"):
        apply_patch({"other.py": SOURCE}, patch)
    two = make_patch("a.py", "1\n2\n3\n4\n5\n6\n7\n8\n9\n10\n", "1\nX\n3\n4\n5\n6\n7\n8\nY\nZ\n10\n")
    assert apply_patch({"a.py": "1\n2\n3\n4\n5\n6\n7\n8\n9\n10\n"}, two)["a.py"] == "1\nX\n3\n4\n5\n6\n7\n8\nY\nZ\n10\n"
    assert apply_patch({"a.py": "1\nX\n3\n4\n5\n6\n7\n8\nY\nZ\n10\n"}, two, reverse=True)["a.py"].count("\n") == 10


# --- grading -------------------------------------------------------------------------------------------------
JUNIT = b"""<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_more.WindowedTests" name="test_basic" file="tests/test_more.py" line="3" time="0"/>
<testcase classname="tests.test_more" name="test_fn[1-2]" file="tests/test_more.py" line="9" time="0">
  <failure message="AssertionError: assert [1] == [2]">long text</failure></testcase>
<testcase classname="pkg.tests.test_x" name="test_err" file="pkg/tests/test_x.py" line="1" time="0">
  <error message="failed on setup with &quot;boom&quot;">x</error></testcase>
<testcase classname="pkg.tests.test_x" name="test_skip" file="pkg/tests/test_x.py" line="1" time="0">
  <skipped type="pytest.skip" message="no numpy">x</skipped></testcase>
<testcase classname="pkg.tests.test_x" name="test_teardown" file="pkg/tests/test_x.py" line="5" time="0"/>
<testcase classname="pkg.tests.test_x" name="test_teardown" file="pkg/tests/test_x.py" line="5" time="0">
  <error message="failed on teardown">x</error></testcase>
<testcase classname="tests.test_rr.RRCacheTest" name="test_clear" file="tests/__init__.py" line="5" time="0"/>
</testsuite></testsuites>"""


def test_junit_node_ids_outcomes_and_grading():
    out = grade.parse_junit(JUNIT)
    assert out["tests/test_more.py::WindowedTests::test_basic"] == ("passed", "")
    assert out["tests/test_more.py::test_fn[1-2]"] == ("failed", "AssertionError: assert [1] == [2]")
    assert out["pkg/tests/test_x.py::test_err"][0] == "error"
    assert out["pkg/tests/test_x.py::test_skip"][0] == "skipped"
    assert out["pkg/tests/test_x.py::test_teardown"][0] == "error"  # the worst of its two reports
    # a test inherited from a mixin: pytest's file attribute names the mixin's file, the node id the test's
    assert "tests/test_rr.py::RRCacheTest::test_clear" not in out
    files = grade.test_files(["tests/test_rr.py::RRCacheTest::test_x", "tests/__init__.py::t", "tests/test_more.py::a"])
    assert files == ["tests/__init__.py", "tests/test_more.py", "tests/test_rr.py"]
    fixed = grade.parse_junit(JUNIT, files)
    assert fixed["tests/test_rr.py::RRCacheTest::test_clear"] == ("passed", "")
    assert fixed["tests/test_more.py::WindowedTests::test_basic"] == ("passed", "")
    ok = grade.grade(out, ["tests/test_more.py::WindowedTests::test_basic"], [])
    assert ok["resolved"]
    bad = grade.grade(out, ["tests/test_more.py::test_fn[1-2]"], ["tests/test_more.py::gone"])
    assert not bad["resolved"] and "1 of 1 FAIL_TO_PASS" in bad["reason"] and "assert [1] == [2]" in bad["reason"]
    assert bad["pass_to_pass_failed"] == {"tests/test_more.py::gone": "missing"}


def test_pytest_argv_is_one_command_for_every_run():
    argv = grade.pytest_argv(["tests"], ["tests/a.py::slow"], "/tmp/j.xml")
    assert argv[:3] == ["python", "-m", "pytest"] and "--junitxml=/tmp/j.xml" in argv
    assert argv[argv.index("--deselect") + 1] == "tests/a.py::slow" and argv[-1] == "tests"
    assert "no:cacheprovider" in argv and "junit_family=xunit1" in argv


# --- the guard -----------------------------------------------------------------------------------------------
SPEC = RepoSpec(name="pkg", version="1", sdist_sha256="0" * 64, source_dir="pkg", test_paths=("tests",))
CLEAN = SOURCE
BUGGY = SOURCE.replace("if x < lo or x > hi:", "if x <= lo or x > hi:")


def tree(overrides=None):
    files = {"pkg/mod.py": BUGGY.encode(), "pkg/__init__.py": b"", "tests/test_mod.py": b"def test(): pass\n",
             "setup.cfg": b"[metadata]\n", "pkg/py.typed": b""}
    for path, v in (overrides or {}).items():
        if v is None:
            files.pop(path, None)
        else:
            files[path] = v
    return files


def run_review(agent, **kw):
    start = tree()
    clean = dict(start, **{"pkg/mod.py": CLEAN.encode()})
    return review(SPEC, start, agent, clean, **kw)


def test_the_oracle_and_an_equivalent_fix_are_accepted():
    r = run_review(tree({"pkg/mod.py": CLEAN.encode()}))
    assert r.accepted and r.changed == {"pkg/mod.py": CLEAN}
    # a fix in other words: a new local variable and a comment are fine
    other = BUGGY.replace("    if x <= lo or x > hi:\n", "    outside = x < lo or x > hi  # fixed\n    if outside:\n")
    assert run_review(tree({"pkg/mod.py": other.encode()})).accepted
    assert run_review(tree()).accepted and run_review(tree()).changed == {}


@pytest.mark.parametrize("agent,rule", [
    (tree({"tests/test_mod.py": b"def test(): assert True\n"}), "tests/test_mod.py: the tests"),
    (tree({"tests/test_mod.py": None}), "deletes tests/test_mod.py: the tests"),
    (tree({"conftest.py": b"import pytest\n"}), "adds conftest.py: the tests"),
    (tree({"pkg/conftest.py": b"x = 1\n"}), "adds pkg/conftest.py: the tests"),
    (tree({"setup.cfg": b"[tool:pytest]\naddopts = -p no:python\n"}), "changes setup.cfg: test and packaging"),
    (tree({"pytest.ini": b"[pytest]\n"}), "adds pytest.ini: test and packaging"),
    (tree({"sitecustomize.py": b"import os\n"}), "adds sitecustomize.py: an interpreter startup hook"),
    (tree({"pkg/evil.pth": b"import os\n"}), "adds pkg/evil.pth: an interpreter startup hook"),
    (tree({"pkg/helper.py": b"x = 1\n"}), "adds pkg/helper.py: a fix edits existing files only"),
    (tree({"pkg/__init__.py": None}), "deletes pkg/__init__.py"),
    (tree({"pkg/py.typed": b"partial\n"}), "changes pkg/py.typed: only existing .py files"),
    (tree({"pkg/mod.py": "link"}), "into a link"),
])
def test_the_guard_refuses_anything_but_source_edits(agent, rule):
    r = run_review(agent)
    assert not r.accepted and rule in r.reason, r.reason


def test_scratch_files_outside_the_rules_are_ignored_not_refused():
    r = run_review(tree({"reproduce.py": b"print(1)\n", "pkg/mod.py": CLEAN.encode()}), ignored=("reproduce.py",))
    assert r.accepted and r.ignored == ("reproduce.py",)


@pytest.mark.parametrize("patch,rule", [
    ("import sys\nsys.exit(0)\n", "uses `exit`"),
    ("import os\nos._exit(0)\n", "uses `_exit`"),
    ("import _pytest\n", "adds an import (import _pytest)"),
    ("from _pytest import reports\n", "adds an import"),
    ("exec('1')\n", "uses `exec`"),
    ("open('/tmp/junit.xml', 'w').write('x')\n", "uses `open`"),
    ("__builtins__['print']('x')\n", "uses `__builtins__`"),
    ("x = clamp.__globals__\n", "uses `__globals__`"),
    ("x = clamp.__class__\n", "uses `__class__` in <module> more often"),
    ("x = getattr(clamp, 'x' + 'y')\n", "uses reflection in <module>"),
    ("x = '{0.__doc__}'.format(clamp)\n", "writes `__doc__` in a string"),
    ("x = shutil.rmtree\n", "uses `shutil`, a name the original module does not use"),
    ("x = clamp.somewhere_new\n", "uses `somewhere_new`, a name the original module does not use"),
    ("def clamp(x:\n", "does not parse"),
])
def test_code_rule_refuses_what_forgeries_need(patch, rule):
    problems = code_problems(CLEAN, BUGGY, BUGGY + patch)
    assert any(rule in p for p in problems), problems


def test_reflection_and_dunders_may_only_come_back_as_the_original_wrote_them():
    clean = "def f(o, name):\n    return getattr(o, name, None), o.__class__\n"
    buggy = "def f(o, name):\n    return None, o.__class__\n"
    assert code_problems(clean, buggy, clean) == []  # the oracle restores the call
    other = "def f(o, name):\n    return getattr(o, '__dict__'), o.__class__\n"
    assert any("reflection" in p for p in code_problems(clean, buggy, other))
    moved = "def f(o, name):\n    return None, o.__class__\n\ndef g(o):\n    return getattr(o, name, None)\n"
    assert any("reflection in g" in p for p in code_problems(clean, buggy, moved))


# --- statements ----------------------------------------------------------------------------------------------
FAILURES = [("tests/test_more.py::WindowedTests::test_basic",
             "AssertionError: Lists differ: [(1, 2)] != [(1, 2), (2, 3)]\n  File more_itertools/more.py:812"),
            ("tests/test_more.py::test_windowed_step[2]", "TypeError: <function f at 0x7f3a2b1c4d50> failed")]


def test_statement_names_tests_and_messages_but_not_the_mutation():
    text = write_statement(name="more-itertools__off_by_one__windowed__1234", repo="more-itertools",
                           source_dir="more_itertools", failures=FAILURES, names={"windowed", "other"},
                           source_files=["more_itertools/more.py"])
    assert text == write_statement(name="more-itertools__off_by_one__windowed__1234", repo="more-itertools",
                                   source_dir="more_itertools", failures=FAILURES, names={"windowed", "other"},
                                   source_files=["more_itertools/more.py"])
    assert "`windowed`" in text and "WindowedTests::test_basic" in text and "Lists differ" in text
    assert "more_itertools/more.py" not in text and "812" not in text and "0x7f3a" not in text
    assert "off_by_one" not in text
    assert "`more_itertools/`" in text
    assert subject_of("toolz/tests/test_itertoolz.py::test_merge_sorted", {"merge_sorted"}) == "merge_sorted"
    assert subject_of("tests/test_lru.py::LRUCacheTest::test_lru", {"LRUCache"}) == "LRUCache"
    assert subject_of("tests/test_x.py::test_nothing_known", {"windowed"}) is None
    assert clean_message("x\n" * 50).count("\n") < 20
    templates = {write_statement(name=f"t{i}", repo="r", source_dir="r", failures=FAILURES, names=set())
                 .splitlines()[0] for i in range(20)}
    assert len(templates) == 3


# --- task folders and the manifest ---------------------------------------------------------------------------
def make_task(**kw) -> SweTask:
    spec = load_manifest()["toolz"]
    mutant = BUGGY
    fields = dict(name="toolz__flip_comparison__clamp__00000000", repo="toolz", version=spec.version,
                  sdist_sha256=spec.sdist_sha256, image=repo_image_tag(spec), repo_dockerfile=repo_dockerfile(spec),
                  source_dir="toolz", test_paths=spec.test_paths, deselect=(), fail_to_pass=("toolz/tests/t.py::a",),
                  pass_to_pass=tuple(f"toolz/tests/u.py::p{i}" for i in range(300)),
                  hidden_tests=("toolz/tests/t.py",), bug_patch=make_patch("toolz/m.py", CLEAN, mutant),
                  mutation={"kind": "flip_comparison", "file": "toolz/m.py", "line": 19, "function": "clamp",
                            "description": "`<` -> `<=`"},
                  instruction="# Fix it\n")
    fields.update(kw)
    return SweTask(**fields)


def test_task_folder_round_trip_is_a_harbor_task(tmp_path):
    task = make_task()
    root = write_task(tmp_path, task, {"toolz/tests/t.py": "def test_a(): pass\n"})
    assert load_task(root) == task
    config = tomllib.loads((root / "task.toml").read_text())
    assert config["version"] == "1.0" and config["metadata"]["category"] == "swe"
    assert config["environment"] == {"build_timeout_sec": 900.0, "cpus": 1.0, "memory_mb": 2048,
                                     "network_mode": "no-network", "workdir": "/repo"}
    assert config["verifier"]["timeout_sec"] > 0 and config["agent"]["timeout_sec"] > 0
    assert config["metadata"]["swe"]["pass_to_pass"]["count"] == 300
    for required in ("instruction.md", "environment/Dockerfile", "environment/bug.patch", "tests/test.sh",
                     "solution/solve.sh", "tests/grade.py", "tests/hidden/toolz/tests/t.py"):
        assert (root / required).is_file(), required
    dockerfile = (root / "environment" / "Dockerfile").read_text()
    assert dockerfile.startswith(repo_dockerfile(load_manifest()["toolz"]))
    assert "rm -f toolz/tests/t.py" in dockerfile and "rm -rf .git" in dockerfile
    assert task.bug_patch in (root / "solution" / "solve.sh").read_text()
    assert (root / "tests" / "test.sh").stat().st_mode & 0o111
    spec = json.loads((root / "tests" / "spec.json").read_text())
    assert spec["fail_to_pass"] == ["toolz/tests/t.py::a"] and len(spec["pass_to_pass"]) == 300
    # a pass_to_pass list edited behind task.toml's back is caught
    spec["pass_to_pass"] = spec["pass_to_pass"][1:]
    (root / "tests" / "spec.json").write_text(json.dumps(spec))
    with pytest.raises(InvalidInput, match="does not match"):
        load_task(root)


def test_load_task_names_what_is_wrong(tmp_path):
    (tmp_path / "task.toml").write_text('version = "1.0"\n[metadata]\ncategory = "x"\n')
    with pytest.raises(InvalidInput, match="no \\[metadata.swe\\]"):
        load_task(tmp_path)
    root = write_task(tmp_path, make_task(), {"toolz/tests/t.py": ""})
    (root / "environment" / "bug.patch").unlink()
    with pytest.raises(InvalidInput, match="missing"):
        load_task(root)


def test_shipped_manifest_is_pinned_and_renders_stable_dockerfiles(tmp_path):
    repos = load_manifest()
    assert len(repos) >= 3
    for spec in repos.values():
        text = repo_dockerfile(spec)
        assert text == repo_dockerfile(spec) and repo_image_tag(spec) == repo_image_tag(text)
        assert f"{spec.name}=={spec.version}" in text and spec.sdist_sha256 in text and "sha256sum -c" in text
        assert text.splitlines()[1] == "FROM python:3.11-slim" and repo_lines_of(text + "# --- task: x\n") == text
        assert all("==" in pin for pin in spec.pytest + spec.test_deps)
    assert repos["cachetools"].is_source_path("src/cachetools/keys.py")
    assert not repos["toolz"].is_source_path("toolz/tests/test_itertoolz.py")
    assert not repos["toolz"].is_source_path("toolz/sandbox/tests/test_core.py")
    bad = tmp_path / "repos.toml"
    bad.write_text('pytest = ["pytest>=8"]\n[[repo]]\nname = "x"\nversion = "1"\nsdist_sha256 = "' + "0" * 64
                   + '"\nsource_dir = "x"\ntest_dirs = ["tests"]\n')
    with pytest.raises(InvalidInput, match="not an exact pin"):
        load_manifest(bad)
    bad.write_text('[[repo]]\nname = "x"\n')
    with pytest.raises(InvalidInput, match="missing field 'version'"):
        load_manifest(bad)


def test_harbor_check_finds_a_tampered_suite(tmp_path):
    import hashlib

    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("def test(): pass\n")
    protected = {"tests/test_a.py": hashlib.sha256(b"def test(): pass\n").hexdigest()}
    assert grade.tampered(str(tmp_path), protected) == []
    (tmp_path / "tests" / "test_a.py").write_text("def test(): assert True\n")
    (tmp_path / "conftest.py").write_text("")
    (tmp_path / "x.pth").write_text("")
    assert grade.tampered(str(tmp_path), protected) == ["changes tests/test_a.py", "adds conftest.py", "adds x.pth"]


def test_task_image_tags_are_valid_docker_references():
    from slime_env.envs.swe.check import task_image_tag

    tag = task_image_tag(make_task(name="cachetools__change_operator__RRCache-__delitem__e74cd7f5"))
    assert tag == "slime-env-swe-task/cachetools-change-operator-rrcache-delitem-e74cd7f5"


TRACEBACK = """def test_x():
>       assert_equal(expected, result)

expected   = ['a', 'b']
result     = ['a']

pkg/tests/test_mod.py:176: 
_ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ 

self = <x>

    def _wrap(self):
>       return chunk is None
E       AssertionError

chunk      = 'SECRET'

pkg/mod.py:2815: AssertionError
_ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ 

expected = ['a', 'b']
result = ['a']

    def assert_equal(expected, result):
>       assert expected == result
E       AssertionError

expected   = ['a', 'b']
result     = ['a']

tests/common.py:9: AssertionError"""


def test_bare_messages_get_the_test_frames_locals_never_the_package_frames():
    from slime_env.envs.swe.build import with_locals

    spec = RepoSpec(name="pkg", version="1", sdist_sha256="0" * 64, source_dir="pkg", test_paths=("pkg/tests",))
    assert with_locals("AssertionError", TRACEBACK, spec) == "AssertionError\nexpected = ['a', 'b']\nresult = ['a']"
    assert with_locals("AssertionError: 1 != 2", TRACEBACK, spec) == "AssertionError: 1 != 2"
    only_package = TRACEBACK.split("_ _ _")[0].replace("pkg/tests/test_mod.py", "pkg/mod.py")
    assert "SECRET" not in with_locals("", only_package, spec)


class FakeWorkspace:
    """list_dir / read_file over a dict of /repo-relative paths (bytes, or "link")."""

    def __init__(self, files):
        self.files = files
        self.reads = []

    async def list_dir(self, path):
        from slime_env.tools_sandbox.workspace import FileInfo

        rel = path[len("/repo"):].strip("/")
        prefix = rel + "/" if rel else ""
        entries = {}
        for p, v in self.files.items():
            if p.startswith(prefix):
                head, _, rest = p[len(prefix):].partition("/")
                kind = "dir" if rest else ("link" if v == "link" else "file")
                entries[head] = FileInfo(head, kind, 0 if kind != "file" else len(v), 0o644)
        return sorted(entries.values(), key=lambda e: e.name)

    async def read_file(self, path, max_bytes=None):
        self.reads.append(path)
        return self.files[path[len("/repo/"):]]


def test_read_watched_reads_what_the_rules_cover_and_skips_build_outputs():
    import asyncio

    from slime_env.envs.swe.reward import read_watched

    ws = FakeWorkspace({"pkg/mod.py": b"x = 1\n", "pkg/build/gen.py": b"y = 2\n", "tests/test_mod.py": b"t\n",
                        "setup.cfg": b"[x]\n", "README.md": b"hi\n", "pkg/link.py": "link",
                        "build/lib/pkg/tests/test_mod.py": b"copy\n", ".git/config": b"",
                        "pkg/__pycache__/mod.cpython-311.pyc": b"\0", "repro.py": b"print(1)\n"})
    files, ignored = asyncio.run(read_watched(ws, SPEC))
    assert set(files) == {"pkg/mod.py", "pkg/build/gen.py", "tests/test_mod.py", "setup.cfg", "pkg/link.py"}
    assert files["pkg/link.py"] == "link" and "/repo/pkg/link.py" not in ws.reads  # a link is never followed
    assert sorted(ignored) == ["README.md", "repro.py"]


def test_statement_says_what_of_the_suite_is_in_the_checkout():
    """A task of a one-file suite hides the whole suite (the file holds the failing tests): its statement must not
    say the rest of the suite is in the checkout."""
    from slime_env.envs.swe.build import visible_test_files

    kw = dict(name="t", repo="r", source_dir="r", failures=FAILURES, names=set())
    assert "the rest of the suite is" in write_statement(**kw)
    text = write_statement(**kw, suite_visible=False)
    assert "the rest of the suite is" not in text and "None of the test suite is in your checkout" in text
    one_file = ["test_r.py::test_a", "test_r.py::test_b"]
    assert visible_test_files(one_file, ["test_r.py"]) == []
    assert visible_test_files([*one_file, "tests/test_s.py::c"], ["test_r.py"]) == ["tests/test_s.py"]


def test_manifest_test_paths_may_name_a_file_and_the_old_name_reads(tmp_path):
    head = 'pytest = ["pytest==8.4.2"]\n[[repo]]\nname = "x"\nversion = "1"\nsdist_sha256 = "' + "0" * 64 + '"\n'
    path = tmp_path / "repos.toml"
    path.write_text(head + 'source_dir = "x"\ntest_paths = ["test_x.py"]\n')
    spec = load_manifest(path)["x"]
    assert spec.test_paths == ("test_x.py",) and spec.is_test_path("test_x.py")
    path.write_text(head + 'source_dir = "x"\ntest_dirs = ["tests"]\n')  # the field's older name
    assert load_manifest(path)["x"].test_paths == ("tests",)
    path.write_text(head + 'source_dir = "x"\ntest_dirs = ["tests"]\ntest_paths = ["tests"]\n')
    with pytest.raises(InvalidInput, match="test_paths or its older name test_dirs, not both"):
        load_manifest(path)
    path.write_text(head + 'source_dir = "x"\n')
    with pytest.raises(InvalidInput, match="missing field 'test_paths'"):
        load_manifest(path)
