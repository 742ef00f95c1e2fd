"""Harbor's oracle and verifier over a `Workspace`: `await run_oracle(task, ws)`, `await verify(task, ws)`.

`verify` runs Harbor 0.26's verifier steps (`harbor/verifier/verifier.py`) — reward files removed as root, tests/
uploaded to /tests, `chmod +x` as root, `bash -c '(/tests/test.sh) > /logs/verifier/test-stdout.txt 2>&1'` as the
verifier user with `[verifier].env`, in the workdir, under `[verifier].timeout_sec`; reward.json wins over
reward.txt; an empty, non-numeric or non-finite reward, a missing file or a timeout gives no rewards — in one of
three places (`mode`). The default (`mode=None`) is a fresh workspace: `separate` where the task asks for it, else
`isolated`; `shared` runs only when asked for by name (Harbor's default; the CLI and `Harbor-v0` warn loudly).

- `shared` (Harbor's default for tasks without a verifier environment): in the agent's own workspace, hardened:
  every process the agent started is killed first, /tests is removed and uploaded fresh, /logs/verifier is removed
  and made anew (root's, writable only by the verifier user), and the reward files are read by this process
  through the workspace API. This cannot stop an agent that ran as root from changing what the tests run *with*
  (python3, pytest in site-packages, bash itself): use `isolated` where the agent is root and the reward matters.
- `isolated` (for RL): a fresh workspace from the task's image, into which only the agent's workdir (or the
  task's declared `artifacts`) is copied, checked on the way (`transfer`). Nothing else the agent did survives;
  a link out of the copied path becomes a copy of its target in the fresh image (`transfer.restore_links`), and
  what is dropped is in `VerifierResult.dropped`.
- `separate` (Harbor's own, `[verifier].environment_mode = "separate"` / `[verifier.environment]` /
  tests/Dockerfile): a fresh workspace from the verifier's image, tests bundled in it or uploaded, the task's
  artifacts and /logs/artifacts copied to their own paths (as Harbor uploads them). Refused for a task that
  neither asks for it nor declares `artifacts`: its verifier would see none of the agent's work.
"""

from __future__ import annotations

import asyncio
import json
import math
import posixpath
import time
from dataclasses import dataclass, replace

from slime_env.envs.harbor import transfer
from slime_env.envs.harbor.config import ArtifactConfig
from slime_env.envs.harbor.environment import (AGENT_LOGS, ARTIFACTS_DIR, SOLUTION_DIR, TESTS_DIR, VERIFIER_LOGS,
                                               OpenWorkspace, agent_user, build_context_image, docker_open,
                                               prepare_logs, q, task_image, verifier_user, workspace_spec)
from slime_env.envs.harbor.task import HarborTask
from slime_env.envs.workspace.env import starting_workspace
from slime_env.errors import InfraError, InvalidInput
from slime_env.tools_sandbox.types import ExecResult
from slime_env.tools_sandbox.workspace import Workspace, WorkspaceError

REWARD_TXT = f"{VERIFIER_LOGS}/reward.txt"
REWARD_JSON = f"{VERIFIER_LOGS}/reward.json"
TEST_STDOUT = f"{VERIFIER_LOGS}/test-stdout.txt"
ORACLE_LOG = f"{AGENT_LOGS}/oracle.txt"
MODES = ("shared", "isolated", "separate")
STATUSES = ("ok", "missing", "empty", "parse_error", "timeout", "error", "infra_error")
# Harbor's exception for each status (TrialResult.exception_info.exception_type).
HARBOR_ERRORS = {"missing": "RewardFileNotFoundError", "empty": "RewardFileEmptyError",
                 "parse_error": "VerifierOutputParseError", "timeout": "VerifierTimeoutError",
                 "error": "AddTestsDirError"}
