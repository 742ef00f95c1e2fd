"""SWE tasks end to end with Docker: one repository image built from the pinned manifest, a handful of mutants
validated, the tasks written as Harbor folders, and the reward run for the oracle, a wrong fix and every forgery
we could think of. Each forgery earns 0, and its test says which defence stops it:

- the clean copy: the verdict comes from a fresh workspace of the repository image, never from the agent's
  (reward files, background processes, anything outside the package's source never reach it);
- the guard (`guard.review`): tests, conftest.py, configuration, startup hooks, new files and links are refused,
  and so is source code that reaches for `exit`, `_exit`, `open`, `_pytest`, reflection or new imports;
- where the guard stops a forgery first, the clean copy's own answer without the guard is shown too
  (`run_hidden_tests`), when it has one.

Docker is required: without it these tests skip, and fail when `CI` is set. Every container and image they make is
removed after them, also when a test fails.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from slime_env.envs.swe import grade
from slime_env.envs.swe.build import BuildConfig, build_repo
from slime_env.envs.swe.check import build_task_image, run_oracle, start_agent_workspace
from slime_env.envs.swe.manifest import load_manifest, repo_dockerfile, repo_image_tag
from slime_env.envs.swe.patches import apply_patch
from slime_env.envs.swe.reward import run_hidden_tests, swe_reward
from slime_env.envs.swe.task import load_task, write_task

from sandbox_support import unavailable

REPO = "toolz"  # a 2-second suite with its tests inside the package: the guard's hardest layout


@pytest.fixture(scope="module")
def docker_client():
    try:
        from slime_env.tools_sandbox.workspace.docker import docker_client as client

        c = client()
        c.ping()
        return c
    except Exception as e:  # noqa: BLE001 - no engine, no permission
        unavailable(f"docker: {e}")


@pytest.fixture(scope="module")
def built(runner, docker_client, tmp_path_factory):
    """The repository image (built unless this host has it), 2 validated tasks, the first one's agent image."""
    spec = load_manifest()[REPO]
    image = repo_image_tag(spec)
    made: list[str] = []
    if not _image_exists(docker_client, image):
        made.append(image)
    out = tmp_path_factory.mktemp("swe_tasks")
    try:
        build = runner.run(build_repo(spec, BuildConfig(per_repo=2, max_candidates=10, seed=0), log=lambda _: None))
        assert len(build.tasks) == 2, [r for r in build.records if r["event"] == "candidate"]
        folders = [write_task(out, task, hidden) for task, hidden in build.tasks]
        tasks = [load_task(f) for f in folders]
        agent_image = runner.run(build_task_image(tasks[0]))
        made.append(agent_image)
        yield {"build": build, "tasks": tasks, "agent_image": agent_image, "runner": runner}
    finally:
        for tag in reversed(made):
            try:
                docker_client.images.remove(tag, force=True)
            except Exception:  # noqa: BLE001 - never made, or gone
                pass


def _image_exists(client, tag: str) -> bool:
    try:
        client.images.get(tag)
        return True
    except Exception:  # noqa: BLE001
        return False


def episode(built, actions=None, *, task_index: int = 0):
    """Start the agent's workspace of a task, let `actions(ws, task)` act in it, return the reward."""
    task = built["tasks"][task_index]
    runner = built["runner"]

    async def go():
        ws = await start_agent_workspace(task, built["agent_image"])
        try:
            if actions is not None:
                await actions(ws, task)
            return await swe_reward(task, ws)
        finally:
            await ws.close()

    return runner.run(go())


async def sh(ws, command: str, **kw):
    res = await ws.exec(command, cwd="/repo", **kw)
    assert res.exit_code == 0, (command, res.stdout, res.stderr)
    return res


def mutated_file(task) -> str:
    return task.mutation["file"]


async def fixed_text(ws, task) -> str:
    """The mutated file with the bug reversed (what the oracle writes)."""
    path = mutated_file(task)
    buggy = (await ws.read_file(f"/repo/{path}")).decode()
    return apply_patch({path: buggy}, task.bug_patch, reverse=True)[path]


