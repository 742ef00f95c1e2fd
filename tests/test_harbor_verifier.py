"""Harbor's oracle and verifier against real containers (Docker; skipped without an engine, failed under CI):
the reward outcomes Harbor defines, the oracle's contract, the separate and isolated modes, every shipped task's
oracle check, and reward forgery — each kind must earn 0, and each test names the defence that stops it.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from sandbox_support import unavailable
from slime_env.envs.harbor import load_dataset, load_task
from slime_env.envs.harbor.check import check_tasks
from slime_env.envs.harbor.environment import open_task_workspace, task_image
from slime_env.envs.harbor.verifier import run_oracle, verify

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "harbor_tasks"
RUN_LABEL = "slime_env.workspace.run=harbor"
pytestmark = pytest.mark.timeout(1500)


@pytest.fixture(scope="module")
def docker():
    """The Docker engine; at the end, no container of these tests is left and their scratch images are gone."""
    try:
        from slime_env.tools_sandbox.workspace.docker import docker_client

        client = docker_client()
        client.ping()
    except Exception as e:  # noqa: BLE001 - no engine: skip (fail under CI)
        unavailable(f"docker: {e}")
    made: list[str] = []
    yield made
    leftover = client.containers.list(all=True, filters={"label": RUN_LABEL}, sparse=True)
    for c in leftover:
        c.remove(force=True)
    for tag in made:
        try:
            client.images.remove(tag, force=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
    assert not leftover, f"containers left behind: {[c.name for c in leftover]}"


def make_task(root: Path, name: str, test_sh: str, toml: str = "", *, solve: str | None = None,
              tests: dict[str, str] | None = None) -> Path:
    d = root / name
    for sub in ("environment", "tests", "solution"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    (d / "task.toml").write_text(toml)
    (d / "instruction.md").write_text("probe\n")
    (d / "environment" / "Dockerfile").write_text("FROM python:3.11-slim\nWORKDIR /app\n")
    (d / "tests" / "test.sh").write_text("#!/bin/bash\n" + test_sh + "\n")
    for rel, text in (tests or {}).items():
        (d / "tests" / rel).write_text(text)
    if solve is not None:
        (d / "solution" / "solve.sh").write_text("#!/bin/bash\n" + solve + "\n")
    return d


@pytest.fixture(scope="module")
def probe_image(docker, runner, tmp_path_factory):
    """One image (python:3.11-slim, WORKDIR /app) for the outcome tests; their tasks differ in tests/ only."""
    task = load_task(make_task(tmp_path_factory.mktemp("img"), "probe", "true"))
    tag = runner.run(task_image(task))
    docker.append(tag)
    return tag


async def agent_then_verify(task, image=None, *, agent: str | None = None, oracle: bool = False, mode=None,
                            detach: bool = False):
    """A fresh workspace, the 'agent' (a shell script run as the agent user) or the oracle, then `verify`."""
    ws = await open_task_workspace(task, image=image)
    try:
        if oracle:
            await run_oracle(task, ws)
        if agent is not None:
            result = await ws.exec(["bash", "-c", agent], timeout_s=60, user=task.config.agent.user, detach=detach)
            assert result.status == "ok", result.stderr
        return await verify(task, ws, mode=mode, image=image)
    finally:
        await ws.close()


# --- Harbor's outcomes ---------------------------------------------------------------------------------------
R = "/logs/verifier"
OUTCOMES = {
    "txt 1": (f"echo 1 > {R}/reward.txt", "", "ok", {"reward": 1.0}),
    "txt fraction": (f"printf 0.25 > {R}/reward.txt", "", "ok", {"reward": 0.25}),
    "txt spaces": (f"printf ' 1 \\n\\n' > {R}/reward.txt", "", "ok", {"reward": 1.0}),
    "exit code ignored": (f"echo 1 > {R}/reward.txt; exit 3", "", "ok", {"reward": 1.0}),
    "json named": (f"echo '{{\"reward\": 1, \"style\": 0.5}}' > {R}/reward.json", "", "ok",
                   {"reward": 1, "style": 0.5}),
    "json wins over txt": (f"echo 0 > {R}/reward.txt; echo '{{\"reward\": 1}}' > {R}/reward.json", "", "ok",
                           {"reward": 1}),
    "txt empty": (f": > {R}/reward.txt", "", "empty", None),
    "txt nan": (f"echo nan > {R}/reward.txt", "", "parse_error", None),
    "txt word": (f"echo PASS > {R}/reward.txt", "", "parse_error", None),
    "json string": (f"echo '{{\"reward\": \"1\"}}' > {R}/reward.json", "", "parse_error", None),
    "json NaN": (f"echo '{{\"reward\": NaN}}' > {R}/reward.json", "", "parse_error", None),
    "missing": ("echo no reward", "", "missing", None),
    "timeout": (f"sleep 30; echo 1 > {R}/reward.txt", "[verifier]\ntimeout_sec = 2.0\n", "timeout", None),
    "cwd, env, user": (f'[ "$PWD" = /app ] && [ "$MODE" = fallback ] && [ "$(id -u)" = 65534 ] && echo 1 > '
                       f'{R}/reward.txt', '[verifier]\nuser = "nobody"\nenv = { MODE = "${SLIME_T_UNSET:-fallback}" }',
                       "ok", {"reward": 1.0}),
}


@pytest.mark.parametrize("test_sh,toml,status,rewards", OUTCOMES.values(), ids=OUTCOMES.keys())
def test_outcomes_are_harbors(runner, probe_image, tmp_path, test_sh, toml, status, rewards):
    task = load_task(make_task(tmp_path, "probe", test_sh, toml))
    # Harbor's outcomes are the same wherever the tests run: the cheapest mode (one container) checks them
    result = runner.run(agent_then_verify(task, probe_image, mode="shared"))
    assert (result.status, result.rewards) == (status, rewards), result
    assert (result.reason == "") == (status == "ok")
    if status == "timeout":
        assert result.duration_s < 20 and result.harbor_error == "VerifierTimeoutError"


def test_the_oracle_runs_as_harbors_oracle_agent(runner, probe_image, tmp_path):
    """solution/ at /solution, run as the agent user in the workdir with DEBIAN_FRONTEND and [solution].env; its
    output in /logs/agent/oracle.txt; the verifier then sees what it did."""
    toml = '[agent]\nuser = "nobody"\n[solution]\nenv = { SOL = "${SLIME_T_UNSET:-yes}" }'
    solve = 'echo "$PWD $DEBIAN_FRONTEND $SOL $(id -un) $(stat -c %a /solution/solve.sh)" > /tmp/out.txt; echo said'
    task = load_task(make_task(tmp_path, "probe", f"cp /tmp/out.txt {R}/seen.txt; echo 1 > {R}/reward.txt", toml,
                               solve=solve))

    async def go():
        ws = await open_task_workspace(task, image=probe_image)
        try:
            ran = await run_oracle(task, ws)
            assert ran.status == "ok", ran
            assert (await ws.read_file("/logs/agent/oracle.txt")) == b"said\n"
            result = await verify(task, ws, mode="shared")  # seen.txt is then read from this workspace
            return result, await ws.read_file(f"{R}/seen.txt")
        finally:
            await ws.close()

    result, seen = runner.run(go())
    assert result.rewards == {"reward": 1.0}
    assert seen.decode().split()[:4] == ["/app", "noninteractive", "yes", "nobody"]
    assert seen.decode().split()[4] in ("755", "775", "777")


def test_separate_mode_with_bundled_tests_gets_only_the_artifacts(runner, docker, tmp_path):
    """Harbor's separate verifier: its own image (tests/Dockerfile, tests inside it), the declared artifacts and
    /logs/artifacts copied in; nothing else of the agent's container."""
    check = (f'[ "$(cat /app/out.txt)" = made ] && [ "$(cat /logs/artifacts/note.txt)" = noted ] && '
             f'[ ! -e /app/other.txt ] && [ -f /tests/marker ] && echo 1 > {R}/reward.txt || echo 0 > {R}/reward.txt')
    folder = make_task(tmp_path, "separate", check, 'artifacts = ["/app/out.txt"]\n[verifier]\n'
                                                    'environment_mode = "separate"\n', tests={"marker": ""})
    (folder / "tests" / "Dockerfile").write_text("FROM python:3.11-slim\nWORKDIR /app\nCOPY . /tests/\n")
    task = load_task(folder)
    assert task.bundled_tests
    docker += [task.image_tag(), task.image_tag(task.tests_dir, suffix="-verifier")]
    agent = "echo made > /app/out.txt; echo noted > /logs/artifacts/note.txt; echo x > /app/other.txt"
    result = runner.run(agent_then_verify(task, agent=agent))
    assert (result.status, result.rewards, result.mode) == ("ok", {"reward": 1.0}, "separate"), result