VERIFIER_START_TIMEOUT_S = 600.0  # a fresh verifier workspace that has not started by then: the host's failure
DEFAULT_AGENT_TIMEOUT_S = 3600.0
SHARED_WARNING = ("the verifier runs in the agent's own container (mode 'shared'): an agent that ran as root can "
                  "change what the tests run with (a python earlier on PATH, sitecustomize.py, a .pth file) and "
                  "score 1 without solving the task; use the default (a fresh container) wherever the reward counts")


@dataclass(frozen=True, slots=True)
class VerifierResult:
    """What a verification gave: `rewards` (reward.json's dict, or `{"reward": x}` from reward.txt; None unless
    `status` is `ok`), `status` (ok | missing | empty | parse_error | timeout | error | infra_error), `reason` for
    anything not ok (`infra_error`: the verifier's own machinery failed before any of the agent's work was in its
    workspace — its image, its start, its log folders; the episode's reward means nothing and it is not trained),
    the tail of test.sh's output, how long it took and where it ran (`mode`)."""

    rewards: dict[str, float | int] | None
    status: str
    reason: str = ""
    stdout_tail: str = ""
    duration_s: float = 0.0
    mode: str = "shared"
    dropped: tuple[str, ...] = ()

    @property
    def harbor_error(self) -> str | None:
        """The name of the exception Harbor records for this outcome (None when ok, and for infra_error: the
        verifier's environment failing is no verifier outcome in Harbor)."""
        return HARBOR_ERRORS.get(self.status)

    def reward(self, key: str = "reward") -> float:
        """One number for training: `rewards[key]`; else the only value; else the mean of the values (Harbor's
        `mean` metric per key); 0.0 without rewards (Harbor's metrics count a missing reward as 0)."""
        if not self.rewards:
            return 0.0
        if key in self.rewards:
            return float(self.rewards[key])
        values = [float(v) for v in self.rewards.values()]
        return values[0] if len(values) == 1 else sum(values) / len(values)