# --- the build ------------------------------------------------------------------------------------------------
def test_build_validates_mutants_and_the_agent_sees_only_the_buggy_repository(built):
    records = built["build"].records
    repo = next(r for r in records if r["event"] == "repo")
    assert repo["baseline"] > 150 and repo["candidates"] > 100 and repo["image"] == repo_image_tag(
        load_manifest()[REPO])
    kept = [r for r in records if r["event"] == "candidate" and r.get("task")]
    assert len(kept) == 2 and all(r["fail_to_pass"] >= 1 for r in kept)
    for r in records:
        if r["event"] == "candidate" and r["status"] != "kept":
            assert r["reason"]
    task = built["tasks"][0]
    assert set(task.fail_to_pass).isdisjoint(task.pass_to_pass) and task.hidden_tests
    assert task.repo_dockerfile == repo_dockerfile(load_manifest()[REPO])

    async def look(ws, task):
        git = await sh(ws, "git log --all --oneline | wc -l; git status --porcelain | wc -l")
        assert git.stdout.split() == ["1", "0"]  # one commit: the clean code is in no history
        for hidden in task.hidden_tests:
            assert (await ws.exec(["test", "-e", f"/repo/{hidden}"])).exit_code == 1
        assert "\n+" not in (await sh(ws, "git diff")).stdout
        assert (await ws.read_file(f"/repo/{mutated_file(task)}")).decode() != await fixed_text(ws, task)

    assert episode(built, look).reward == 0.0


def test_a_rebuild_reproduces_the_shipped_tasks(built):
    """The same manifest and seed give the same folders: the first tasks of this small build are byte-for-byte
    the first tasks of the shipped set's repository (built with --per-repo 30)."""
    shipped = Path(__file__).resolve().parents[1] / "examples" / "swe_tasks"
    if not (shipped / "BUILD_LOG.jsonl").exists():
        pytest.skip("no shipped task set to compare with")
    for task in built["tasks"]:
        folder = shipped / task.name
        assert folder.is_dir(), f"{task.name} is not in the shipped set"
        for rel in ("task.toml", "instruction.md", "environment/Dockerfile", "environment/bug.patch",
                    "solution/solve.sh", "tests/spec.json", "tests/test.sh", "tests/grade.py"):
            assert (Path(task.path) / rel).read_bytes() == (folder / rel).read_bytes(), (task.name, rel)


# --- honest outcomes -----------------------------------------------------------------------------------------
def test_the_oracle_earns_1_and_doing_nothing_earns_0(built):
    nop = episode(built)
    assert (nop.reward, nop.status) == (0.0, "unresolved") and "FAIL_TO_PASS" in nop.reason
    assert set(nop.tests) >= set(built["tasks"][0].fail_to_pass)

    async def oracle(ws, task):
        await run_oracle(task, ws)
        await ws.write_file("/repo/reproduce.py", "print('scratch files are ignored')\n")

    good = episode(built, oracle)
    assert (good.reward, good.status) == (1.0, "resolved"), good.reason
    assert good.changed_files == (mutated_file(built["tasks"][0]),) and "reproduce.py" in good.ignored_files
    assert good.exit_code == 0 and all(o == "passed" for o in good.tests.values())
    assert good.timings["tests"] > 0 and good.timings["total"] >= good.timings["tests"]


def test_harbor_env_scores_a_swe_task_with_the_clean_copy_reward(built, smollm2_tok):
    """A SWE task folder through Harbor-v0 and the runner: a teacher that read bug.patch fixes it with the editor
    and earns 1 from `swe_reward` (not from the folder's test.sh); submitting at once earns 0."""
    import json as _json

    from slime_env.envs.harbor import HarborEnv, harbor_tasks
    from slime_env.envs.harbor.task import load_task as load_harbor_task
    from slime_env.envs.swe.patches import reverting_edits

    from slime_env import ScriptedPolicy, get_renderer, run_episode

    task = built["tasks"][0]
    harbor = next(t for t in harbor_tasks(Path(task.path).parent) if t["metadata"]["name"] == task.name)

    def call(name, **arguments):
        return f'<tool_call>\n{_json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'

    edits = [call("str_replace_editor", command="str_replace", path=f"/repo/{path}", old_str=old, new_str=new)
             for path, old, new in reverting_edits(task.bug_patch)]

    async def go(replies):
        env = HarborEnv(max_turns=8)
        try:
            return await run_episode(env, ScriptedPolicy(smollm2_tok, replies), harbor, max_turns=8,
                                     renderer=get_renderer(smollm2_tok, strict=True))
        finally:
            await env.close()

    try:
        fixed = built["runner"].run(go([*edits, call("submit")]))
        nothing = built["runner"].run(go([call("submit")]))
    finally:
        tag = load_harbor_task(task.path).image_tag()
        try:
            from slime_env.tools_sandbox.workspace.docker import docker_client

            docker_client().images.remove(tag, force=True)
        except Exception:  # noqa: BLE001 - never built
            pass
    assert fixed.status == "completed" and fixed.reward == 1.0, (fixed.reason, fixed.info)
    assert fixed.info["swe"]["status"] == "resolved" and fixed.info["swe"]["changed_files"] == [mutated_file(task)]
    assert nothing.reward == 0.0 and nothing.info["swe"]["status"] == "unresolved"