# --- every shipped task: the oracle scores 1, no agent does not ------------------------------------------------
@pytest.mark.parametrize("mode", [None, pytest.param("shared", marks=pytest.mark.slow)])
def test_every_shipped_task_passes_its_oracle_and_fails_without_it(runner, docker, mode):
    tasks = load_dataset(EXAMPLES)
    t0 = time.monotonic()
    results = runner.run(check_tasks(tasks, concurrency=3, mode=mode))
    took = time.monotonic() - t0
    print(f"\noracle check of {len(tasks)} tasks (mode {mode or 'per task'}): {took:.0f}s")
    assert [(r.task, r.problem()) for r in results if not r.ok] == []


# --- reward forgery: a task whose solution is NOT applied, an 'agent' that only forges --------------------------
@pytest.fixture(scope="module")
def slugify(docker, runner):
    task = load_task(EXAMPLES / "implement-slugify")
    return task, runner.run(task_image(task))


def forge(runner, slugify, agent: str, mode: str, *, detach: bool = False):
    task, image = slugify
    return runner.run(agent_then_verify(task, image, agent=agent, mode=mode, detach=detach))


MODES = ["shared", "isolated"]


@pytest.mark.parametrize("mode", MODES)
def test_control_the_real_solution_earns_1(runner, slugify, mode):
    task, image = slugify
    assert runner.run(agent_then_verify(task, image, oracle=True, mode=mode)).rewards == {"reward": 1.0}


