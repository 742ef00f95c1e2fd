"""The reward of a SWE task: the hidden tests, run on a clean copy of the repository with the agent's diff applied,
in a fresh workspace — never in the agent's own.

`await swe_reward(task, agent_ws)`:
1. starts a fresh workspace from the task's *repository* image (the clean sdist with every test; network off),
   while it reads the agent's files through the workspace API (host-side: nothing the agent could have changed
   runs, not even its `git`): the package's source, the tests, the test configuration, startup hooks;
2. compares them with what the agent started from (the clean files with the task's bug applied, less the hidden
   tests) and lets the guard (`guard.review`) refuse anything but edits of existing `.py` files under
   `source_dir` written with the module's own names — reward 0, the reason naming the file and the rule;
3. writes the resulting source files into the fresh workspace, runs FAIL_TO_PASS + PASS_TO_PASS there as an
   unprivileged user under the verifier's timeout, reads the JUnit report host-side and grades it
   (`grade.grade`): reward 1 iff every one of those tests passed (a missing test failed) and pytest exited 0;
4. closes the fresh workspace.

The agent's workspace is only read; whoever runs the episode closes it.
"""

from __future__ import annotations

import asyncio
import posixpath
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from slime_env.envs.swe import grade
from slime_env.envs.swe.guard import Entry, review, watched
from slime_env.envs.swe.manifest import WORKDIR, RepoSpec, ensure_image
from slime_env.envs.swe.patches import PatchError, apply_patch
from slime_env.envs.swe.task import SweTask, load_task

TEST_USER = "nobody"
SKIP_DIRS = frozenset({".git", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".hypothesis", ".tox",
                       ".nox", ".venv", "venv", "node_modules", ".eggs"})
TOP_SKIP_DIRS = frozenset({"build", "dist"})  # build outputs (`pip install .`), at the repository's top only
MAX_ENTRIES = 20_000
MAX_FILE_BYTES = 8 << 20
_clean_trees: dict[str, tuple[dict[str, Entry], set[str]]] = {}  # image -> its watched files, other paths


@dataclass(frozen=True)
class SweReward:
    """The outcome of one reward: `reward` (1.0 or 0.0) and `status` — `resolved`, `unresolved` (tests failed),
    `refused` (the guard), `timeout` (the tests ran past the verifier's timeout), `error` (a workspace failed) or
    `infra_error` (the clean workspace did not start: the host's failure; its reward means nothing)
    — with its `reason`; the outcome of each FAIL_TO_PASS test and each failed PASS_TO_PASS test (`tests`), the
    source files carried to the clean copy (`changed_files`), files ignored (`ignored_files`), pytest's exit
    code and the time of each stage in seconds (`timings`: start, read, guard, tests, total)."""

    reward: float
    status: str
    reason: str
    tests: Mapping[str, str] = field(default_factory=dict)
    changed_files: tuple[str, ...] = ()
    ignored_files: tuple[str, ...] = ()
    exit_code: int | None = None
    timings: Mapping[str, float] = field(default_factory=dict)


StartWorkspace = Callable[[object], Awaitable[object]]  # a WorkspaceSpec -> a started Workspace
ReleaseWorkspace = Callable[[object], Awaitable[None]]


async def _open(spec):
    from slime_env.tools_sandbox.workspace import open_workspace

    return await open_workspace(spec)


async def _close(ws) -> None:
    await ws.close()


def reward_workspace_spec(task: SweTask):
    """The fresh workspace the tests run in: the repository image, /repo, no network, the task's CPU and memory."""
    from slime_env.tools_sandbox.workspace import Limits, WorkspaceSpec

    return WorkspaceSpec(image=task.image, workdir=WORKDIR, limits=Limits(
        cpus=task.cpus, memory_mb=task.memory_mb, pids=512, network="none",
        wall_time_s=task.verifier_timeout_s + 300))


