"""`WorkspaceEnv` (`Workspace-v0`): an agent works in its own container for the episode, with the tools agent
frameworks use — `bash` (state kept between calls), `str_replace_editor` (view / create / str_replace / insert /
undo_edit), `search` (grep over files), `submit`. The task's prompt is the instruction; its workspace comes from
`task.metadata["workspace"]` (`{"image": ..., "workdir": ..., "env": ..., "limits": {...}}`) or the env's `spec`.

When the agent submits (or answers without a tool call, or runs out of turns), `verify(task, workspace)` scores
the episode — subclasses put their verifier there (Harbor tasks, SWE tasks). The reward never comes from anything
the agent could write unless the verifier says so: the default verifier is the env's rubric, whose functions get
the workspace in `state` and decide for themselves what to trust.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import posixpath
from collections.abc import AsyncIterator, Mapping
from typing import Any

from slime_env import Action, InvalidInput, Message, Task
from slime_env.errors import InfraError
from slime_env.tool_env import Rubric, StatefulToolEnv
from slime_env.tools import ToolError, tool
from slime_env.tools_sandbox.types import SandboxError
from slime_env.tools_sandbox.workspace import Limits, Workspace, WorkspaceError, WorkspaceSpec

from slime_env.envs.workspace import editor, shell

SYSTEM_PROMPT = ("You are an autonomous agent working in a Linux machine of your own. Use the tools to inspect and "
                 "change files and to run commands. When the task is done, call `submit`.")
TOOL_NAMES = ("bash", "str_replace_editor", "search", "submit")
DEFAULT_IMAGE = "python:3.11-slim"  # the default task's (built locally by `slime-env workspace build-base` if need be)


@contextlib.asynccontextmanager
async def starting_workspace(what: str = "the workspace") -> AsyncIterator[None]:
    """Around the start of a workspace, before the agent has touched it: a sandbox, OS or timeout error there (an image
    missing, the Docker engine failing, a start that hangs) is the host's — raised as InfraError, so the episode is
    `infra_error` and never a 0. A task that names no workspace (InvalidInput) stays the task's error."""
    try:
        yield
    except (SandboxError, OSError, TimeoutError) as e:
        raise InfraError(f"{what} did not start: {type(e).__name__}: {e}") from e


def _workspace(state: Mapping[str, Any]) -> Workspace:
    ws = state.get("workspace")
    if ws is None:
        raise ToolError("this episode has no workspace")
    return ws


async def _read_text(ws: Workspace, path: str) -> str:
    try:
        data = await ws.read_file(path)
    except FileNotFoundError:
        raise ToolError(f"The path {path} does not exist.") from None
    except IsADirectoryError:
        raise ToolError(f"The path {path} is a directory.") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ToolError(f"{path} is not a UTF-8 text file.") from None


VIEW_BYTES = 256 << 10  # a file larger than this is viewed through the workspace, never read whole into this process


async def _large_file(ws: Workspace, path: str) -> int | None:
    """The size of `path` when it is a regular file over VIEW_BYTES, else None (small, missing, or a folder)."""
    try:
        entry = next((e for e in await ws.list_dir(posixpath.dirname(path) or "/")
                      if e.name == posixpath.basename(path)), None)
    except (FileNotFoundError, NotADirectoryError, PermissionError, WorkspaceError):
        return None
    return entry.size if entry is not None and entry.kind == "file" and entry.size > VIEW_BYTES else None


async def _view_large(ws: Workspace, path: str, size: int, view_range: list[int] | None) -> str:
    """`view` of a file over VIEW_BYTES: its first VIEW_BYTES, or the lines of `view_range`, read in the workspace
    (`head` / `sed`): a 60 MB file cost this process 380 MB to show 10,000 characters."""
    if view_range is None:
        start, argv = 1, ["head", "-c", str(VIEW_BYTES), "--", path]
    else:
        if len(view_range) != 2 or not all(isinstance(n, int) for n in view_range) or view_range[0] < 1 \
                or (view_range[1] != -1 and view_range[1] < view_range[0]):
            raise ToolError("view_range must be two integers [start, end] (end -1: to the end of the file)")
        start, end = view_range
        argv = ["sed", "-n", f"{start},$p" if end == -1 else f"{start},{end}p;{end}q", "--", path]
    result = await ws.exec(argv, timeout_s=60, output_limit_bytes=VIEW_BYTES)
    if result.status not in ("ok", "output_limit") or (result.exit_code and result.status == "ok"):
        raise ToolError(result.stderr.strip() or result.reason or f"cannot read {path}")
    text = result.stdout
    cut = result.status == "output_limit" or (view_range is None and size > VIEW_BYTES)
    if cut:
        text = text[:text.rfind("\n") + 1] if "\n" in text else text  # whole lines only
    note = (f"\n[{path} is {size:,} bytes: only the lines shown fit; view_range shows any other lines]"
            if cut else "")
    return f"Here's the result of running `cat -n` on {path}:\n{editor.numbered(text, start)}\n{note}"


