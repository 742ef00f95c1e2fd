"""The fork-server mode of `BwrapSandbox`: one long-lived bubblewrap sandbox per concurrency slot.

Each slot's sandbox runs the sandbox agent (`slime_env.tools_sandbox.agent`, the same code that runs inside the
Docker backend's containers) as PID 1 of the sandbox's pid namespace, under the slot's uid and cgroup,
started with the flags runs use (`python -s -u`, the sandbox environment). For every run it forks a
fresh child that runs the code — Python in the pre-started interpreter itself, no new interpreter to
start — with the run's rlimits; afterwards it kills every other process of the sandbox, reaps them and
wipes /work, /tmp, /dev/shm and System V IPC. The agent never runs untrusted code itself, is not
dumpable and, as the namespace's init, cannot be signalled from inside; a sandbox that stops answering,
breaks the protocol, or whose run is cancelled is killed whole (its pid namespace goes with it) and a new
one takes its place.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import os
import time
from typing import Any

from slime_env.tools_sandbox.agent import AGENT_SOURCE
from slime_env.tools_sandbox.cgroups import RunCgroup, join_cgroup
from slime_env.tools_sandbox.languages import get_language
from slime_env.tools_sandbox.local_exec import Outcome, as_user, clamp_limits, memfd, nproc_limit, outcome_result
from slime_env.tools_sandbox.process import SAFE_ENV
from slime_env.tools_sandbox.types import ExecRequest, ExecResult

GRACE_S = 10.0  # beyond a run's own timeout, how long the agent may take to answer
AGENT_MB = 48  # what the agent itself holds in the slot's cgroup, on top of the run's memory limit
START_TIMEOUT_S = 30.0
AGENT_PATH = "/.sandbox_agent.py"  # in the sandbox's read-only root, outside /work and /tmp


class _Server:
    """One slot's sandbox: the bwrap process and the pipes to its agent."""

    def __init__(self, process: asyncio.subprocess.Process, cgroup: RunCgroup | None):
        self.process, self.cgroup = process, cgroup
        self.runs = 0

    async def request(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        self.process.stdin.write((json.dumps(message) + "\n").encode())
        async with asyncio.timeout(timeout_s):
            await self.process.stdin.drain()
            line = await self.process.stdout.readline()
        if not line:
            raise EOFError("the sandbox agent closed its output")
        return json.loads(line)

    async def kill(self) -> None:
        if self.cgroup is not None:
            self.cgroup.kill()
        if self.process.returncode is None:
            try:
                self.process.kill()
            except ProcessLookupError:
                pass
            try:
                async with asyncio.timeout(30):
                    await self.process.wait()
            except TimeoutError:
                pass
        transport = getattr(self.process, "_transport", None)  # close its pipes now, not when collected
        if transport is not None:
            transport.close()


class ForkServers:
    """The per-slot servers of one `BwrapSandbox` (see the module docstring)."""

    def __init__(self, sandbox: Any):
        self.sb = sandbox
        self._servers: dict[int, _Server] = {}
        self._ids = 0
        self.started = 0

    async def execute(self, request: ExecRequest, slot: int, slot_uid: int | None) -> ExecResult:
        sb = self.sb
        lang = get_language(request.language)
        server = self._servers.pop(slot, None)
        if server is not None and server.process.returncode is not None:
            await server.kill()
            server = None
        if server is None:
            server = await self._start(slot, slot_uid)
        argv = lang.argv(sb.interpreters)
        files = {**request.files, lang.filename: request.code.encode()}
        self._ids += 1
        rid = self._ids
        oom_before = 0
        if server.cgroup is not None:
            oom_before = server.cgroup.prepare((request.memory_mb + AGENT_MB) << 20, empty=False)
        message = {"id": rid, "argv": argv, "inline": request.language == "python",
                   "files": {p: base64.b64encode(d).decode() for p, d in files.items()},
                   "stdin": base64.b64encode(request.stdin.encode()).decode(), "timeout_s": request.timeout_s,
                   "memory_bytes": clamp_limits(request.memory_mb * 2 + 256 if server.cgroup
                                                else request.memory_mb) << 20,
                   "cpu_s": math.ceil(request.timeout_s) + 1, "fsize_bytes": sb.fsize_mb << 20, "nofile": sb.nofile,
                   "nproc": None if server.cgroup else nproc_limit(slot_uid, sb.pids_limit),
                   "output_limit": request.output_limit_bytes}
        t0 = time.perf_counter()
        try:
            answer = await server.request(message, request.timeout_s + GRACE_S)
        except asyncio.CancelledError:
            await asyncio.shield(server.kill())  # the run dies with its sandbox: nothing is left behind
            raise
        except TimeoutError:
            await server.kill()
            return sb._result("timeout", duration_s=time.perf_counter() - t0,
                              reason=f"no answer within {request.timeout_s + GRACE_S:g}s: sandbox replaced")
        except (OSError, EOFError, ValueError) as e:
            await server.kill()
            return sb._result("sandbox_error", duration_s=time.perf_counter() - t0,
                              reason=f"sandbox agent stopped answering ({type(e).__name__}): replaced")
        if answer.get("id") != rid or "error" in answer:
            await server.kill()
            return sb._result("sandbox_error", duration_s=time.perf_counter() - t0,
                              reason=f"sandbox agent: {answer.get('error', 'answer for another run')}")
        oom = server.cgroup.oom_kills() > oom_before if server.cgroup is not None else False
        server.runs += 1
        self._servers[slot] = server  # healthy: the next run of this slot reuses it
        outcome = Outcome(exit_code=answer["exit_code"], stdout=answer["stdout"].encode(),
                          stderr=answer["stderr"].encode(), timed_out=answer["timed_out"],
                          output_exceeded=answer["output_exceeded"], duration_s=answer["duration_s"])
        return outcome_result(outcome, request, sb.backend, oom=oom or answer.get("oom", False))

    async def _start(self, slot: int, slot_uid: int | None) -> _Server:
        sb = self.sb
        cgroup = sb.cgroups.slot(slot, sb.pids_limit) if sb.cgroups is not None else None
        fds: list[int] = []
        control: list[str] = []
        after_start = None
        if cgroup is not None:
            cgroup.prepare(512 << 20)
            info_r, info_w = os.pipe()
            block_r, block_w = os.pipe()
            fds += [info_r, info_w, block_r, block_w]
            control = ["--info-fd", str(info_w), "--block-fd", str(block_r)]
            after_start = join_cgroup(cgroup, fds, info_r, info_w, block_r, block_w)
        env_args = ["--clearenv"]
        for k, v in {**SAFE_ENV, "HOME": "/work"}.items():  # what a run's /proc/self/environ shows, as cold runs
            env_args += ["--setenv", k, v]
        agent_fd = memfd("agent", AGENT_SOURCE.encode())
        fds.append(agent_fd)
        size = str(sb.tmpfs_mb << 20)
        python = sb.interpreters["python"]
        argv = [sb.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
                "--as-pid-1", "--hostname", "sandbox", *env_args, *sb._mounts, "--proc", "/proc", "--dev", "/dev",
                "--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", "/work",
                "--perms", "0444", "--file", str(agent_fd), AGENT_PATH, "--remount-ro", "/",
                "--chdir", "/work", *control, "--", python, "-s", "-u", AGENT_PATH]
        child_fds = [agent_fd, *([fds[1], fds[2]] if cgroup is not None else [])]  # bwrap's ends
        try:
            # Creation is shielded: Python 3.11 waits forever for a child whose creation was cancelled half-way
            # (here bubblewrap would sit on --block-fd). A cancelled caller lets it finish, then kills it.
            creation = asyncio.ensure_future(asyncio.create_subprocess_exec(
                *as_user(argv, slot_uid), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env={"PATH": SAFE_ENV["PATH"]}, cwd="/", pass_fds=tuple(child_fds), start_new_session=True,
                limit=1 << 26))
            cancelled = False
            while True:
                try:
                    process = await asyncio.shield(creation)
                    break
                except asyncio.CancelledError:
                    if creation.cancelled():
                        raise
                    cancelled = True
            server = _Server(process, cgroup)
            if cancelled:
                await asyncio.shield(server.kill())
                raise asyncio.CancelledError()
            try:
                if after_start is not None:
                    await after_start(process.pid)
                async with asyncio.timeout(START_TIMEOUT_S):
                    hello = await process.stdout.readline()
                if json.loads(hello or b"{}").get("ready") is not True:
                    raise OSError("did not start")
            except (OSError, ValueError, TimeoutError) as e:
                await server.kill()
                err = (await process.stderr.read()).decode(errors="replace").strip()
                raise RuntimeError(f"bubblewrap fork server failed to start ({e}): {err[:300]}") from None
            except BaseException:  # cancelled while it started: it must not be left half-started
                await asyncio.shield(server.kill())
                raise
        finally:
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.started += 1
        asyncio.ensure_future(_drain(process.stderr))
        return server

    async def close(self) -> None:
        servers, self._servers = list(self._servers.values()), {}
        for server in servers:
            await server.kill()


async def _drain(stream: asyncio.StreamReader) -> None:
    """The agent's stderr is not read otherwise; a full pipe must never block it."""
    try:
        while await stream.read(65536):
            pass
    except Exception:  # noqa: BLE001
        pass
