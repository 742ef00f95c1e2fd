"""`Workspace`: one isolated, long-lived machine for one episode — the contract every backend meets.

A workspace starts from an image and lives until `close()` (or its wall time). Commands and file operations go
to a small static agent that is the workspace's first process (`agent.c`): a command costs a fork/exec inside
the workspace, not a `docker exec`. Backends (Docker, bubblewrap) only start and stop that agent and keep
snapshots; everything else is here, over `AgentConnection`.
"""

from __future__ import annotations

import abc
import asyncio
import errno
import io
import os
import posixpath
import tarfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import ClassVar

from slime_env.errors import InvalidInput
from slime_env.tools_sandbox.base import classify
from slime_env.tools_sandbox.types import ExecResult
from slime_env.tools_sandbox.workspace.protocol import AgentConnection, AgentGone
from slime_env.tools_sandbox.workspace.types import FileInfo, WorkspaceError, WorkspaceSpec

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_OUTPUT_LIMIT = 1 << 20
MAX_FILE_BYTES = 64 << 20
GRACE_S = 30.0  # how long past a command's own timeout the agent may take to answer before the workspace is dead
# (generous: killing a large process group and draining its output takes seconds on a busy 2-core host)


class Workspace(abc.ABC):
    """One isolated machine for one episode: run commands in it, read and write its files, snapshot and restore
    it, close it. Every method is a coroutine and safe to call concurrently (commands run side by side).

    - `exec(command, timeout_s=, cwd=, env=, user=, stdin=, output_limit_bytes=) -> ExecResult`: `command` is a
      shell string (run by `/bin/sh -c`) or an argv list. Never raises for anything the command does: a
      non-zero exit is status `error`, the timeout `timeout` (the command's process group is killed), output
      past the limit `output_limit` (killed, output cut), the memory limit `memory`. stdout and stderr come
      apart. What the command started in the background ends with it unless `detach=True`. A dead workspace
      (killed, wall time over, agent gone) raises `WorkspaceError`.
    - `read_file` / `write_file` / `list_dir`: files by absolute path (relative paths are under the workdir);
      `FileNotFoundError`, `IsADirectoryError`, `PermissionError` as for local files.
    - `upload(local, remote)` / `download(remote, local)`: a file or a whole folder.
    - `apply_diff(diff, cwd=)`: a unified diff applied strictly, from the host (no git needed in the image).
    - `snapshot() -> id` and `restore(id)`: the file system as it was (processes are not kept).
    - `kill_processes()`: kill every process but the workspace's own agent (before a verifier runs).
    - `close()`: remove the workspace and all it holds; idempotent.
    """

    backend: ClassVar[str] = "base"

    def __init__(self, spec: WorkspaceSpec, *, workspace_id: str):
        self.spec, self.id = spec, workspace_id
        self._agent: AgentConnection | None = None
        self._closed = self._stopped = False
        self._dead: str | None = None  # why the workspace died, once it has
        self._users: dict[str, tuple[int, int]] = {}
        self._cleanups: list[Callable[[], Awaitable[None]]] = []  # run once the backend has stopped
        self._oom_seen = 0  # the cgroup's OOM-kill count when last read (set once the agent is up)
        self.exec_s, self.commands = 0.0, 0  # time spent in commands, and how many ran (for metrics)
        self.started_at = time.monotonic()

    # --- backends implement these -------------------------------------------------------------------------
    @abc.abstractmethod
    async def _stop(self) -> None:
        """Remove what the backend made (container, mounts, folders). Called once, by `close()`."""

    @abc.abstractmethod
    async def _snapshot(self) -> str: ...

    @abc.abstractmethod
    async def _restore(self, snapshot: str) -> AgentConnection:
        """Bring the file system back to `snapshot` and return the new agent connection."""

    # --- the contract ------------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def workdir(self) -> str:
        """Where commands run unless told otherwise (the spec's, else the image's)."""
        return self.spec.workdir or "/"

    @property
    def default_user(self) -> str | None:
        """Who commands run as unless told otherwise (the spec's, else the image's; None: root)."""
        return self.spec.user

    @property
    def dead(self) -> str | None:
        """Why the workspace died (a limit, a kill, its agent gone), or None while it lives."""
        return self._dead

    def mark_dead(self, reason: str) -> None:
        """The workspace can no longer be used (its wall time passed, it was killed); later calls raise."""
        if self._dead is None:
            self._dead = reason
        if self._agent is not None:
            self._agent.close()

    def _connection(self) -> AgentConnection:
        if self._closed:
            raise WorkspaceError(f"workspace {self.id} is closed")
        if self._dead is not None:
            raise WorkspaceError(f"workspace {self.id} is dead: {self._dead}")
        if self._agent is None:
            raise WorkspaceError(f"workspace {self.id} has not started")
        return self._agent

    async def _call(self, op: str, timeout_s: float, **fields):
        agent = self._connection()
        try:
            async with asyncio.timeout(timeout_s):
                return await agent.request(op, **fields)
        except TimeoutError:
            self.mark_dead(f"its agent did not answer {op} within {timeout_s:g}s")
            raise WorkspaceError(f"workspace {self.id}: no answer to {op} within {timeout_s:g}s") from None
        except AgentGone as e:
            self.mark_dead(self._dead or f"its agent is gone ({e})")
            raise WorkspaceError(f"workspace {self.id} is dead: {self._dead}") from None

    async def exec(self, command: str | Sequence[str], *, timeout_s: float = DEFAULT_TIMEOUT_S, cwd: str | None = None,
                   env: Mapping[str, str] | None = None, user: str | int | None = None, stdin: bytes | str = b"",
                   output_limit_bytes: int = DEFAULT_OUTPUT_LIMIT, detach: bool = False) -> ExecResult:
        if isinstance(command, str):
            argv = ["/bin/sh", "-c", command]
        else:
            argv = [str(a) for a in command]
            if not argv:
                raise InvalidInput("exec: empty argv")
        if not (0 < timeout_s <= 7 * 86400):
            raise InvalidInput(f"exec: timeout_s must be in (0, 604800], got {timeout_s}")
        if not (1024 <= output_limit_bytes <= 1 << 30):
            raise InvalidInput(f"exec: output_limit_bytes must be in [1024, 2**30], got {output_limit_bytes}")
        for k, v in (env or {}).items():
            if not k or "=" in k or "\0" in k or "\0" in str(v):
                raise InvalidInput(f"exec: env entry {k!r} is not a NAME=value pair")
        uid, gid = await self._ids(user if user is not None else self.default_user)
        answer = await self._call(
            "exec", timeout_s + GRACE_S, argv=argv, env={**self.spec.env, **(env or {})},
            cwd=self._path(cwd) if cwd else self.workdir, stdin=stdin.encode() if isinstance(stdin, str) else stdin,
            timeout_ms=int(timeout_s * 1000), output_limit=output_limit_bytes, uid=uid, gid=gid, detach=detach)
        if "errno" in answer:
            reason = f"the workspace could not start the command: {os.strerror(answer['errno'])}"
            if answer["errno"] == errno.EAGAIN:
                reason += f" (its process limit of {self.spec.limits.pids} is used up; kill_processes() frees it)"
            return ExecResult(status="sandbox_error", backend=self.backend, reason=reason)
        if answer.get("spawn_error"):
            return ExecResult(status="error", exit_code=127, stderr=answer["spawn_error"], backend=self.backend,
                              reason=answer["spawn_error"])
        self.exec_s += answer["duration_s"]
        self.commands += 1
        status, reason = classify(exit_code=answer["exit_code"], timed_out=answer["timed_out"],
                                  output_exceeded=answer["output_exceeded"], oom=False,
                                  stderr=answer["stderr"].decode("utf-8", "replace"), timeout_s=timeout_s,
                                  memory_mb=self.spec.limits.memory_mb, output_limit_bytes=output_limit_bytes)
        if status == "error" and answer["exit_code"] in (-9, 137) and await self._oom_killed():
            status, reason = "memory", f"the workspace's memory limit of {self.spec.limits.memory_mb} MB was hit " \
                                       f"(the kernel killed a process)"
        return ExecResult(status=status, exit_code=answer["exit_code"],
                          stdout=answer["stdout"].decode("utf-8", "replace"),
                          stderr=answer["stderr"].decode("utf-8", "replace"), duration_s=answer["duration_s"],
                          truncated=answer["output_exceeded"], reason=reason, backend=self.backend)

    async def _oom_count(self) -> int | None:
        """The workspace cgroup's OOM-kill count (v2 `memory.events`, v1 `memory.oom_control`), None if unreadable."""
        for path in ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"):
            try:
                text = (await self.read_file(path)).decode()
            except OSError:
                continue
            for line in text.splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill" and value.strip().isdigit():
                    return int(value)
        return None

    async def _oom_killed(self) -> bool:
        """Whether the kernel's OOM killer struck since the last look (commands killed by SIGKILL ask)."""
        count = await self._oom_count()
        if count is None or count <= self._oom_seen:
            return False
        self._oom_seen = count
        return True

    async def read_file(self, path: str, *, max_bytes: int = MAX_FILE_BYTES) -> bytes:
        answer = await self._call("read", 60.0, path=self._path(path), max_bytes=max_bytes)
        _raise_errno(answer, path, whole_file=True)
        return answer["data"]

    async def write_file(self, path: str, data: bytes | str, *, mode: int = 0o644, user: str | int | None = None,
                         parents: bool = True) -> None:
        uid, gid = await self._ids(user) if user is not None else (-1, -1)
        answer = await self._call("write", 60.0, path=self._path(path),
                                  data=data.encode() if isinstance(data, str) else bytes(data), mode=mode, uid=uid,
                                  gid=gid, parents=parents)
        _raise_errno(answer, path, whole_file=True)

    async def list_dir(self, path: str) -> list[FileInfo]:
        answer = await self._call("list", 60.0, path=self._path(path))
        _raise_errno(answer, path)
        return answer["entries"]

    async def upload(self, local: str | os.PathLike, remote: str, *, user: str | int | None = None) -> None:
        """Copy a local file or folder to `remote` (a folder's contents go under `remote`; modes kept)."""
        local = Path(local)
        if not local.exists():
            raise FileNotFoundError(f"upload: {local} does not exist")
        files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
        for f in files:
            target = remote if local.is_file() else posixpath.join(remote, f.relative_to(local).as_posix())
            await self.write_file(target, f.read_bytes(), mode=f.stat().st_mode & 0o777, user=user)

    async def download(self, remote: str, local: str | os.PathLike) -> None:
        """Copy a file or folder of the workspace to `local` (symbolic links are skipped)."""
        local = Path(local)
        try:
            entries = await self.list_dir(remote)
        except NotADirectoryError:
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_bytes(await self.read_file(remote))
            return
        local.mkdir(parents=True, exist_ok=True)
        for e in entries:
            if e.kind in ("file", "dir"):
                await self.download(posixpath.join(self._path(remote), e.name), local / e.name)

    async def tar(self, remote: str) -> bytes:
        """A tar archive (in memory) of a workspace folder, as `download` would write it."""
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            await self._tar_into(tar, self._path(remote), ".")
        return buf.getvalue()

    async def _tar_into(self, tar: tarfile.TarFile, path: str, name: str) -> None:
        for e in await self.list_dir(path):
            full, arc = posixpath.join(path, e.name), posixpath.join(name, e.name)
            if e.kind == "dir":
                info = tarfile.TarInfo(arc)
                info.type, info.mode = tarfile.DIRTYPE, e.mode & 0o7777
                tar.addfile(info)
                await self._tar_into(tar, full, arc)
            elif e.kind == "file":
                data = await self.read_file(full)
                info = tarfile.TarInfo(arc)
                info.size, info.mode = len(data), e.mode & 0o7777
                tar.addfile(info, io.BytesIO(data))

    async def apply_diff(self, diff: str, *, cwd: str | None = None) -> list[str]:
        """Apply a unified diff to the files under `cwd` (default: the workdir), strictly (`diffs.DiffError` names
        the file and hunk that does not match; nothing is written then); returns the paths changed."""
        from slime_env.tools_sandbox.workspace.diffs import apply_unified_diff

        root = self._path(cwd) if cwd else self.workdir

        async def read(path: str) -> bytes | None:
            try:
                return await self.read_file(posixpath.join(root, path))
            except FileNotFoundError:
                return None

        async def write(path: str, data: bytes) -> None:
            full = posixpath.join(root, path)
            try:
                mode = next(e.mode for e in await self.list_dir(posixpath.dirname(full))
                            if e.name == posixpath.basename(full)) & 0o7777
            except (FileNotFoundError, NotADirectoryError, StopIteration):
                mode = 0o644
            await self.write_file(full, data, mode=mode)

        async def delete(path: str) -> None:
            result = await self.exec(["rm", "-f", "--", posixpath.join(root, path)], user=0)
            if not result.ok:
                raise OSError(f"removing {path}: {result.stderr.strip() or result.reason}")

        return await apply_unified_diff(diff, read=read, write=write, delete=delete)

    async def snapshot(self) -> str:
        """Keep the file system as it is now; returns an id for `restore`."""
        self._connection()
        return await self._snapshot()

    async def restore(self, snapshot: str) -> None:
        """Bring the file system back to `snapshot` (running processes end)."""
        self._connection()
        self._agent.close()
        self._agent = await self._restore(snapshot)
        self._users.clear()

    async def kill_processes(self) -> int:
        """Kill every process in the workspace but its agent; returns how many were killed."""
        answer = await self._call("killall", 30.0)
        return answer["killed"]

    async def kill(self, reason: str) -> None:
        """Stop the workspace now (a limit was hit); later calls raise `WorkspaceError` naming `reason`."""
        self.mark_dead(reason)
        await self._stop_once()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._agent is not None:
            self._agent.close()
        await self._stop_once()

    async def _stop_once(self) -> None:
        if not self._stopped:
            self._stopped = True
            try:
                await self._stop()
            finally:
                for cleanup in self._cleanups:
                    await cleanup()

    def on_stop(self, cleanup: Callable[[], Awaitable[None]]) -> None:
        """Run `await cleanup()` once the workspace has stopped (shared resources it held: networks, proxies)."""
        self._cleanups.append(cleanup)

    async def __aenter__(self) -> Workspace:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- helpers -------------------------------------------------------------------------------------------
    def _path(self, path: str) -> str:
        if not isinstance(path, str) or not path or "\0" in path:
            raise InvalidInput(f"workspace path must be a non-empty string, got {path!r}")
        return posixpath.normpath(path if path.startswith("/") else posixpath.join(self.workdir, path))

    async def _ids(self, user: str | int | None) -> tuple[int, int]:
        """(uid, gid) of `user` in the workspace's own /etc/passwd; (-1, -1): the agent's (root)."""
        if user is None:
            return -1, -1
        key = str(user)
        if key not in self._users:
            if key.isdigit():
                uid = int(key)
                gid = next((g for u, g in (await self._passwd()).values() if u == uid), uid)
                self._users[key] = (uid, gid)
            else:
                users = await self._passwd()
                if key not in users:
                    raise InvalidInput(f"user {key!r} does not exist in workspace image {self.spec.image!r}")
                self._users[key] = users[key]
        return self._users[key]

    async def _passwd(self) -> dict[str, tuple[int, int]]:
        try:
            text = (await self.read_file("/etc/passwd")).decode("utf-8", "replace")
        except FileNotFoundError:
            return {}
        users = {}
        for line in text.splitlines():
            parts = line.split(":")
            if len(parts) >= 4 and parts[2].isdigit() and parts[3].isdigit():
                users[parts[0]] = (int(parts[2]), int(parts[3]))
        return users


def _raise_errno(answer: dict, path: str, *, whole_file: bool = False) -> None:
    """The OSError subclass a local file operation would raise for the agent's errno, naming `path`. To a read or
    write of a whole file (`whole_file`) the agent answers EINVAL for a file that is not a regular one (a named
    pipe, socket or device), which it never opens blocking: its loop would wait for the other end."""
    code = answer.get("errno")
    if code == errno.EINVAL and whole_file:
        raise OSError(code, "not a regular file (a named pipe, socket or device): files are read and written whole",
                      path)
    if code:
        raise _ERRORS.get(code, OSError)(code, os.strerror(code), path)


_ERRORS = {errno.ENOENT: FileNotFoundError, errno.EISDIR: IsADirectoryError, errno.ENOTDIR: NotADirectoryError,
           errno.EACCES: PermissionError, errno.EPERM: PermissionError, errno.EEXIST: FileExistsError}