async def read_watched(ws, spec: RepoSpec) -> tuple[dict[str, Entry], list[str]]:
    """The files of /repo the guard's rules cover (path -> bytes, or the kind of a non-file), and the paths of
    the other files (not read), through the workspace API. Caches, virtual environments, egg-info and top-level
    build outputs are not walked: nothing in them reaches the tests."""
    files: dict[str, Entry] = {}
    ignored: list[str] = []
    seen = 0

    async def walk(rel: str) -> None:
        nonlocal seen
        for e in await ws.list_dir(posixpath.join(WORKDIR, rel) if rel else WORKDIR):
            seen += 1
            if seen > MAX_ENTRIES:
                raise _TooBig(f"more than {MAX_ENTRIES} files under {WORKDIR}")
            path = posixpath.join(rel, e.name) if rel else e.name
            if e.kind == "dir":
                skip = e.name in SKIP_DIRS or e.name.endswith(".egg-info") or (
                    not rel and e.name in TOP_SKIP_DIRS and not spec.source_dir.startswith(e.name + "/"))
                if not skip:
                    await walk(path)
            elif not watched(spec, path):
                ignored.append(path)
            elif e.kind != "file":
                files[path] = e.kind
            elif e.size > MAX_FILE_BYTES:
                raise _TooBig(f"{path} is larger than {MAX_FILE_BYTES >> 20} MB")
            else:
                files[path] = await ws.read_file(posixpath.join(WORKDIR, path), max_bytes=MAX_FILE_BYTES)

    await walk("")
    return files, ignored


class _TooBig(Exception):
    pass


def starting_files(task: SweTask, clean: Mapping[str, Entry]) -> dict[str, Entry]:
    """What the agent started from: the clean files with the bug applied, less the hidden tests."""
    texts = {p: v.decode("utf-8") for p, v in clean.items() if isinstance(v, bytes) and p.endswith(".py")}
    start = dict(clean)
    for path, text in apply_patch(texts, task.bug_patch).items():
        start[path] = text.encode()
    for hidden in task.hidden_tests:
        start.pop(hidden, None)
    return start


async def swe_reward(task: SweTask | str | Path, agent_ws, *, start_workspace: StartWorkspace | None = None,
                     release_workspace: ReleaseWorkspace | None = None, user: str = TEST_USER) -> SweReward:
    """Score the agent's workspace `agent_ws` on `task` (a SweTask or its folder); see the module docstring.
    `start_workspace(spec)` makes the fresh workspace and `release_workspace(ws)` ends it (default:
    `open_workspace` and `close`; a warm pool: `pool.acquire`, `pool.release`). Without `start_workspace` the
    repository image is built from the task's Dockerfile first if this host lacks it; with one, the repository is
    the starter's business (e.g. `slime_env.envs.swe.local`: no Docker at all)."""
    task = task if isinstance(task, SweTask) else load_task(task)
    spec = task.repo_spec()
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    fresh_task = asyncio.create_task(_start_fresh(task, start_workspace, timings))
    fresh = None
    try:
        t = time.monotonic()
        try:
            agent_files, ignored = await read_watched(agent_ws, spec)
        except _TooBig as e:
            return _result(t0, timings, 0.0, "refused", f"the agent's repository is too large to review: {e}")
        except Exception as e:  # noqa: BLE001 - a dead or broken workspace is reward 0 with its reason
            return _result(t0, timings, 0.0, "error",
                           f"could not read the agent's workspace: {type(e).__name__}: {e}")
        timings["read"] = round(time.monotonic() - t, 4)
        try:
            fresh = await fresh_task
        except Exception as e:  # noqa: BLE001
            # before anything of the agent's is in it: the host's failure, never the agent's 0
            return _result(t0, timings, 0.0, "infra_error", f"could not start a clean workspace from {task.image}: "
                                                            f"{type(e).__name__}: {e}")
        t = time.monotonic()
        if task.image not in _clean_trees:  # repository images are immutable: read once per process
            clean_files, clean_other = await read_watched(fresh, spec)
            _clean_trees[task.image] = (clean_files, set(clean_other))
        clean, clean_other = _clean_trees[task.image]
        ignored = [p for p in ignored if p not in clean_other]  # new files outside the rules (scratch)
        try:
            start = starting_files(task, clean)
        except PatchError as e:
            return _result(t0, timings, 0.0, "error", f"the task's bug.patch does not apply to {task.image}: {e}")
        verdict = review(spec, start, agent_files, clean, ignored=tuple(ignored[:100]))
        timings["guard"] = round(time.monotonic() - t, 4)
        if not verdict.accepted:
            return _result(t0, timings, 0.0, "refused", verdict.reason, ignored_files=verdict.ignored)
        final = {p: v for p, v in start.items() if spec.is_source_path(p) and isinstance(v, bytes)}
        final.update({p: text.encode() for p, text in verdict.changed.items()})
        carried = {p: data for p, data in final.items() if data != clean.get(p)}
        return await _run_in(fresh, task, carried, user, t0, timings, changed_files=tuple(sorted(verdict.changed)),
                             ignored_files=verdict.ignored)
    finally:
        if fresh is None:  # not cancelled: a start cut short could leave its container behind
            try:
                fresh = await fresh_task
            except Exception:  # noqa: BLE001 - it failed: nothing to close
                fresh = None
        if fresh is not None:
            await (release_workspace or _close)(fresh)