def make_tools(*, command_timeout_s: float = 60.0, max_search_results: int = 50) -> list:
    """The workspace tools (each takes the hidden `state`: `workspace`, `edits`)."""

    async def bash(command: str, timeout: int | None = None, *, state: dict) -> str:
        """Run a bash command in the workspace. The shell's state (working directory, variables, functions) is kept
        between calls. Long-running commands are killed after the timeout.

        Args:
            command: The bash command to run.
            timeout: Seconds before the command is killed (default and maximum: the env's command timeout).
        """
        ws = _workspace(state)
        limit = min(float(timeout), command_timeout_s) if timeout and timeout > 0 else command_timeout_s
        argv, env = shell.argv(command)
        try:
            result = await ws.exec(argv, env=env, timeout_s=limit)
        except WorkspaceError as e:
            raise ToolError(str(e)) from None
        return shell.format_result(result, limit)

    async def str_replace_editor(command: str, path: str, file_text: str | None = None, old_str: str | None = None,
                                 new_str: str | None = None, insert_line: int | None = None,
                                 view_range: list[int] | None = None, *, state: dict) -> str:
        """View, create and edit files. `view` shows a file with line numbers (or a directory two levels deep);
        `create` writes a new file; `str_replace` replaces `old_str`, which must occur exactly once, by `new_str`;
        `insert` puts `new_str` after line `insert_line` (0: at the top); `undo_edit` reverts the last edit of `path`.

        Args:
            command: One of view, create, str_replace, insert, undo_edit.
            path: Absolute path of the file or directory (relative paths are under the working directory).
            file_text: The content of the new file (create).
            old_str: The exact text to replace (str_replace).
            new_str: The replacement (str_replace) or the text to insert (insert).
            insert_line: The line after which to insert (insert).
            view_range: [start, end] lines to show (view; end -1 for the rest of the file).
        """
        ws = _workspace(state)
        full = posixpath.normpath(path if path.startswith("/") else posixpath.join(ws.workdir, path))
        edits: dict[str, list[bytes | None]] = state.setdefault("edits", {})
        if command == "view":
            large = await _large_file(ws, full)
            if large is not None:
                return await _view_large(ws, full, large, view_range)
            try:
                return editor.view_file(full, await _read_text(ws, full), view_range)
            except ToolError as e:
                if "is a directory" not in str(e):
                    raise
            listing = await ws.exec(["find", full, "-maxdepth", "2", "-not", "-path", "*/.*"], timeout_s=30)
            return (f"Here's the files and directories up to 2 levels deep in {full}, excluding hidden items:\n"
                    f"{listing.stdout}")
        if command == "create":
            if file_text is None:
                raise ToolError("create needs file_text")
            try:
                previous = await ws.read_file(full)
            except FileNotFoundError:
                previous = None
            except IsADirectoryError:
                raise ToolError(f"The path {full} is a directory.") from None
            if previous is not None:
                raise ToolError(f"File already exists at: {full}. Cannot overwrite files using command `create`.")
            await ws.write_file(full, file_text)
            edits.setdefault(full, []).append(None)
            return f"File created successfully at: {full}"
        if command in ("str_replace", "insert"):
            text = await _read_text(ws, full)
            if command == "str_replace":
                if old_str is None:
                    raise ToolError("str_replace needs old_str")
                result, message = editor.str_replace(full, text, old_str, new_str or "")
            else:
                if insert_line is None or new_str is None:
                    raise ToolError("insert needs insert_line and new_str")
                result, message = editor.insert(full, text, insert_line, new_str)
            mode = next((e.mode for e in await ws.list_dir(posixpath.dirname(full))
                         if e.name == posixpath.basename(full)), 0o644) & 0o7777
            await ws.write_file(full, result, mode=mode)
            edits.setdefault(full, []).append(text.encode())
            return message
        if command == "undo_edit":
            history = edits.get(full)
            if not history:
                raise ToolError(f"No edit history found for {full}.")
            previous = history.pop()
            if previous is None:
                await ws.exec(["rm", "-f", "--", full], timeout_s=30)
                return f"Last edit to {full} undone: the file it created is removed."
            await ws.write_file(full, previous)
            return f"Last edit to {full} undone successfully.\n{editor.numbered(previous.decode())}"
        raise ToolError(f"Unknown command {command!r}: use view, create, str_replace, insert or undo_edit")

    async def search(pattern: str, path: str = ".", include: str | None = None, *, state: dict) -> str:
        """Search file contents for a regular expression (grep -E), recursively; lists `file:line:text` matches.

        Args:
            pattern: The extended regular expression to look for.
            path: The file or directory to search (default: the working directory).
            include: Only files whose name matches this glob, e.g. "*.py".
        """
        ws = _workspace(state)
        argv = ["grep", "-rnIE", "--exclude-dir=.git", *([f"--include={include}"] if include else []), "--",
                pattern, path]
        # what is shown (max_search_results lines of 300 characters) fits many times in the limit; past it grep is
        # stopped and its first matches are shown
        result = await ws.exec(argv, timeout_s=60, output_limit_bytes=256 << 10)
        cut = result.status == "output_limit"
        if result.exit_code == 1 and not cut:
            return f"No matches for {pattern!r} in {path}."
        if not cut and (result.exit_code not in (0, None) or result.status != "ok"):
            raise ToolError(result.stderr.strip() or result.reason or f"grep failed ({result.exit_code})")
        lines = result.stdout.splitlines()[:-1] if cut else result.stdout.splitlines()  # the last may be cut
        shown = "\n".join(line[:300] for line in lines[:max_search_results])
        more = len(lines) - max_search_results
        if cut:
            return shown + "\n[more matches not shown: there are too many; narrow the search]"
        return shown + (f"\n[{more} more matches not shown; narrow the search]" if more > 0 else "")

    async def submit(*, state: dict) -> str:
        """Submit your work: call this once the task is done. The episode ends and your work is checked."""
        state["submitted"] = True
        return "Submitted."

    return [tool(fn, hidden=["state"]) for fn in (bash, str_replace_editor, search, submit)]


