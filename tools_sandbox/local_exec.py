"""Spawning one sandboxed process on this host and collecting its output under limits.

Shared by the bubblewrap and plain-process backends. The process leads its own session (so its whole
process group can be killed), stdout and stderr are read concurrently and cut at a byte limit (the
process is killed then), and a wall-clock timer kills it. No `preexec_fn`: forking a large,
multi-threaded training process with Python code to run in the child is slow and can deadlock, so
rlimits are applied by exec-ing through util-linux `prlimit`.
"""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from slime_env.tools_sandbox.base import classify
from slime_env.tools_sandbox.types import ExecRequest, ExecResult


KILL_WAIT_S = 30.0


@dataclass(slots=True)
class Outcome:
    exit_code: int | None
    stdout: bytes
    stderr: bytes
    timed_out: bool
    output_exceeded: bool
    duration_s: float


def prlimit_argv(*, memory_mb: int, cpu_s: int, fsize_mb: int, nofile: int, nproc: int | None) -> list[str]:
    """`prlimit` options that lower this run's rlimits before it execs the sandbox."""
    argv = ["prlimit", f"--as={memory_mb << 20}", f"--cpu={cpu_s}:{cpu_s + 1}", f"--fsize={fsize_mb << 20}",
            f"--nofile={nofile}", "--core=0"]
    if nproc is not None:
        argv.append(f"--nproc={nproc}")
    return [*argv, "--"]


def memfd(name: str, data: bytes) -> int:
    """A file in memory holding `data`, positioned at 0 (no temp file is ever left on disk)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


async def spawn(argv: Sequence[str], *, env: dict[str, str], cwd: str | None, stdin_fd: int,
                pass_fds: Sequence[int] = (), timeout_s: float, output_limit: int,
                user: int | None = None, after_start: Callable[[int], object] | None = None,
                kill_tree: Callable[[], None] | None = None) -> Outcome:
    """Run `argv` to completion under a wall-clock `timeout_s` and an output limit.

    `after_start(pid)` runs once the process exists (may be a coroutine function). `kill_tree()` kills
    everything the run started (default: its process group); it runs on timeout, on the output limit,
    on cancellation, and after a normal exit (so background children do not outlive the run).
    """
    t0 = time.perf_counter()
    loop = asyncio.get_running_loop()
    ids = {} if user is None else {"user": user, "group": user, "extra_groups": []}
    # Creation is shielded: Python 3.11 can wait forever for a child whose creation was cancelled half-way
    # (asyncio closes it and waits for it to exit, with nothing that kills what it started). A cancelled
    # caller lets it finish, then kills the whole run below.
    creation = asyncio.ensure_future(loop.subprocess_exec(
        lambda: _Protocol(loop), *argv, stdin=stdin_fd, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=env, cwd=cwd, pass_fds=tuple(pass_fds), start_new_session=True, **ids))
    cancelled = False
    while True:
        try:
            transport, protocol = await asyncio.shield(creation)
            break
        except asyncio.CancelledError:
            if creation.cancelled():
                raise
            cancelled = True  # finish creating, then clean up and re-raise
    pid = transport.get_pid()
    if cancelled:
        _kill_group(pid, kill_tree)
        async with asyncio.timeout(KILL_WAIT_S):
            await asyncio.shield(protocol.exited)
        transport.close()
        raise asyncio.CancelledError()

    def kill() -> None:
        _kill_group(pid, kill_tree)

    out, err = bytearray(), bytearray()
    exceeded = False

    async def pump(stream: asyncio.StreamReader, buf: bytearray) -> None:
        nonlocal exceeded
        while True:
            chunk = await stream.read(65536)
            if not chunk:
                return
            room = output_limit - len(out) - len(err)
            buf += chunk[:max(room, 0)]
            if len(chunk) > room:
                exceeded = True
                kill()
                return

    timed_out = False
    pumps: asyncio.Future | None = None
    try:
        if after_start is not None:
            result = after_start(pid)
            if asyncio.iscoroutine(result):
                await result
        pumps = asyncio.gather(pump(protocol.stdout, out), pump(protocol.stderr, err))
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(protocol.exited)  # a bare future awaited under a timeout would be cancelled
        except TimeoutError:
            timed_out = True
        kill()  # the main process is gone or over time: nothing it started may outlive it
        async with asyncio.timeout(KILL_WAIT_S):  # a process stuck in the kernel (D state) cannot die at once
            await asyncio.shield(protocol.exited)
        try:
            async with asyncio.timeout(2.0):  # pipes close once every holder is dead
                await pumps
        except TimeoutError:
            pumps.cancel()
            pumps.add_done_callback(_consume)
    except BaseException:
        kill()
        if pumps is not None:
            pumps.cancel()
            pumps.add_done_callback(_consume)
        try:
            async with asyncio.timeout(KILL_WAIT_S):
                await asyncio.shield(protocol.exited)
        finally:
            transport.close()
            raise
    code = transport.get_returncode()
    transport.close()
    return Outcome(exit_code=None if timed_out else code, stdout=bytes(out), stderr=bytes(err),
                   timed_out=timed_out, output_exceeded=exceeded, duration_s=time.perf_counter() - t0)


def _kill_group(pid: int, kill_tree: Callable[[], None] | None) -> None:
    if kill_tree is not None:
        kill_tree()
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _consume(future: asyncio.Future) -> None:
    """Retrieve a cancelled reader's outcome, so asyncio does not log it as never retrieved."""
    if not future.cancelled():
        future.exception()