@pytest.mark.parametrize("mode", MODES)
def test_forged_reward_files_earn_0(runner, slugify, mode):
    """Reward files written (and made read-only, and /logs/verifier made a link) by the agent. Stopped by:
    /logs/verifier is removed and made anew, root's, before the tests run (Harbor removes the two files)."""
    agent = (f"echo 1 > {R}/reward.txt; echo '{{\"reward\": 1}}' > {R}/reward.json; chmod 444 {R}/reward.*; "
             f"mkdir -p /tmp/fake && echo 1 > /tmp/fake/reward.txt && mv {R} /tmp/old && ln -s /tmp/fake {R}")
    assert forge(runner, slugify, agent, mode).rewards == {"reward": 0.0}


@pytest.mark.parametrize("mode", MODES)
def test_replaced_tests_earn_0(runner, slugify, mode):
    """/tests made by the agent (a test.sh that writes 1, a test file that passes, a conftest.py). Stopped by:
    /tests is removed and the task's tests/ uploaded fresh after the agent (isolated: a fresh container)."""
    agent = ("mkdir -p /tests && printf '#!/bin/bash\\necho 1 > /logs/verifier/reward.txt\\n' > /tests/test.sh && "
             "chmod 755 /tests/test.sh && echo 'def test_ok(): pass' > /tests/test_outputs.py && "
             "echo 'def test_extra(): pass' > /tests/test_extra.py && chmod -R a-w /tests")
    assert forge(runner, slugify, agent, mode).rewards == {"reward": 0.0}


PASS_ALL = ("import pytest\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
            "    outcome = yield\n    outcome.get_result().outcome = 'passed'\n")