# --- reward files ----------------------------------------------------------------------------------------
def parse_reward_txt(data: bytes) -> tuple[dict | None, str, str]:
    """Harbor's `_parse_reward_text`: `float(text)` as `{"reward": x}`; (rewards, status, reason)."""
    if not data:
        return None, "empty", f"reward file {REWARD_TXT} is empty"
    try:
        value = float(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None, "parse_error", f"{REWARD_TXT} is not a number: {data[:80]!r}"
    if not math.isfinite(value):
        return None, "parse_error", f"non-finite reward {value!r} in {REWARD_TXT}"
    return {"reward": value}, "ok", ""


def parse_reward_json(data: bytes) -> tuple[dict | None, str, str]:
    """Harbor's `_parse_reward_json`: an object of finite numbers (booleans read as 0.0 / 1.0, as pydantic reads
    them), returned as it is; anything else is a parse error."""
    if not data:
        return None, "empty", f"reward file {REWARD_JSON} is empty"
    try:
        rewards = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None, "parse_error", f"{REWARD_JSON} is not JSON: {data[:80]!r}"
    for value in rewards.values() if isinstance(rewards, dict) else [rewards]:
        if not isinstance(value, (int, float)):
            return None, "parse_error", f"non-numeric reward {value!r} in {REWARD_JSON}"
        if isinstance(value, float) and not math.isfinite(value):
            return None, "parse_error", f"non-finite reward {value!r} in {REWARD_JSON}"
    if not isinstance(rewards, dict):
        return None, "parse_error", f"{REWARD_JSON} must hold an object of named rewards, got {rewards!r}"
    return {k: float(v) if isinstance(v, bool) else v for k, v in rewards.items()}, "ok", ""


async def read_rewards(ws: Workspace) -> tuple[dict | None, str, str]:
    """The rewards test.sh left, read through the workspace API: reward.json if it exists, else reward.txt."""
    for path, parse in ((REWARD_JSON, parse_reward_json), (REWARD_TXT, parse_reward_txt)):
        try:
            data = await ws.read_file(path, max_bytes=1 << 20)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except (IsADirectoryError, PermissionError, OSError) as e:
            return None, "parse_error", f"could not read {path}: {e}"
        return parse(data)
    return None, "missing", f"no reward file: test.sh wrote neither {REWARD_TXT} nor {REWARD_JSON}"


# --- oracle ----------------------------------------------------------------------------------------------
async def _upload(ws: Workspace, task: HarborTask, folder, remote: str) -> None:
    for path, rel in task.upload_files(folder):
        await ws.write_file(posixpath.join(remote, rel), path.read_bytes(), mode=path.stat().st_mode & 0o777)


async def _root(ws: Workspace, command: str, what: str) -> None:
    result = await ws.exec(["bash", "-c", command], user=0, timeout_s=120, cwd="/")
    if result.status != "ok":
        raise WorkspaceError(f"{what} failed in workspace {ws.id}: {(result.stderr or result.reason).strip()}")


async def run_oracle(task: HarborTask, ws: Workspace, *, timeout_s: float | None = None,
                     environ=None) -> ExecResult:
    """Harbor's OracleAgent: solution/ uploaded to /solution, `chmod +x` as root, then
    `(/solution/solve.sh) > /logs/agent/oracle.txt 2>&1` as the agent user in the workdir, with
    DEBIAN_FRONTEND=noninteractive and `[solution].env`, under the agent timeout. Its exit code does not matter
    (the verifier decides); the ExecResult says how it ended."""
    solve = task.solve_script
    if solve is None:
        raise InvalidInput(f"{task.given_path or task.path}: no solution/solve{task.script_ext}")
    env = {"DEBIAN_FRONTEND": "noninteractive", **task.resolved_env("solution", environ)}
    await prepare_logs(ws)
    await _root(ws, f"rm -rf {SOLUTION_DIR}", "removing /solution")
    await _upload(ws, task, task.solution_dir, SOLUTION_DIR)
    script = f"{SOLUTION_DIR}/{solve.name}"
    await _root(ws, f"chmod +x {q(script)}", "chmod of the solution")
    timeout = timeout_s or task.config.agent.timeout_sec or DEFAULT_AGENT_TIMEOUT_S
    return await ws.exec(["bash", "-c", f"({q(script)}) > {ORACLE_LOG} 2>&1"], user=agent_user(task, ws),
                         env=env, timeout_s=timeout)


# --- verifier --------------------------------------------------------------------------------------------
def resolve_mode(task: HarborTask, mode: str | None) -> str:
    """Where `task`'s verifier runs for `mode`: None is a fresh container (`separate` where the task asks for it,
    else `isolated`); `shared` only by name. Refuses `separate` for a task that neither asks for it nor declares
    artifacts (its verifier would get nothing of the agent's work and fail every solution)."""
    if mode is None:
        return "separate" if task.verifier_mode == "separate" else "isolated"
    if mode not in MODES:
        raise InvalidInput(f"verify: mode must be one of {MODES}, got {mode!r}")
    if mode == "separate" and task.verifier_mode != "separate" and not task.config.artifacts:
        raise InvalidInput(f"{task.name}: mode 'separate' needs the task to declare artifacts (task.toml's "
                           f"`artifacts`): a separate verifier gets only those, and this task declares none; use "
                           f"'isolated' (the workdir is copied)")
    return mode


async def verify(task: HarborTask, ws: Workspace, *, mode: str | None = None, image: str | None = None,
                 open_workspace: OpenWorkspace | None = None, paths: list[str] | None = None,
                 timeout_s: float | None = None, environ=None,
                 start_timeout_s: float | None = None) -> VerifierResult:
    """Verify the agent's work in `ws` (see the module for the modes; default: a fresh container, `separate` if
    the task asks for it, else `isolated`). `image`: the image of an isolated verifier (default: the task's);
    `open_workspace`: how a fresh workspace starts (default: Docker); `paths`: what an isolated verifier copies
    (default: the task's artifact paths, else the workdir). Ends the agent's phase: every process in `ws` is
    killed first. Never raises for what the agent did; a broken task (bad env template, missing tests) or a mode
    it cannot run in (`resolve_mode`) raises InvalidInput.

    Whose failure: the status is `infra_error` only for a step where nothing of the agent's is yet — the fresh
    workspace's image, its start (within `start_timeout_s`, default `VERIFIER_START_TIMEOUT_S`), its log folders.
    Everything after the agent's files are in (unpacking them, the tests, their timeout, a reward file missing) and
    every failure in the agent's own workspace (shared mode, reading its files) is the agent's: `error` / `timeout` /
    `missing`, reward 0. An agent cannot turn its failure into an excluded episode by breaking what the verifier runs
    on."""
    mode = resolve_mode(task, mode)
    env = task.resolved_env("verifier", environ)
    t0 = time.monotonic()
    try:
        await ws.kill_processes()
        if mode == "shared":
            result = await _run_tests(task, ws, env, timeout_s, upload=True)
        else:
            result = await _verify_elsewhere(task, ws, mode, env, image, open_workspace, paths, timeout_s,
                                             start_timeout_s or VERIFIER_START_TIMEOUT_S)
    except InfraError as e:
        result = VerifierResult(None, "infra_error", str(e))
    except (WorkspaceError, OSError) as e:
        result = VerifierResult(None, "error", f"{type(e).__name__}: {e}")
    return replace(result, duration_s=time.monotonic() - t0, mode=mode)


async def _verify_elsewhere(task, ws, mode, env, image, open_workspace, paths, timeout_s,
                            start_timeout_s) -> VerifierResult:
    copies: list[tuple[str, tuple[str, ...]]]
    upload = True
    if mode == "isolated":
        async with starting_workspace("the verifier's image"):
            image = image or await task_image(task)
        spec = workspace_spec(task, image, network=task.config.verifier.network_mode)
        copies = [(p, ()) for p in paths] if paths else (_artifact_paths(task, ws) or [(ws.workdir, ())])
    else:
        async with starting_workspace("the verifier's image"):
            image, spec_env, upload = await _separate_image(task)
        spec = workspace_spec(task, image, environment=spec_env, network=task.config.verifier.network_mode)
        copies = [(ARTIFACTS_DIR, ()), *_artifact_paths(task, ws)]
    archives, outside = [], []
    for path, exclude in copies:
        data = await transfer.pack(ws, path, exclude=exclude)
        archives.append((path, *(transfer.sanitize(data, path, outside=outside) if data is not None
                                 else (None, []))))
    fresh = await _start_fresh(open_workspace or docker_open, spec, start_timeout_s)
    try:
        async with starting_workspace("the verifier's workspace"):  # nothing of the agent's is in it yet
            await prepare_logs(fresh)
        dropped: list[str] = []
        for path, data, lost in archives:
            await transfer.unpack(fresh, path, data)
            dropped += lost
        # after every copy is unpacked: a target may not lead into any of them (the agent wrote them all)
        dropped += await transfer.restore_links(fresh, outside, roots=tuple(posixpath.normpath(p) for p, *_ in
                                                                            archives))
        result = await _run_tests(task, fresh, env, timeout_s, upload=upload)
        return replace(result, dropped=tuple(dropped))
    finally:
        await fresh.close()


async def _start_fresh(open_workspace: OpenWorkspace, spec, timeout_s: float) -> Workspace:
    """The verifier's fresh workspace, started within `timeout_s`; a start that fails or hangs is the host's failure
    (InfraError). A start cut short by the timeout is closed whenever it does finish, never left behind."""
    start = asyncio.ensure_future(open_workspace(spec))
    try:
        async with starting_workspace("the verifier's workspace"):
            try:
                return await asyncio.wait_for(asyncio.shield(start), timeout_s)
            except TimeoutError:
                raise TimeoutError(f"no workspace within {timeout_s:g}s") from None
    except InfraError:
        if not start.done():
            start.add_done_callback(_close_late)
        raise


def _close_late(start: asyncio.Future) -> None:
    if not start.cancelled() and start.exception() is None:
        asyncio.ensure_future(start.result().close())


def _artifact_paths(task: HarborTask, ws: Workspace) -> list[tuple[str, tuple[str, ...]]]:
    out = []
    for entry in task.config.artifacts:
        art = ArtifactConfig(entry) if isinstance(entry, str) else entry
        if art.service not in (None, "main"):
            continue  # a sidecar's artifact: no compose services here
        source = art.source if art.source.startswith("/") else posixpath.join(ws.workdir, art.source)
        out.append((posixpath.normpath(source), tuple(art.exclude)))
    return out


async def _separate_image(task: HarborTask):
    """(image, its EnvironmentConfig, whether tests are uploaded) of Harbor's separate verifier: tests/Dockerfile
    (tests bundled), `[verifier.environment].docker_image` (bundled), else the task's own environment."""
    venv = task.config.verifier.environment
    config = venv if venv is not None else task.config.environment
    if venv is not None and venv.docker_image:
        return venv.docker_image, config, False
    if (task.tests_dir / "Dockerfile").is_file():
        tag = task.image_tag(task.tests_dir, suffix="-verifier")
        return await build_context_image(task, task.tests_dir, tag), config, False
    return await task_image(task), config, True


async def _run_tests(task: HarborTask, ws: Workspace, env: dict[str, str], timeout_s: float | None, *,
                     upload: bool) -> VerifierResult:
    user = verifier_user(task, ws)
    # /logs/verifier anew (a link the agent made there is removed with it), root's, writable by the verifier user
    # alone; /tests anew with only the task's tests.
    owner = f"chown -- {q(str(user))} {VERIFIER_LOGS} && chmod 0700 {VERIFIER_LOGS}" \
        if user not in (None, 0, "0", "root") else "true"
    reset = (f"{{ [ -d /logs ] && [ ! -L /logs ] || rm -rf /logs; }} && rm -rf {VERIFIER_LOGS} && "
             f"mkdir -p {VERIFIER_LOGS} && chown 0:0 {VERIFIER_LOGS} && chmod 0755 {VERIFIER_LOGS} && {owner}")
    if upload:
        reset += f" && rm -rf {TESTS_DIR}"
    try:
        await _root(ws, reset, "resetting /logs/verifier and /tests")
        if upload:
            await _upload(ws, task, task.tests_dir, TESTS_DIR)
        script = f"{TESTS_DIR}/test{task.script_ext}"
        await _root(ws, f"chmod +x {q(script)}", "chmod of the tests")
    except (WorkspaceError, OSError) as e:
        return VerifierResult(None, "error", f"could not add the tests: {e}")
    timeout = timeout_s or task.config.verifier.timeout_sec
    run = await ws.exec(["bash", "-c", f"({q(script)}) > {TEST_STDOUT} 2>&1"], user=user, env=env,
                        timeout_s=timeout)
    await ws.kill_processes()  # whatever the tests left running cannot write the rewards while they are read
    tail = await _tail(ws)
    if run.status == "timeout":
        return VerifierResult(None, "timeout", f"the verifier timed out after {timeout:g}s", tail)
    if run.status == "sandbox_error":
        return VerifierResult(None, "error", f"the verifier could not run: {run.reason}", tail)
    rewards, status, reason = await read_rewards(ws)
    return VerifierResult(rewards, status, reason, tail)


async def _tail(ws: Workspace, limit: int = 4000) -> str:
    try:
        data = await ws.read_file(TEST_STDOUT, max_bytes=16 << 20)
    except OSError:
        return ""
    return data[-limit:].decode("utf-8", "replace")