async def run_hidden_tests(task: SweTask | str | Path, files: Mapping[str, bytes], *,
                           start_workspace: StartWorkspace | None = None,
                           release_workspace: ReleaseWorkspace | None = None, user: str = TEST_USER) -> SweReward:
    """The second half of `swe_reward` on its own: `files` (/repo-relative path -> content) written over a clean
    copy of the repository in a fresh workspace, then FAIL_TO_PASS + PASS_TO_PASS graded. No guard: what the
    clean copy alone stops (the tests that show a defence holds without the guard use it)."""
    task = task if isinstance(task, SweTask) else load_task(task)
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    fresh = await _start_fresh(task, start_workspace, timings)
    try:
        return await _run_in(fresh, task, dict(files), user, t0, timings, changed_files=tuple(sorted(files)))
    finally:
        await (release_workspace or _close)(fresh)


async def _start_fresh(task: SweTask, start_workspace: StartWorkspace | None, timings: dict):
    t = time.monotonic()
    if start_workspace is None:
        await ensure_image(task.repo_dockerfile, task.image)
    ws = await (start_workspace or _open)(reward_workspace_spec(task))
    timings["start"] = round(time.monotonic() - t, 4)
    return ws


def _result(t0: float, timings: dict, reward: float, status: str, reason: str, **kw) -> SweReward:
    timings["total"] = round(time.monotonic() - t0, 4)
    return SweReward(reward, status, reason, timings=dict(timings), **kw)


async def _run_in(fresh, task: SweTask, files: Mapping[str, bytes], user: str, t0: float, timings: dict,
                  **kw) -> SweReward:
    """Write `files` into the fresh workspace, run the tests as `user`, read the report host-side, grade it."""
    for path, data in sorted(files.items()):
        await fresh.write_file(posixpath.join(WORKDIR, path), data)
    t = time.monotonic()
    junit = f"/tmp/verdict-{secrets.token_hex(8)}.xml"
    run = await fresh.exec(grade.pytest_argv(task.test_paths, task.deselect, junit), cwd=WORKDIR, user=user,
                           env=grade.PYTEST_ENV, timeout_s=task.verifier_timeout_s)
    timings["tests"] = round(time.monotonic() - t, 4)
    kw["exit_code"] = run.exit_code
    if run.status == "timeout":
        return _result(t0, timings, 0.0, "timeout", f"the tests ran past {task.verifier_timeout_s:g}s", **kw)
    try:
        outcomes = grade.parse_junit(await fresh.read_file(junit),
                                     grade.test_files([*task.fail_to_pass, *task.pass_to_pass]))
    except FileNotFoundError:
        return _result(t0, timings, 0.0, "unresolved", f"pytest wrote no report (exit code {run.exit_code}; "
                                                       f"{(run.stderr or run.stdout)[-300:].strip()})", **kw)
    except grade.ET.ParseError as e:
        return _result(t0, timings, 0.0, "unresolved", f"pytest's report does not parse: {e}", **kw)
    g = grade.grade(outcomes, task.fail_to_pass, task.pass_to_pass)
    tests = {**g["fail_to_pass"], **g["pass_to_pass_failed"]}
    if g["resolved"] and run.exit_code == 0:
        return _result(t0, timings, 1.0, "resolved", g["reason"], tests=tests, **kw)
    reason = g["reason"] if not g["resolved"] else f"pytest exited {run.exit_code} although every test passed"
    return _result(t0, timings, 0.0, "unresolved", reason, tests=tests, **kw)
