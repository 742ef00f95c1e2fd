"""Spawning one sandboxed process on this host and collecting its output under limits.

Shared by the bubblewrap and plain-process backends. The process leads its own session (so its whole
process group can be killed), stdout and stderr are read concurrently and cut at a byte limit (the
process is killed then), and a wall-clock timer kills it. No `preexec_fn` and no `user=`: either makes
Python fork() the calling process, which copies its page tables — 20 ms a run from a 2.5 GB trainer, ~100 ms
from a process that has loaded a few models — and forking a multi-threaded process with Python code to run in the
child can deadlock. Instead the child is spawned with vfork (half a millisecond, whatever the caller's size) and
execs through util-linux: `setpriv` drops to the run's uid, `prlimit` lowers its rlimits.
"""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import socket
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


def as_user(argv: Sequence[str], uid: int | None) -> list[str]:
    """`argv` run as `uid` (its own group, no supplementary groups) through util-linux `setpriv`; unchanged for
    None."""
    if uid is None:
        return list(argv)
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *argv]


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
    # Creation is shielded: Python 3.11 can wait forever for a child whose creation was cancelled half-way
    # (asyncio closes it and waits for it to exit, with nothing that kills what it started). A cancelled
    # caller lets it finish, then kills the whole run below.
    creation = asyncio.ensure_future(loop.subprocess_exec(
        lambda: _Protocol(loop), *as_user(argv, user), stdin=stdin_fd, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=env, cwd=cwd, pass_fds=tuple(pass_fds), start_new_session=True))
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
    as root, its own unprivileged uid, so RLIMIT_NPROC counts that run's processes only and runs cannot signal
    each other or open each other's /proc entries (a solution writing forged reports into every pipe it can reach).

    The uids are leased machine-wide from `uid_base` .. `uid_base + UID_SPAN - 1`, not numbered per sandbox: two
    sandboxes (two rollout workers, two trainers on one host) would otherwise hand the same uid to concurrent runs.
    A lease is an abstract unix socket bound to the uid's name: the kernel keeps the name unique on the host and
    frees it when the holder closes it or dies, so nothing is left to clean up after a crash. Not root: the uid is
    None (runs keep ours)."""

    UID_SPAN = 1000

    def __init__(self, size: int, uid_base: int):
        self.uid_base = uid_base if os.geteuid() == 0 else None
        self._free = list(range(size))
        self._uids: dict[int, int] = {}  # slot -> its leased uid, kept for the sandbox's life
        self._leases: list[socket.socket] = []

    def acquire(self) -> tuple[int, int | None]:
        index = self._free.pop()
        if self.uid_base is None:
            return index, None
        if index not in self._uids:
            self._uids[index] = self._lease()
        return index, self._uids[index]

    def release(self, index: int) -> None:
        self._free.append(index)

    def _lease(self) -> int:
        for uid in range(self.uid_base, self.uid_base + self.UID_SPAN):
            lease = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                lease.bind(f"\0slime_env-sandbox-uid-{uid}")
            except OSError:  # another sandbox, here or in another process, holds it
                lease.close()
                continue
            self._leases.append(lease)
            return uid
        raise RuntimeError(f"no free sandbox uid in {self.uid_base}..{self.uid_base + self.UID_SPAN - 1}: "
                           f"{self.UID_SPAN} concurrent runs of sandboxes on this host hold them all")

    def close(self) -> None:
        """Give the uids back (also done by the kernel when this process ends)."""
        for lease in self._leases:
            lease.close()
        self._leases, self._uids = [], {}


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