@pytest.mark.parametrize("mode", MODES)
def test_conftest_ini_and_plugins_in_the_workdir_earn_0(runner, slugify, mode):
    """A conftest.py that passes every test, a pytest.ini that loads a plugin, a plugin module, in the workdir
    and at / (and a pytest11 entry point in the user site). Stopped by test.sh: pytest runs from /tests with
    `-c /dev/null --rootdir=/tests --confcutdir=/tests`, `python3 -I` (cwd not on sys.path, no user site) and
    PYTEST_DISABLE_PLUGIN_AUTOLOAD."""
    agent = ("for d in /app /; do printf %s \"$PASS\" > $d/conftest.py; "
             "printf '[pytest]\\naddopts = -p forge_plugin\\n' > $d/pytest.ini; "
             "printf %s \"$PASS\" > $d/forge_plugin.py; "
             "done; u=$(python3 -c 'import site; print(site.getusersitepackages())'); mkdir -p $u/forge-0.dist-info; "
             "printf %s \"$PASS\" > $u/forge_plugin.py; printf 'Metadata-Version: 2.1\\nName: forge\\nVersion: 0\\n' "
             "> $u/forge-0.dist-info/METADATA; printf '[pytest11]\\nforge = forge_plugin\\n' > "
             "$u/forge-0.dist-info/entry_points.txt")
    agent = f"export PASS={_sh(PASS_ALL)}; {agent}"
    assert forge(runner, slugify, agent, mode).rewards == {"reward": 0.0}


def _sh(text: str) -> str:
    import shlex

    return shlex.quote(text)


@pytest.mark.parametrize("mode", MODES)
def test_sitecustomize_and_pth_earn_0(runner, slugify, mode):
    """sitecustomize.py, usercustomize.py and a .pth that end the interpreter with status 0 (so test.sh would
    write 1), in the workdir and in the user site. Stopped by `python3 -I` (no user site, no cwd on sys.path,
    no PYTHON* variables) and test.sh's `cd /tests`."""
    exit0 = "import os; os._exit(0)\n"
    agent = (f"u=$(python3 -c 'import site; print(site.getusersitepackages())'); mkdir -p $u; "
             f"for d in /app $u; do printf %s {_sh(exit0)} > $d/sitecustomize.py; "
             f"printf %s {_sh(exit0)} > $d/usercustomize.py; printf %s {_sh(exit0)} > $d/zz_forge.pth; done")
    assert forge(runner, slugify, agent, mode).rewards == {"reward": 0.0}


@pytest.mark.parametrize("mode", MODES)
def test_background_writers_that_outlive_the_agent_earn_0(runner, slugify, mode):
    """Processes left running to write the reward files during verification (at once, and after a delay),
    started with `detach=True` so they outlive the agent's command. Stopped by: `kill_processes()` before the
    verifier runs (and /logs/verifier made anew)."""
    loop = (f"while :; do echo 1 > {R}/reward.txt; echo '{{\"reward\": 1}}' > {R}/reward.json 2>/dev/null; "
            f"sleep 0.01; done")
    agent = (f"nohup sh -c {_sh(loop)} > /dev/null 2>&1 & "
             f"nohup sh -c {_sh('sleep 2; ' + loop)} > /dev/null 2>&1 & "
             f"setsid nohup sh -c {_sh('sleep 1; ' + loop)} > /dev/null 2>&1 & sleep 0.3")
    task, image = slugify

    async def go():
        ws = await open_task_workspace(task, image=image)
        try:
            assert (await ws.exec(["bash", "-c", agent], detach=True)).status == "ok"
            await asyncio.sleep(2.5)
            alive = await ws.exec(f"test -e {R}/reward.txt && pgrep -c -f 'while :'")
            assert alive.status == "ok" and int(alive.stdout) >= 3, alive  # the forgery runs
            return await verify(task, ws, mode=mode, image=image)
        finally:
            await ws.close()

    result = runner.run(go())
    assert result.rewards == {"reward": 0.0}, result


ROOT_FORGERIES = {
    "python3": "for p in $(which -a python3) /usr/bin/python3; do rm -f $p; printf '#!/bin/sh\\nexit 0\\n' > $p; "
               "chmod 755 $p; done",
    "pytest": "d=$(python3 -c 'import os, pytest; print(os.path.dirname(pytest.__file__))'); "
              "printf 'raise SystemExit(0)\\n' > $d/__main__.py",
}


@pytest.mark.parametrize("kind", ROOT_FORGERIES)
def test_replaced_python_or_pytest_earn_0_in_isolated_mode(runner, slugify, kind):
    """A root agent replaces python3, or pytest in site-packages, so the tests 'pass'. Stopped in `isolated`
    mode: the tests run in a fresh container of the task's image, which gets the workdir alone. Shared mode
    cannot stop this (the tests run with the agent's python), and this test shows it: there it earns 1."""
    assert forge(runner, slugify, ROOT_FORGERIES[kind], "isolated").rewards == {"reward": 0.0}
    assert forge(runner, slugify, ROOT_FORGERIES[kind], "shared").rewards == {"reward": 1.0}  # the documented limit