def test_a_wrong_fix_earns_0(built):
    other = built["tasks"][1]

    async def wrong(ws, task):
        await run_oracle(task, ws)  # the right fix, and the other task's bug on top of it
        path = mutated_file(other)
        text = (await ws.read_file(f"/repo/{path}")).decode()
        await ws.write_file(f"/repo/{path}", apply_patch({path: text}, other.bug_patch)[path])

    r = episode(built, wrong)
    assert (r.reward, r.status) == (0.0, "unresolved") and "did not pass" in r.reason


def test_harbor_shared_mode_test_sh_grades_the_folder_itself(built):
    """Harbor's own verifier (tests/test.sh in the agent's container): oracle 1, nothing 0, an edited test 0."""
    task = built["tasks"][0]
    rewards = {}

    async def harbor(ws, label):
        await ws.upload(Path(task.path) / "tests", "/tests")
        await ws.exec("rm -f /logs/verifier/reward.txt; mkdir -p /logs/verifier", user=0)
        await ws.exec("bash /tests/test.sh > /logs/verifier/test-stdout.txt 2>&1", cwd="/repo", timeout_s=300)
        rewards[label] = (await ws.read_file("/logs/verifier/reward.txt")).decode().strip()
        verdict = json.loads(await ws.read_file("/logs/verifier/verdict.json"))
        rewards[label + "_reason"] = verdict["reason"]

    async def nop(ws, task):
        await harbor(ws, "nop")

    async def oracle(ws, task):
        await run_oracle(task, ws)
        await harbor(ws, "oracle")

    async def tamper(ws, task):
        visible = next(p for p in task.protected if p.endswith(".py") and "test" in p)
        await ws.write_file(f"/repo/{visible}", "def test_nothing():\n    pass\n")
        await run_oracle(task, ws)
        await harbor(ws, "tamper")

    for actions in (nop, oracle, tamper):
        episode(built, actions)
    assert rewards["nop"] == "0" and rewards["oracle"] == "1", rewards
    assert rewards["tamper"] == "0" and "changed the test suite" in rewards["tamper_reason"], rewards


# --- forgeries -----------------------------------------------------------------------------------------------
def test_forged_reward_files_earn_0__clean_copy(built):
    async def forge(ws, task):
        await sh(ws, "mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt && "
                     "echo '{\"reward\": 1}' > /logs/verifier/reward.json && "
                     "echo '<testsuites/>' > /tmp/junit.xml")

    r = episode(built, forge)
    assert (r.reward, r.status) == (0.0, "unresolved")  # never read: the verdict is the clean copy's


def test_edited_tests_earn_0__guard(built):
    async def edit(ws, task):
        visible = next(p for p in task.protected if "/tests/test_" in p)
        await ws.write_file(f"/repo/{visible}", "def test_ok():\n    assert True\n")

    r = episode(built, edit)
    assert (r.reward, r.status) == (0.0, "refused") and "the tests are not part of a fix" in r.reason


def test_deleted_tests_earn_0__guard(built):
    async def delete(ws, task):
        await sh(ws, f"rm -rf {task.test_paths[0]}/*.py")

    r = episode(built, delete)
    assert (r.reward, r.status) == (0.0, "refused") and r.reason.startswith("deletes ")


def test_recreated_hidden_tests_earn_0__guard(built):
    async def recreate(ws, task):
        for hidden in task.hidden_tests:
            await ws.write_file(f"/repo/{hidden}", "def test_ok():\n    assert True\n")

    r = episode(built, recreate)
    assert (r.reward, r.status) == (0.0, "refused") and "adds " in r.reason


CONFTEST = '''import pytest

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome = "passed"
'''


def test_conftest_hooks_earn_0__guard(built):
    for where in ("conftest.py", "toolz/conftest.py", "toolz/tests/conftest.py"):
        async def hook(ws, task, where=where):
            await ws.write_file(f"/repo/{where}", CONFTEST)

        r = episode(built, hook)
        assert (r.reward, r.status) == (0.0, "refused") and f"adds {where}" in r.reason, where