class WorkspaceEnv(StatefulToolEnv):
    """Agentic tasks in a per-episode workspace (see the module docstring).

    `spec` (or `image`): the workspace when the task names none; `backend` (docker | bwrap | auto) and `pool`
    (default: the process's shared pool for the backend, keeping `warm` started workspaces per spec; None, the
    default, sizes it from the run's concurrency — see `slime_env.tools_sandbox.workspace.pool`).
    `command_timeout_s` bounds each bash call, `max_turns` the episode. Override `workspace_spec(task)`,
    `prepare(task, ws)` (after start, before the agent) and `verify(task, ws)` (-> reward, info) for a task family.
    """

    def __init__(self, *, spec: WorkspaceSpec | None = None, image: str | None = None, backend: str = "docker",
                 pool: Any = None, system_prompt: str | None = SYSTEM_PROMPT, max_turns: int | None = 30,
                 command_timeout_s: float = 60.0, rubric: Rubric | Any = None, tasks: Any = None,
                 parser: str | None = None, max_output_chars: int = 10000, warm: int | None = None):
        if spec is None and image is not None:
            spec = WorkspaceSpec(image=image)
        self.spec, self.backend, self.pool, self.warm = spec, backend, pool, warm
        self.command_timeout_s = command_timeout_s
        super().__init__(make_tools(command_timeout_s=command_timeout_s), hidden_args=("state",),
                         system_prompt=system_prompt, max_turns=max_turns, rubric=rubric, tasks=tasks, parser=parser,
                         tool_timeout_s=command_timeout_s + 30.0, max_parallel_calls=1,
                         max_output_chars=max_output_chars)

    # --- the workspace of an episode -------------------------------------------------------------------
    def workspace_spec(self, task: Task) -> WorkspaceSpec:
        """The task's workspace: `task.metadata["workspace"]` over the env's `spec`."""
        given = dict((task.metadata or {}).get("workspace") or {})
        if not given:
            if self.spec is None:
                raise InvalidInput(f"{type(self).__name__}: the task names no workspace (metadata['workspace']) "
                                   "and the env has no spec/image")
            return self.spec
        base = self.spec or WorkspaceSpec(image=given.get("image") or "")
        limits = given.pop("limits", None)
        spec = dataclasses.replace(base, **{k: v for k, v in given.items() if k in ("image", "workdir", "env", "user")})
        if limits:
            spec = dataclasses.replace(spec, limits=dataclasses.replace(spec.limits or Limits(), **limits))
        return spec

    async def setup_state(self, task: Task) -> Mapping[str, Any]:
        from slime_env.tools_sandbox.workspace.pool import shared_pool

        pool = self.pool or shared_pool(self.backend, warm=self.warm)
        t = time.perf_counter()
        spec = self.workspace_spec(task)
        async with starting_workspace():
            ws = await pool.acquire(spec)
        state = {"state": None, "workspace": ws, "pool": pool, "edits": {}, "submitted": False, "verify_s": 0.0}
        state["state"] = state  # the tools' one hidden argument: this dict
        try:
            async with starting_workspace("the workspace's preparation"):  # still before the agent's first action
                await self.prepare(task, ws)
        except BaseException:
            await pool.release(ws)
            raise
        state["start_s"] = time.perf_counter() - t
        return state

    async def cleanup_state(self, state: dict[str, Any]) -> None:
        ws = state.get("workspace")
        if ws is not None:
            state["workspace"] = None
            await state["pool"].release(ws)

    async def prepare(self, task: Task, ws: Workspace) -> None:
        """Set the workspace up for the task after it starts (default: nothing)."""

    # --- ending and scoring ---------------------------------------------------------------------------
    def is_done(self, action: Action) -> bool:
        if any(call.name == "submit" for call in action.tool_calls):
            return True
        return super().is_done(action)

    async def finish(self, action: Action):
        other = [c for c in action.tool_calls if c.name != "submit"]
        obs: list[Message] = []
        if other:  # a turn that does work and submits: the work happens first
            obs = await self.run_tools(dataclasses.replace(action, tool_calls=tuple(other)))
        self.state["submitted"] = any(c.name == "submit" for c in action.tool_calls)
        info = self.step_info()
        reward, details = await self._timed_verify()
        info.update(details)
        info["workspace"] = self.workspace_metrics()
        return obs, reward, True, False, info

    async def verify(self, task: Task, ws: Workspace) -> tuple[float, dict[str, Any]]:
        """The episode's reward and what to record of it (default: the rubric, with the workspace in `state`)."""
        if self.rubric is None:
            return 0.0, {}
        context = self.reward_context(Action(text=self.history[-1].content if self.history else ""), {})
        reward, scores = await self.rubric.score(context)
        return reward, {"rubric": scores}

    async def step(self, action: Action):
        obs, reward, terminated, truncated, info = await super().step(action)
        dead = getattr(self.state.get("workspace"), "dead", None)
        if dead is not None and not terminated:
            # Nothing can run or be verified any more: the episode ends now. The workspace was in the agent's hands
            # (a limit it hit, a process it killed, a disk it filled): the agent's outcome, truncated with reward 0 and
            # the reason — never a status the trainer leaves out, or an agent could escape a sure 0 by breaking it.
            return obs, 0.0, False, True, {**info, "workspace_dead": dead}
        if truncated and not terminated:  # out of turns: the work done so far is still checked, as Harbor does
            verified, details = await self._timed_verify()
            info = {**info, **details, "workspace": self.workspace_metrics()}
            reward += verified
        return obs, reward, terminated, truncated, info

    async def _timed_verify(self) -> tuple[float, dict[str, Any]]:
        t = time.perf_counter()
        try:
            ws = self.state["workspace"]
            # Nothing the agent started may run beside the verifier: a process that left the command's group
            # (`setsid`, a daemon) would otherwise rewrite the tests or results the verifier writes and reads.
            killed = await kill_before_verify(ws)
            reward, details = await self.verify(self.task, ws)
            return reward, {**details, "killed_before_verify": killed}
        finally:
            self.state["verify_s"] = self.state.get("verify_s", 0.0) + time.perf_counter() - t

    def workspace_metrics(self) -> dict[str, int]:
        """What the episode did in its workspace (deterministic, in the step's `info`): the commands it ran. The
        seconds go to `episode_timings()`, which the runner records in the trajectory's `timings`."""
        ws = self.state.get("workspace")
        self._timings = {"container_start_s": self.state.get("start_s", 0.0),
                         "container_exec_s": getattr(ws, "exec_s", 0.0),
                         "container_verify_s": self.state.get("verify_s", 0.0)}
        return {"commands": getattr(ws, "commands", 0)}

    def episode_timings(self) -> dict[str, float]:
        """Seconds of the last episode in its workspace: starting it, in its commands, scoring it."""
        return dict(getattr(self, "_timings", {}))

    def default_tasks(self):
        """Without tasks: one chore in the default image (what Gymnasium's checker and demos reset with)."""
        return [Task(prompt="Write the kernel's name (`uname -s`) into /tmp/kernel.txt, then call submit.",
                     metadata={"workspace": {"image": DEFAULT_IMAGE}})]


async def kill_before_verify(ws: Workspace) -> int:
    """Kill every process of the workspace but its own agent (its PID namespace: `setsid` does not escape it);
    how many. A workspace that is already dead runs nothing: 0."""
    try:
        return await ws.kill_processes()
    except WorkspaceError:
        return 0


__all__ = ["SYSTEM_PROMPT", "TOOL_NAMES", "WorkspaceEnv", "kill_before_verify", "make_tools"]