class _Protocol(asyncio.subprocess.SubprocessStreamProtocol):
    """Signals the exit of the process itself. (`Process.wait()` in Python 3.11 also waits for its pipes to
    close, which a background child holding them open would delay until the timeout.)"""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        super().__init__(limit=1 << 16, loop=loop)
        self.exited: asyncio.Future[None] = loop.create_future()

    def process_exited(self) -> None:
        super().process_exited()
        if not self.exited.done():
            self.exited.set_result(None)


class Slots:
    """The `size` concurrency slots of a sandbox. A run takes one: its index (e.g. for a per-slot cgroup) and,
    as root, its own unprivileged uid (`uid_base + index`), so RLIMIT_NPROC counts that run's processes
    only and runs cannot signal each other. Not root: the uid is None (runs keep ours)."""

    def __init__(self, size: int, uid_base: int):
        self.uid_base = uid_base if os.geteuid() == 0 else None
        self._free = list(range(size))

    def acquire(self) -> tuple[int, int | None]:
        index = self._free.pop()
        return index, (None if self.uid_base is None else self.uid_base + index)

    def release(self, index: int) -> None:
        self._free.append(index)


def nproc_limit(uid: int | None, pids_limit: int) -> int:
    """RLIMIT_NPROC for a run: counted per uid, so without a uid of its own the run shares this user's count."""
    if uid is not None:
        return pids_limit
    me, n = os.getuid(), 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                n += entry.stat().st_uid == me
            except OSError:
                pass
    return n + pids_limit


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (possibly another user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clamp_limits(memory_mb: int) -> int:
    """Never ask for more memory than this process may have (prlimit cannot raise a hard limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        return min(memory_mb, hard >> 20)
    return memory_mb


def decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def outcome_result(outcome: Outcome, request: ExecRequest, backend: str, *, oom: bool = False) -> ExecResult:
    """The `ExecResult` of a local run: its status from what happened to the process."""
    stderr = decode(outcome.stderr)
    status, reason = classify(exit_code=outcome.exit_code, timed_out=outcome.timed_out,
                              output_exceeded=outcome.output_exceeded, oom=oom, stderr=stderr,
                              timeout_s=request.timeout_s, memory_mb=request.memory_mb,
                              output_limit_bytes=request.output_limit_bytes)
    return ExecResult(status, exit_code=outcome.exit_code, stdout=decode(outcome.stdout), stderr=stderr,
                      duration_s=outcome.duration_s, truncated=outcome.output_exceeded, reason=reason, backend=backend)
