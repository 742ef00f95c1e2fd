"""Harbor task folders without containers: task.toml read as Harbor 0.26 reads it (compared field by field with
Harbor's own pydantic models), Harbor's layout rules, clear errors for bad files, env templates, datasets, the
reward-file rules, the checked copy of an agent's files, and ATIF export validated by Harbor's own validator.

Harbor (`pip install --ignore-requires-python --no-deps harbor==0.26.0 toml`, done by the Makefile) needs Python
>= 3.12 as a whole, but its task-config and trajectory models import on 3.11: those are what this compares with.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import tarfile
import warnings
from pathlib import Path

import pytest

from slime_env.envs.harbor import load_dataset, load_task, strip_canary
from slime_env.envs.harbor.task import is_task_dir, task_dirs
from slime_env.errors import InvalidInput

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "harbor_tasks"
FIXTURES = ROOT / "tests" / "data" / "harbor"


def _harbor(module: str):
    """A module of the `harbor` package, or skip (fail under CI, where the Makefile installs it)."""
    try:
        import importlib

        return importlib.import_module(module)
    except ImportError as e:
        if os.environ.get("CI"):
            pytest.fail(f"CI must have harbor==0.26.0 installed (Makefile): {e}")
        pytest.skip(f"harbor is not installed ({e}); see the Makefile's venv recipe")


def harbor_dump(text: str) -> dict:
    config = _harbor("harbor.models.task.config")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return config.TaskConfig.model_validate_toml(text).model_dump(mode="json")


def make_task(root: Path, toml: str, *, name: str = "t", instruction: str = "do it\n", tests: bool = True,
              environment: bool = True) -> Path:
    d = root / name
    (d / "tests").mkdir(parents=True, exist_ok=True)
    (d / "task.toml").write_text(toml)
    if instruction is not None:
        (d / "instruction.md").write_text(instruction)
    if environment:
        (d / "environment").mkdir(exist_ok=True)
        (d / "environment" / "Dockerfile").write_text("FROM python:3.11-slim\nWORKDIR /app\n")
    if tests:
        (d / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    return d


# --- the same values as Harbor's models ----------------------------------------------------------------------
SHIPPED = sorted(p.name for p in EXAMPLES.iterdir() if (p / "task.toml").is_file())
FIXTURE_TASKS = sorted(p.name for p in FIXTURES.iterdir() if (p / "task.toml").is_file())


def test_there_are_enough_shipped_tasks():
    assert len(SHIPPED) >= 24
    fixtures = {"simple-task", "multi-reward", "legacy-task", "tb21-prove-plus-comm", "hello-separate"}
    assert fixtures <= set(FIXTURE_TASKS)


@pytest.mark.parametrize("folder", [EXAMPLES / n for n in SHIPPED] + [FIXTURES / n for n in FIXTURE_TASKS],
                         ids=lambda p: p.name)
def test_every_task_parses_to_harbors_values(folder):
    task = load_task(folder)
    assert task.config.to_dict() == harbor_dump((folder / "task.toml").read_text())


VALID = {
    "empty": "",
    "version rename": 'version = "1.0"',
    "schema_version wins over version": 'schema_version = "1.2"\nversion = "9"',
    "any schema version": 'schema_version = "9.9"',
    "legacy sizes": '[environment]\nmemory = "1.5g"\nstorage = " 512M "',
    "legacy K": '[environment]\nmemory = "2048K"',
    "legacy integer memory dropped": "[environment]\nmemory = 2048",
    "legacy equal to _mb": '[environment]\nmemory = "2G"\nmemory_mb = 2048',
    "allow_internet false": "[environment]\nallow_internet = false",
    "allow_internet true": "[environment]\nallow_internet = true",
    "allow_internet yields to network_mode": '[environment]\nallow_internet = false\nnetwork_mode = "public"',
    "allowlist normalized": '[environment]\nnetwork_mode = "allowlist"\nallowed_hosts = ["PyPI.org.", "*.example.com", '
                            '"10.0.0.0/8", "2001:DB8::1", "192.0.2.1"]',
    "allow_internet with allowlist": '[environment]\nallow_internet = false\nnetwork_mode = "allowlist"\n'
                                     'allowed_hosts = ["a.com"]',
    "cpus float to int": "[environment]\ncpus = 2.0",
    "cpus fraction": "[environment]\ncpus = 0.5",
    "numeric strings": '[verifier]\ntimeout_sec = "120"\n[environment]\nmemory_mb = "2048"\ncpus = "2.0"',
    "os case": '[environment]\nos = "Linux"',
    "everything in environment": '''
[environment]
build_timeout_sec = 30
docker_image = "x/y:1"
gpus = 0
gpu_types = ["H100", "A100"]
skills_dir = "/skills"
workdir = "/work"
env = { A = "1", B = "${HOME:-/root}" }
tpu = { type = "v6e", topology = " 2x4 " }
healthcheck = { command = "true", retries = 5 }
[[environment.mcp_servers]]
name = "web"
transport = "http"
url = "http://mcp:8000/mcp"
headers = { Authorization = "Bearer ${TOKEN}", X-Trace = "on" }
[[environment.mcp_servers]]
name = "local"
transport = "stdio"
command = "srv"
args = ["--x"]
''',
    "verifier and agent": '''
[verifier]
timeout_sec = 30
env = { K = "${K:-v}" }
user = "tester"
network_mode = "allowlist"
allowed_hosts = ["api.example.com"]
[[verifier.collect]]
command = "dump"
timeout_sec = 5
[agent]
timeout_sec = 60
user = 1000
network_mode = "no-network"
''',
    "separate verifier environment": '''
[verifier]
[verifier.environment]
docker_image = "v:1"
allow_internet = false
memory = "1G"
''',
    "explicit separate": '[verifier]\nenvironment_mode = "separate"',
    "task package": '''
[task]
name = "org/my.task_1"
version = "1.0.0"
description = "d"
keywords = ["k"]
[[task.authors]]
name = "A"
email = "a@b.c"
[[task.authors]]
name = "B"
''',
    "metadata free-form": '[metadata]\ndifficulty = "hard"\ntags = ["a"]\nnested = { x = 1, y = [1.5, true] }',
    "source and solution": 'source = "tb"\n[solution]\nenv = { S = "1" }',
    "artifacts": 'artifacts = ["/app/out.log", { source = "/var/x", destination = "x", exclude = ["*.tmp"] }, '
                 '{ source = "/db/dump", service = "db" }, { source = "rel/path", destination = "" }]',
    "steps": '''
multi_step_reward_strategy = "final"
[[steps]]
name = "one"
min_reward = 0.5
artifacts = ["/app/a"]
[steps.agent]
timeout_sec = 10
[steps.verifier]
timeout_sec = 20
[[steps]]
name = "two"
min_reward = { reward = 1, style = 0.5 }
healthcheck = { command = "true" }
[steps.verifier.environment]
docker_image = "v"
''',
    "empty steps": "steps = []",
    "unknown keys ignored": 'foo = 1\n[environment]\nbar = 2\n[verifier]\nbaz = "x"',
}


@pytest.mark.parametrize("toml", VALID.values(), ids=VALID.keys())
def test_valid_configs_read_as_harbor_reads_them(tmp_path, toml):
    folder = make_task(tmp_path, toml)
    for step in ("one", "two") if "[[steps]]" in toml else ():
        (folder / "steps" / step).mkdir(parents=True)
        (folder / "steps" / step / "instruction.md").write_text("x")
    task = load_task(folder)
    assert task.config.to_dict() == harbor_dump(toml)


def test_notes_list_unknown_and_deprecated_fields(tmp_path):
    task = load_task(make_task(tmp_path, 'foo = 1\n[environment]\nbar = 2\nmemory = "1G"\nallow_internet = true'))
    assert "unknown field foo (ignored)" in task.notes and "unknown field environment.bar (ignored)" in task.notes
    assert any("environment.memory" in n for n in task.notes) and any("allow_internet" in n for n in task.notes)
    assert task.config.environment.memory_mb == 1024 and task.config.environment.network_mode == "public"
    assert task.config.environment.allow_internet is None  # applied, then cleared as Harbor clears it


# --- bad files: Harbor rejects them too; our errors name the file and the field --------------------------------
INVALID = {
    "environment.cpus": '[environment]\ncpus = "many"',
    "environment.cpus ": "[environment]\ncpus = nan",
    "environment.memory_mb": "[environment]\nmemory_mb = 1.5",
    "environment.memory": '[environment]\nmemory = "2GB"',
    "environment.memory ": '[environment]\nmemory = "2G"\nmemory_mb = 4096',
    "environment.storage": '[environment]\nstorage = "lots"',
    "environment.os": '[environment]\nos = "macos"',
    "environment.network_mode": '[environment]\nnetwork_mode = "internet"',
    "environment.allowed_hosts": '[environment]\nallowed_hosts = ["a.com"]',
    "environment.allowed_hosts[0]": '[environment]\nnetwork_mode = "allowlist"\nallowed_hosts = ["https://a.com/x"]',
    "environment.allowed_hosts[1]": '[environment]\nnetwork_mode = "allowlist"\nallowed_hosts = ["a.com", "a*.b.com"]',
    "environment.tpu.topology": '[environment]\ntpu = { type = "v4", topology = "2by2" }',
    "environment.mcp_servers[0].url": '[[environment.mcp_servers]]\nname = "x"',
    "environment.mcp_servers[0].command": '[[environment.mcp_servers]]\nname = "x"\ntransport = "stdio"',
    "environment.mcp_servers[0].transport": '[[environment.mcp_servers]]\nname = "x"\ntransport = "ws"\nurl = "u"',
    "environment.mcp_servers[0].headers.Authorization":
        '[[environment.mcp_servers]]\nname = "x"\nurl = "u"\nheaders = { Authorization = "Bearer sk-123" }',
    "environment.env.A": "[environment]\nenv = { A = 1 }",
    "environment.healthcheck.command": "[environment]\nhealthcheck = { retries = 2 }",
    "verifier.timeout_sec": '[verifier]\ntimeout_sec = "soon"',
    "verifier.environment_mode": '[verifier]\nenvironment_mode = "shared"\n[verifier.environment]\ncpus = 1',
    "verifier.environment_mode ": '[verifier]\nenvironment_mode = "elsewhere"',
    "verifier.allowed_hosts": '[verifier]\nallowed_hosts = ["a.com"]',
    "verifier.collect[0].command": "[[verifier.collect]]\ntimeout_sec = 1",
    "verifier.env.K": "[verifier]\nenv = { K = true }",
    "agent.user": "[agent]\nuser = 1.5",
    "agent.network_mode": '[agent]\nnetwork_mode = "on"',
    "task.name": '[task]\nname = "no-org"',
    "task.name ": '[task]\nname = "a/../b"',
    "task.authors[0].name": '[task]\nname = "a/b"\n[[task.authors]]\nemail = "x"',
    "metadata": "metadata = 3",
    "schema_version": "schema_version = 1",
    "artifacts[0]": 'artifacts = ["/app/../etc"]',
    "artifacts[0].destination": 'artifacts = [{ source = "/a", destination = "/abs" }]',
    "artifacts[0].destination ": 'artifacts = [{ source = "/a", destination = "manifest.json" }]',
    "artifacts[0].source": 'artifacts = [{ source = "rel", service = "db" }]',
    "steps[1].name": '[[steps]]\nname = "a"\n[[steps]]\nname = "A"',
    "steps[0].name": '[[steps]]\nname = "a/b"',
    "multi_step_reward_strategy": 'multi_step_reward_strategy = "max"',
}


@pytest.mark.parametrize("field,toml", INVALID.items(), ids=INVALID.keys())
def test_bad_configs_name_the_file_and_field(tmp_path, field, toml):
    config = _harbor("harbor.models.task.config")
    with pytest.raises(Exception), warnings.catch_warnings():  # Harbor rejects it too
        warnings.simplefilter("ignore", DeprecationWarning)
        config.TaskConfig.model_validate_toml(toml)
    folder = make_task(tmp_path, toml)
    with pytest.raises(InvalidInput) as err:
        load_task(folder)
    assert str(err.value).startswith(f"{folder}/task.toml: {field.strip()}:"), str(err.value)


STRICTER = {  # Harbor's pydantic models accept these; they are mistakes, so we say so
    "environment.cpus": "[environment]\ncpus = 0",
    "environment.memory_mb": "[environment]\nmemory_mb = -5",
    "environment.gpus": "[environment]\ngpus = true",
    "verifier.timeout_sec": "[verifier]\ntimeout_sec = -1",
    "agent.user": "[agent]\nuser = true",
}


@pytest.mark.parametrize("field,toml", STRICTER.items(), ids=STRICTER.keys())
def test_stricter_than_harbor_where_harbor_accepts_nonsense(tmp_path, field, toml):
    harbor_dump(toml)  # accepted by Harbor
    with pytest.raises(InvalidInput, match=f"task.toml: {field}:"):
        load_task(make_task(tmp_path, toml))


def test_not_toml_and_missing_file(tmp_path):
    with pytest.raises(InvalidInput, match=r"t/task.toml: not valid TOML"):
        load_task(make_task(tmp_path, "[environment\ncpus = 1"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidInput, match=r"empty/task.toml: missing"):
        load_task(tmp_path / "empty")


# --- layout rules (Harbor's Task.is_valid_dir) ---------------------------------------------------------------
def test_layout_rules(tmp_path):
    assert is_task_dir(make_task(tmp_path, "", name="ok"))
    with pytest.raises(InvalidInput, match="missing instruction.md"):
        load_task(make_task(tmp_path, "", name="noinstr", instruction=None))
    with pytest.raises(InvalidInput, match=r"missing tests/test.sh"):
        load_task(make_task(tmp_path, "", name="notests", tests=False))
    assert load_task(make_task(tmp_path, "", name="noverify", tests=False), disable_verification=True)
    with pytest.raises(InvalidInput, match="no environment/ folder and no"):
        load_task(make_task(tmp_path, "", name="noenv", environment=False))
    assert load_task(make_task(tmp_path, '[environment]\ndocker_image = "x:1"', name="image", environment=False))
    with pytest.raises(InvalidInput, match=r"missing tests/test.bat"):
        load_task(make_task(tmp_path, '[environment]\nos = "windows"', name="win"))
    # separate mode with tests bundled in tests/Dockerfile needs no test script on the host
    bundled = make_task(tmp_path, '[verifier]\nenvironment_mode = "separate"', name="bundled", tests=False)
    (bundled / "tests" / "Dockerfile").write_text("FROM python:3.11-slim\nCOPY . /tests/\n")
    assert load_task(bundled).bundled_tests


def test_links_out_of_the_task_are_refused(tmp_path):
    outside = tmp_path / "secret.txt"
    outside.write_text("x")
    folder = make_task(tmp_path, "")
    (folder / "tests" / "leak.txt").symlink_to(outside)
    with pytest.raises(InvalidInput, match="leads out of the task folder"):
        load_task(folder)


def test_steps_need_their_folders(tmp_path):
    toml = '[[steps]]\nname = "one"\n[[steps]]\nname = "two"'
    folder = make_task(tmp_path, toml, instruction=None)
    with pytest.raises(InvalidInput, match=r"step 'one': missing steps/one/"):
        load_task(folder)
    for step in ("one", "two"):
        (folder / "steps" / step).mkdir(parents=True)
        (folder / "steps" / step / "instruction.md").write_text(f"# canary string\n\nstep {step}\n")
    task = load_task(folder)
    assert task.has_steps and task.instruction == "" and task.step_instruction("two") == "step two\n"


def test_name_and_instruction():
    task = load_task(FIXTURES / "tb21-prove-plus-comm")
    assert task.name == "terminal-bench/prove-plus-comm" and task.short_name == "prove-plus-comm"
    assert task.instruction == "Complete the proof of addition commutativity in plus_comm.v.\n"
    assert load_task(FIXTURES / "simple-task").name == "simple-task"


@pytest.mark.parametrize("text,expected", [
    ("# BENCHMARK DATA canary GUID x\n\n\nDo it.\n", "Do it.\n"),
    ("<!-- Canary: abc -->\n# another CANARY line\n\nDo it.\n# canary later stays\n", "Do it.\n# canary later stays\n"),
    ("  # canary indented  \nDo it.", "Do it."),
    ("Do it.\n", "Do it.\n"),
    ("# Title\nDo it.", "# Title\nDo it."),
    ("<!-- a comment -->\nDo it.", "<!-- a comment -->\nDo it."),
])
def test_canary_lines_are_stripped_as_harbor_strips_them(text, expected):
    assert strip_canary(text) == expected


# --- env templates ---------------------------------------------------------------------------------------
def test_env_templates_resolve_from_the_host(tmp_path):
    toml = ('[verifier]\nenv = { A = "${SLIME_T_A}", B = "${SLIME_T_B:-dflt}", C = "lit ${X}", D = "${SLIME_T_A:-}" }\n'
            '[solution]\nenv = { S = "${SLIME_T_MISSING}" }')
    task = load_task(make_task(tmp_path, toml))
    env = task.resolved_env("verifier", {"SLIME_T_A": "a"})
    assert env == {"A": "a", "B": "dflt", "C": "lit ${X}", "D": "a"}
    with pytest.raises(InvalidInput, match=r"t/task.toml: solution.env.S: environment variable 'SLIME_T_MISSING' is "
                                           r"not set"):
        task.resolved_env("solution", {})
    utils = _harbor("harbor.utils.env")  # the same rules as Harbor's resolver
    os.environ["SLIME_T_A"] = "a"
    try:
        assert utils.resolve_env_vars(dict(task.config.verifier.env)) == task.resolved_env("verifier")
    finally:
        del os.environ["SLIME_T_A"]


# --- datasets ---------------------------------------------------------------------------------------------
def test_datasets(tmp_path):
    tasks = load_dataset(EXAMPLES)
    assert [t.name for t in tasks][:3] == sorted(SHIPPED)[:3] and len(tasks) == len(SHIPPED)
    assert [t.name for t in load_dataset(EXAMPLES / "fix-mean-script")] == ["fix-mean-script"]
    listing = tmp_path / "tasks.txt"
    listing.write_text(f"# two tasks\n{EXAMPLES / 'split-file'}\n\n../{tmp_path.name}/t  # relative to the list\n")
    make_task(tmp_path, "")
    assert [t.name for t in load_dataset(listing)] == ["split-file", "t"]
    make_task(tmp_path, "[environment]\ncpus = -1", name="u")
    with pytest.raises(InvalidInput, match="u/task.toml: environment.cpus"):
        load_dataset(tmp_path)
    assert [t.name for t in load_dataset(tmp_path, skip_invalid=True)] == ["t"]
    with pytest.raises(InvalidInput, match="no Harbor task folders"):
        load_dataset(tmp_path / "u" / "tests")
    assert task_dirs(tmp_path) == [tmp_path / "t", tmp_path / "u"]


def test_image_tag_follows_the_environment(tmp_path):
    folder = make_task(tmp_path, '[task]\nname = "Org/My_Task"')
    task = load_task(folder)
    tag = task.image_tag()
    assert tag.startswith("slime-env-harbor/org-my-task:") and tag == load_task(folder).image_tag()
    (folder / "environment" / "data.txt").write_text("x")
    assert load_task(folder).image_tag() != tag


def test_harborignore_excludes_uploads(tmp_path):
    pytest.importorskip("pathspec")
    folder = make_task(tmp_path, "")
    (folder / "tests" / ".harborignore").write_text("*.big\ncache/\n!keep.big\n")
    for name in ("a.big", "keep.big", "cache/x.py", "sub/b.py"):
        (folder / "tests" / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / "tests" / name).write_text("x")
    task = load_task(folder)
    assert [rel for _, rel in task.upload_files(task.tests_dir)] == ["keep.big", "sub/b.py", "test.sh"]


# --- reward files (Harbor's parse rules) ---------------------------------------------------------------
@pytest.mark.parametrize("data,rewards,status", [
    (b"1\n", {"reward": 1.0}, "ok"), (b"0.25", {"reward": 0.25}, "ok"), (b" 1 \n\n", {"reward": 1.0}, "ok"),
    (b"", None, "empty"), (b"PASS", None, "parse_error"), (b"true", None, "parse_error"),
    (b"nan", None, "parse_error"), (b"inf\n", None, "parse_error"), (b"\xff", None, "parse_error"),
])
def test_reward_txt_rules(data, rewards, status):
    from slime_env.envs.harbor.verifier import parse_reward_txt

    assert parse_reward_txt(data)[:2] == (rewards, status)


@pytest.mark.parametrize("data,rewards,status", [
    (b'{"reward": 1, "style": 0.5}', {"reward": 1, "style": 0.5}, "ok"),
    (b'{"correctness": 1, "performance": 0}', {"correctness": 1, "performance": 0}, "ok"),
    (b'{"reward": true}', {"reward": 1.0}, "ok"), (b"{}", {}, "ok"),
    (b'{"reward": "1"}', None, "parse_error"), (b'{"reward": NaN}', None, "parse_error"),
    (b'{"reward": 1e309}', None, "parse_error"), (b"0.7", None, "parse_error"), (b"[1]", None, "parse_error"),
    (b"{not json", None, "parse_error"), (b"", None, "empty"),
])
def test_reward_json_rules(data, rewards, status):
    from slime_env.envs.harbor.verifier import parse_reward_json

    assert parse_reward_json(data)[:2] == (rewards, status)


def test_verifier_result_reward():
    from slime_env.envs.harbor.verifier import VerifierResult

    assert VerifierResult({"reward": 0.5, "x": 1}, "ok").reward() == 0.5
    assert VerifierResult({"correctness": 1, "performance": 0}, "ok").reward() == 0.5
    assert VerifierResult(None, "timeout").reward() == 0.0
    assert VerifierResult(None, "missing").harbor_error == "RewardFileNotFoundError"


# --- the checked copy of an agent's files ------------------------------------------------------------------
def _archive(members) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for name, kind, extra in members:
            info = tarfile.TarInfo(name)
            if kind == "file":
                info.size, info.mode = len(extra), 0o4755
                t.addfile(info, io.BytesIO(extra))
            elif kind == "dir":
                info.type, info.mode = tarfile.DIRTYPE, 0o777
                t.addfile(info)
            elif kind == "sym":
                info.type, info.linkname = tarfile.SYMTYPE, extra
                t.addfile(info)
            elif kind == "fifo":
                info.type = tarfile.FIFOTYPE
                t.addfile(info)
    return buf.getvalue()


def test_copies_keep_only_what_stays_inside():
    from slime_env.envs.harbor.transfer import sanitize

    data = _archive([("app", "dir", None), ("app/ok.txt", "file", b"ok"), ("app/sub", "dir", None),
                     ("app/rel", "sym", "sub/../ok.txt"), ("app/abs", "sym", "/app/sub"),
                     ("app/out", "sym", "/usr/lib/python3"), ("app/up", "sym", "../etc/passwd"),
                     ("app/link", "sym", "sub"), ("app/climb", "sym", "link/../../etc"),
                     ("app/link/x.py", "file", b"through a link"), ("app/../etc/evil", "file", b"x"),
                     ("/etc/evil", "file", b"x"), ("other/x", "file", b"x"), ("app/pipe", "fifo", None)])
    clean, dropped = sanitize(data, "/app")
    with tarfile.open(fileobj=io.BytesIO(clean)) as t:
        kept = {m.name: m for m in t.getmembers()}
    assert sorted(kept) == ["app", "app/abs", "app/link", "app/ok.txt", "app/rel", "app/sub"]
    assert kept["app/ok.txt"].mode == 0o755 and kept["app"].mode == 0o777  # setuid cleared, the rest kept
    assert len(dropped) == 8, dropped


# --- ATIF --------------------------------------------------------------------------------------------------
def _trajectory():
    from slime_env.ledger import Span
    from slime_env.trajectory import Trajectory
    from slime_env.types import Message, Task

    call = '<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call>'
    messages = [Message("system", "You are an agent."), Message("user", "List the files."),
                Message("assistant", f"Let me look.\n{call}"),
                Message("tool", "a.txt\nb.txt", name="bash", tool_call_id="call_0_0"),
                Message("assistant", "There are two files.")]
    prompt = [1, 2, 3, 4]
    response = [10, 11, 12, 20, 21, 30, 31, 32]
    spans = [Span(0, "generated", 0, 3), Span(0, "inserted", 3, 5), Span(1, "offpolicy", 5, 6),
             Span(1, "generated", 6, 8)]
    mask = [1, 1, 1, 0, 0, 0, 1, 1]
    logprobs = [-0.1, -0.2, -0.3, 0.0, 0.0, 0.0, -0.5, -0.6]
    return Trajectory(task=Task("List the files.", id="t1"), prompt_ids=prompt, response_ids=response,
                      loss_mask=mask, rollout_logprobs=logprobs, spans=spans, turn_rewards=[0.0, 1.0], reward=1.0,
                      status="completed", num_turns=2, messages=messages)


def test_atif_export_validates_with_harbor(tmp_path):
    from slime_env.envs.harbor.atif import to_atif, write_atif

    models = _harbor("harbor.models.trajectories")
    validator = _harbor("harbor.utils.trajectory_validator")
    traj = _trajectory()
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
    doc = to_atif(traj, parser="hermes", model_name="m", tools=tools, session_id="s1")
    parsed = models.Trajectory.model_validate(doc)
    v = validator.TrajectoryValidator()
    assert v.validate(json.dumps(doc)), v.errors
    write_atif(traj, tmp_path / "trajectory.json", parser="hermes")
    assert validator.TrajectoryValidator().validate(str(tmp_path / "trajectory.json"))

    assert parsed.schema_version == "ATIF-v1.8"
    assert [s.source for s in parsed.steps] == ["system", "user", "agent", "agent"]
    first, second = parsed.steps[2], parsed.steps[3]
    assert first.tool_calls[0].function_name == "bash" and first.tool_calls[0].arguments == {"cmd": "ls"}
    assert first.observation.results[0].source_call_id == first.tool_calls[0].tool_call_id == "call_0_0"
    assert first.observation.results[0].content == "a.txt\nb.txt"
    assert first.metrics.prompt_token_ids == [1, 2, 3, 4] and first.metrics.completion_token_ids == [10, 11, 12]
    assert first.metrics.logprobs == [-0.1, -0.2, -0.3]
    assert second.metrics.prompt_token_ids == [1, 2, 3, 4, 10, 11, 12, 20, 21]
    assert second.metrics.completion_token_ids == [30, 31, 32] and second.metrics.logprobs == [0.0, -0.5, -0.6]
    assert second.metrics.extra["loss_mask"] == [0, 1, 1]  # the off-policy token is marked
    assert parsed.extra["status"] == "completed" and parsed.extra["reward"] == 1.0
    assert parsed.extra["spans"][1] == {"turn": 0, "kind": "inserted", "start": 3, "end": 5}
    assert parsed.final_metrics.total_completion_tokens == 6


def test_atif_without_a_parser_keeps_results_unmatched():
    from slime_env.envs.harbor.atif import to_atif

    models = _harbor("harbor.models.trajectories")
    doc = to_atif(_trajectory())
    step = models.Trajectory.model_validate(doc).steps[2]
    assert step.tool_calls is None and step.observation.results[0].source_call_id is None
    assert step.observation.results[0].extra == {"name": "bash", "tool_call_id": "call_0_0"}


def test_links_out_of_the_copy_are_set_aside_to_be_restored():
    """Links that leave the copied path (a venv's `bin/python3 -> /usr/local/bin/python3`) go to `outside` for
    `restore_links` (a copy of the target in the verifier's fresh workspace) instead of being lost; a crafted
    member under such a link is still dropped."""
    from slime_env.envs.harbor.transfer import sanitize

    data = _archive([("app", "dir", None), ("app/venv", "dir", None), ("app/venv/bin", "dir", None),
                     ("app/venv/bin/python3", "sym", "/usr/local/bin/python3"), ("app/up", "sym", "../etc/passwd"),
                     ("app/up/x", "file", b"under an outside link"), ("app/venv/bin/python", "sym", "python3")])
    outside: list = []
    clean, dropped = sanitize(data, "/app", outside=outside)
    with tarfile.open(fileobj=io.BytesIO(clean)) as t:
        kept = sorted(m.name for m in t.getmembers())
    assert kept == ["app", "app/venv", "app/venv/bin", "app/venv/bin/python"]
    assert outside == [("app/venv/bin/python3", "/app/venv/bin/python3", "/usr/local/bin/python3"),
                       ("app/up", "/app/up", "/etc/passwd")]
    assert dropped == ["app/up/x: under a link"]


# --- where the verifier runs, and what `check` and Harbor-v0 report ----------------------------------------------
def test_the_default_verifier_is_a_fresh_container_and_separate_needs_artifacts(tmp_path):
    """mode None: `isolated` (or the task's own `separate`), never the agent's container; `separate` on a task
    that declares no artifacts would give its verifier none of the agent's work: refused by the task's name."""
    from slime_env.envs.harbor.verifier import resolve_mode, verify

    plain = load_task(make_task(tmp_path, "", name="plain"))
    own = load_task(make_task(tmp_path, '[verifier]\nenvironment_mode = "separate"\n', name="own"))
    arts = load_task(make_task(tmp_path, 'artifacts = ["/app/out.txt"]\n', name="arts"))
    assert (resolve_mode(plain, None), resolve_mode(own, None)) == ("isolated", "separate")
    assert resolve_mode(plain, "shared") == "shared" and resolve_mode(arts, "separate") == "separate"
    assert resolve_mode(own, "separate") == "separate"
    with pytest.raises(InvalidInput, match="plain: mode 'separate' needs the task to declare artifacts"):
        resolve_mode(plain, "separate")
    with pytest.raises(InvalidInput, match="mode must be one of"):
        resolve_mode(plain, "elsewhere")
    with pytest.raises(InvalidInput, match="declare artifacts"):  # before it touches the workspace at all
        asyncio.run(verify(plain, object(), mode="separate"))


def _invoke(args, monkeypatch, results=None):
    """`slime-env harbor ...` with `check_tasks` replaced (no container): each valid task gets `results[name]`."""
    from typer.testing import CliRunner

    from slime_env.envs.harbor import check as check_module
    from slime_env.envs.harbor.cli import harbor_app

    seen = {}

    async def fake_check_tasks(tasks, *, mode=None, on_result=None, **_):
        seen.update(mode=mode, tasks=[t.name for t in tasks])
        out = [results[t.name] for t in tasks]
        for r in out:
            on_result(r)
        return out

    monkeypatch.setattr(check_module, "check_tasks", fake_check_tasks)
    return CliRunner().invoke(harbor_app, args), seen


def test_check_reports_every_task_and_every_dropped_path(tmp_path, monkeypatch):
    """Two invalid tasks and a valid one: each invalid task gets its line (not one `error:` for the first), the
    valid one is still checked, in the default (fresh) mode; what the copy dropped is listed under its task."""
    from slime_env.envs.harbor.check import CheckResult
    from slime_env.envs.harbor.verifier import VerifierResult

    make_task(tmp_path, "[environment]\ncpus = 'many'\n", name="bad-cpus")
    make_task(tmp_path, "", name="no-tests", tests=False)
    make_task(tmp_path, "", name="fine")
    oracle = VerifierResult({"reward": 1.0}, "ok", mode="isolated",
                            dropped=("app/v/bin/x: link to /nowhere, which the verifier's workspace does not have",))
    result, seen = _invoke(["check", str(tmp_path)], monkeypatch,
                           {"fine": CheckResult("fine", oracle, VerifierResult({"reward": 0.0}, "ok"))})
    assert result.exit_code == 1, result.output
    assert seen == {"mode": None, "tasks": ["fine"]}
    lines = result.output.splitlines()
    assert any(line.startswith("INVALID bad-cpus: ") and "environment.cpus" in line for line in lines), lines
    assert any(line.startswith("INVALID no-tests: ") for line in lines), lines
    assert any(line.startswith("PASS fine") for line in lines), lines
    assert "     dropped (oracle): app/v/bin/x: link to /nowhere" in result.output
    assert lines[-1].startswith("1 of 3 tasks pass") and "bad-cpus" in lines[-1] and "no-tests" in lines[-1]


def test_shared_mode_runs_only_by_name_and_warns(tmp_path, monkeypatch):
    from slime_env.envs.harbor import HarborEnv
    from slime_env.envs.harbor.check import CheckResult
    from slime_env.envs.harbor.verifier import VerifierResult

    make_task(tmp_path, "", name="fine")
    ok = CheckResult("fine", VerifierResult({"reward": 1.0}, "ok"), VerifierResult({"reward": 0.0}, "ok"))
    result, seen = _invoke(["check", str(tmp_path), "--mode", "shared"], monkeypatch, {"fine": ok})
    assert result.exit_code == 0 and seen["mode"] == "shared"
    assert "WARNING: the verifier runs in the agent's own container" in result.output  # stderr, mixed in
    result, _ = _invoke(["check", str(tmp_path), "--mode", "elsewhere"], monkeypatch, {"fine": ok})
    assert result.exit_code == 2 and "--mode 'elsewhere'" in result.output
    with pytest.warns(UserWarning, match="mode 'shared'"):
        HarborEnv(mode="shared")
    assert HarborEnv().mode is None  # the fresh-container default


def test_harbor_v0_reports_dropped_paths_and_refuses_separate_without_artifacts(tmp_path, monkeypatch):
    from slime_env import Task
    from slime_env.envs.harbor import HarborEnv, env as env_module
    from slime_env.envs.harbor.verifier import VerifierResult

    folder = make_task(tmp_path, "", name="plain")
    task = Task.coerce({"prompt": "p", "metadata": {"harbor_task": str(folder)}}, "t")

    async def fake_verify(ht, ws, *, mode=None):
        return VerifierResult({"reward": 1.0}, "ok", mode="isolated", dropped=("app/up: link to /proc/self",))

    monkeypatch.setattr(env_module.verifier, "verify", fake_verify)
    reward, info = asyncio.run(env_module.harbor_verify(task, object()))
    assert reward == 1.0 and info["harbor"]["dropped"] == ["app/up: link to /proc/self"]
    with pytest.raises(InvalidInput, match="plain: mode 'separate' needs the task to declare artifacts"):
        asyncio.run(HarborEnv(mode="separate").setup_state(task))  # before any container starts