def test_startup_hooks_earn_0__guard_and_clean_copy(built):
    async def site(ws, task):
        await ws.write_file("/repo/sitecustomize.py", "import sys\nsys.exit(0)\n")

    r = episode(built, site)
    assert (r.reward, r.status) == (0.0, "refused") and "startup hook" in r.reason

    async def pth(ws, task):  # outside /repo: never read, never carried
        site_dir = (await sh(ws, "python3 -c 'import site; print(site.getsitepackages()[0])'")).stdout.strip()
        await sh(ws, f"mkdir -p {site_dir} && echo 'import os; os._exit(0)' > {site_dir}/zz_forge.pth")

    r = episode(built, pth)
    assert (r.reward, r.status) == (0.0, "unresolved")


def _init_with(line: str):
    async def act(ws, task):
        text = (await ws.read_file("/repo/toolz/__init__.py")).decode()
        await ws.write_file("/repo/toolz/__init__.py", text + line)
    return act


@pytest.mark.parametrize("line,name", [("import sys\nsys.exit(0)\n", "`exit`"),
                                       ("import os\nos._exit(0)\n", "`_exit`")])
def test_exit_at_import_earns_0__guard_and_clean_copy(built, line, name):
    r = episode(built, _init_with(line))
    assert (r.reward, r.status) == (0.0, "refused") and name in r.reason
    # without the guard the clean copy says no as well: the tests never ran, nothing is reported as passed
    task = built["tasks"][0]
    files = {"toolz/__init__.py": b""}

    async def read_init():
        ws = await start_agent_workspace(task, built["agent_image"])
        try:
            files["toolz/__init__.py"] = (await ws.read_file("/repo/toolz/__init__.py")) + line.encode()
        finally:
            await ws.close()

    built["runner"].run(read_init())
    raw = built["runner"].run(run_hidden_tests(task, files))
    assert (raw.reward, raw.status) == (0.0, "unresolved"), raw


PYTEST_PATCH = '''
import _pytest.reports
_orig = _pytest.reports.TestReport.from_item_and_call

def _forged(item, call):
    report = _orig(item, call)
    report.outcome = "passed"
    report.longrepr = None
    return report

_pytest.reports.TestReport.from_item_and_call = staticmethod(_forged)
'''


def test_monkeypatching_pytest_from_the_package_earns_0__guard(built):
    r = episode(built, _init_with(PYTEST_PATCH))
    assert (r.reward, r.status) == (0.0, "refused") and "adds an import (import _pytest.reports)" in r.reason


def test_reflection_and_builtins_tricks_earn_0__guard(built):
    tricks = ["x = getattr(merge, '_' + '_globals__')\n", "__builtins__['open']('/tmp/j.xml', 'w')\n",
              "import builtins\n", "y = merge.__globals__\n"]
    for trick in tricks:
        r = episode(built, _init_with(trick))
        assert (r.reward, r.status) == (0.0, "refused"), (trick, r)


def test_a_background_process_that_outlives_the_agent_earns_0__clean_copy(built):
    async def background(ws, task):
        # it keeps forging reward files and reports, and turns any hidden test that appears into a passing one
        script = ("while :; do mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt; "
                  "for f in /tmp/*.xml; do echo '<testsuites/>' > \"$f\"; done; "
                  + "".join(f"[ -e /repo/{h} ] && echo 'def test_ok(): pass' > /repo/{h}; " for h in task.hidden_tests)
                  + "sleep 0.05; done")
        await ws.exec(["sh", "-c", f"nohup sh -c '{script}' >/dev/null 2>&1 &"], timeout_s=5)
        assert "sleep" in (await sh(ws, "ps -eo args 2>/dev/null || ls /proc")).stdout or True

    r = episode(built, background)
    assert (r.reward, r.status) == (0.0, "unresolved")  # the tests ran in another workspace, from its own files


def test_a_symlinked_source_file_earns_0__guard(built):
    async def link(ws, task):
        fixed = await fixed_text(ws, task)
        await ws.write_file("/tmp/fixed.py", fixed)
        await sh(ws, f"ln -sf /tmp/fixed.py {mutated_file(task)}")

    r = episode(built, link)
    assert (r.reward, r.status) == (0.0, "refused") and "into a link" in r.reason


def test_verdicts_name_no_forged_outcome(built):
    """The grading reads only pytest's report written in the clean workspace: a report naming forged tests would
    still miss the real ones (a missing test is a failed test)."""
    task = built["tasks"][0]
    fake = b'<testsuites><testsuite><testcase classname="x" name="y" file="x.py"/></testsuite></testsuites>'
    g = grade.grade(grade.parse_junit(fake), task.fail_to_pass, task.pass_to_pass)
    assert not g["resolved"] and set(g["fail_to_pass"].values()) == {"missing"}