# the three one-line forgeries by a root agent, at once: a python3 first on PATH, the interpreter's own
# sitecustomize.py and a .pth in site-packages, each ending the interpreter with status 0
DEFAULT_FORGERY = ("d=$(echo $PATH | cut -d: -f1); rm -f $d/python3; printf '#!/bin/sh\\nexit 0\\n' > $d/python3; "
                   "chmod 755 $d/python3; "
                   "sp=$(python3.11 -c 'import sysconfig; print(sysconfig.get_path(\"purelib\"))'); "
                   "echo 'import os; os._exit(0)' > $sp/sitecustomize.py; echo 'import os; os._exit(0)' > $sp/zz.pth")


def test_the_default_verifier_is_a_fresh_container(runner, slugify):
    """`verify` with no mode (what `harbor check`, `harbor eval` and Harbor-v0 use) runs the tests in a fresh
    container of the task's image: the forgeries that earn 1 in the agent's own container earn 0."""
    result = forge(runner, slugify, DEFAULT_FORGERY, None)
    assert (result.mode, result.rewards) == ("isolated", {"reward": 0.0}), result


def test_isolated_keeps_a_venv_and_restores_links_out_of_the_workdir_as_copies(runner, probe_image, tmp_path):
    """An honest `python3 -m venv /app/venv` (its bin/python3 a link to /usr/local/bin/python3) scores 1 in a
    fresh container: the link becomes a copy of the fresh image's interpreter. A link to /etc/passwd becomes a copy
    too (the verifier writing there changes nothing outside the workdir); links into the verifier's own files
    (/tests, /logs), to /proc, or to nothing there are dropped, and each is reported."""
    check = ('[ "$(/app/venv/bin/python -c \'import sys; print(sys.prefix)\')" = /app/venv ] && [ ! -L /app/pw ] && '
             'grep -q ^root: /app/pw && echo x > /app/pw && grep -q ^root: /etc/passwd && [ ! -e /app/t ] && '
             f'[ ! -e /app/p ] && [ ! -e /app/r ] && [ ! -e /app/gone ] && echo 1 > {R}/reward.txt || echo 0 > '
             f'{R}/reward.txt')
    task = load_task(make_task(tmp_path, "probe", check))
    agent = ("python3 -m venv --without-pip /app/venv && ln -s /etc/passwd /app/pw && ln -s /tests/test.sh /app/t && "
             f"ln -s /proc/self/environ /app/p && ln -s {R}/reward.txt /app/r && ln -s /nonexistent /app/gone")
    result = runner.run(agent_then_verify(task, probe_image, agent=agent, mode="isolated"))
    assert result.rewards == {"reward": 1.0}, result
    assert sorted(line.split(":")[0] for line in result.dropped) == ["app/gone", "app/p", "app/r", "app/t"], result


def test_no_container_is_left_after_a_failing_verification(runner, probe_image, tmp_path, docker):
    task = load_task(make_task(tmp_path, "probe", "exit 1"))
    with pytest.raises(ZeroDivisionError):
        async def boom():
            ws = await open_task_workspace(task, image=probe_image)
            try:
                await verify(task, ws, mode="isolated", image=probe_image)
                1 / 0
            finally:
                await ws.close()
        runner.run(boom())
    from slime_env.tools_sandbox.workspace.docker import docker_client

    time.sleep(0.5)
    assert docker_client().containers.list(all=True, filters={"label": RUN_LABEL}, sparse=True) == []


def test_verify_runs_alongside(runner, probe_image, tmp_path):
    """Verifications of several episodes run at once (each in its own workspace)."""
    task = load_task(make_task(tmp_path, "probe", f"echo 1 > {R}/reward.txt"))

    async def many():
        return await asyncio.gather(*(agent_then_verify(task, probe_image, mode=m) for m in ("shared", "isolated")))

    assert [r.rewards for r in runner.run(many())] == [{"reward": 1.0}] * 2
