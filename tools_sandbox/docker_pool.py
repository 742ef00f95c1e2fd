"""`DockerSandbox`: a warm pool of locked-down containers, each running one run at a time.

A container starts once (≈0.2–0.3 s) and then serves runs through a small agent that is its PID 1
(`slime_env.tools_sandbox.agent`): a run costs a fork/exec inside the container (≈20 ms for `print(1)`), not a
`docker run` (≈300 ms) or a `docker exec` (≈60 ms). Every container: `--network none`, memory =
memory+swap (hard), CPU quota, pids limit, read-only root, tmpfs /work and /tmp, uid 65534, all
capabilities dropped, `no-new-privileges`. The agent wipes /work, /tmp and /dev/shm and kills every
leftover process after each run; a container that misbehaves (no answer in time, died, protocol
error) is killed and replaced, at most `create_rate_per_s` new containers a second. Containers carry
the label `slime_env.sandbox` and their owner (host and pid): `cleanup()` and the start of a new pool
remove those whose owner is gone.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import json
import math
import os
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

from slime_env.tools_sandbox.agent import AGENT_SOURCE
from slime_env.tools_sandbox.base import Sandbox, classify
from slime_env.tools_sandbox.languages import get_language
from slime_env.tools_sandbox.local_exec import pid_alive
from slime_env.tools_sandbox.types import ExecRequest, ExecResult, SandboxError

LABEL = "slime_env.sandbox"
OWNER_LABEL = "slime_env.owner"
DEFAULT_IMAGE = "slime-env-sandbox:py3"
GRACE_S = 3.0  # how long past its own timeout the agent may take to answer before the container is replaced


def docker_client(timeout_s: float = 30.0):
    """A docker SDK client for the local engine; SandboxError naming the cause if there is none."""
    try:
        import docker
    except ImportError as e:
        raise SandboxError("the docker SDK is not installed: pip install 'docker>=7'") from e
    try:
        client = docker.from_env(timeout=int(timeout_s))
        client.ping()
        return client
    except Exception as e:  # noqa: BLE001 - DockerException, connection refused, permission denied
        raise SandboxError(f"no Docker engine reachable ({type(e).__name__}: {e}); start dockerd "
                           f"(apt-get install -y docker.io && dockerd &)") from None


def attach_and_start(container: Any, remove: Callable[[Any], None]) -> socket.socket:
    """Attach to a created container's stdin, stdout and stderr, then start it: the hijacked connection (stdin in,
    multiplexed stdout/stderr out), non-blocking. A failure hands the container to `remove` and raises."""
    try:
        sock = container.attach_socket(params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1})
        container.start()
    except BaseException:
        remove(container)
        raise
    raw = sock._sock  # attached before the start, so not a byte of the agent's output is missed
    raw.setblocking(False)
    return raw


def _owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def cleanup(client=None, *, all_owners: bool = False) -> int:
    """Remove sandbox containers left behind (owner process gone on this host; all with `all_owners`).

    Returns how many were removed. Safe to call while other processes run their own pools.
    """
    client = client or docker_client()
    removed = 0
    host = socket.gethostname()
    # sparse: the labels come with the listing (a full one inspects each container, and one that another process
    # removes meanwhile fails the whole call with NotFound)
    for c in client.containers.list(all=True, filters={"label": LABEL}, sparse=True):
        owner_host, _, pid = (c.attrs.get("Labels") or {}).get(OWNER_LABEL, ":").partition(":")
        stale = all_owners or (owner_host == host and pid.isdigit() and not pid_alive(int(pid)))
        if stale:
            try:
                c.remove(force=True)
                removed += 1
            except Exception:  # noqa: BLE001 - removed concurrently
                pass
    return removed


class _Container:
    """One pooled container: its docker object and the multiplexed attach stream to its agent."""

    def __init__(self, container, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, sock):
        self.container, self.reader, self.writer, self.sock = container, reader, writer, sock
        self.runs = 0
        self._buf = b""

    async def send(self, obj: dict[str, Any]) -> None:
        self.writer.write(json.dumps(obj).encode() + b"\n")
        await self.writer.drain()

    async def receive(self) -> dict[str, Any]:
        """The next JSON line of the agent's stdout (the attach stream frames it: 8-byte headers)."""
        while b"\n" not in self._buf:
            header = await self.reader.readexactly(8)
            size = struct.unpack(">I", header[4:])[0]
            data = await self.reader.readexactly(size)
            if header[0] == 1:  # stdout; stderr frames (the agent's own crash, if any) are skipped
                self._buf += data
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    def close_stream(self) -> None:
        try:
            self.writer.close()
        except Exception:  # noqa: BLE001 - the loop may be gone already
            pass


class DockerSandbox(Sandbox):
    """A warm pool of `pool_size` containers from the local `image` (see the module docstring).

    Options: `container_memory_mb` (hard, memory = memory+swap), `cpus`, `pids_limit`, `tmpfs_mb`,
    `create_rate_per_s`, `max_runs_per_container` (None: reuse forever). A run's own `memory_mb` becomes
    an address-space limit inside the container. The pool starts on first use or with `await start()`.
    """

    backend = "docker"

    def __init__(self, image: str = DEFAULT_IMAGE, *, pool_size: int = 4, container_memory_mb: int = 1024,
                 cpus: float = 1.0, pids_limit: int = 64, tmpfs_mb: int = 64, nofile: int = 256, fsize_mb: int = 64,
                 create_rate_per_s: float = 4.0, max_runs_per_container: int | None = None,
                 python: str = "/usr/bin/python3", client=None, **kw):
        kw.setdefault("max_concurrency", pool_size)
        super().__init__(**kw)
        self.client = client or docker_client()
        try:
            self.client.images.get(image)
        except Exception:  # noqa: BLE001 - ImageNotFound or API error
            raise SandboxError(f"docker image {image!r} not found: build it with `slime-env sandbox build-image`") \
                from None
        self.image, self.pool_size = image, max(pool_size, self.max_concurrency)
        self.container_memory_mb, self.cpus, self.pids_limit = container_memory_mb, cpus, pids_limit
        self.tmpfs_mb, self.nofile, self.fsize_mb = tmpfs_mb, nofile, fsize_mb
        self.min_create_interval = 1.0 / create_rate_per_s
        self.max_runs_per_container = max_runs_per_container
        self.interpreters = {"python": python, "sh": "/bin/sh"}
        self._idle: asyncio.Queue[_Container] | None = None
        self._all: set[_Container] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._starting: asyncio.Task | None = None
        self._create_lock: asyncio.Lock | None = None
        self._last_create = 0.0
        self._background: set[asyncio.Task] = set()
        self._run_ids = 0
        self.created = self.replaced = 0
        atexit.register(self._remove_all_sync)

    def describe(self) -> str:
        return f"docker sandbox (image {self.image}, pool of {self.pool_size})"

    async def start(self) -> None:
        """Create the pool (removing containers left by crashed owners first); idempotent per event loop."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            await self._discard_all()
            self._loop, self._idle, self._create_lock = loop, asyncio.Queue(), asyncio.Lock()
            self._starting = loop.create_task(self._fill())
        await asyncio.shield(self._starting)

    async def _fill(self) -> None:
        await asyncio.to_thread(cleanup, self.client)
        results = await asyncio.gather(*(self._create() for _ in range(self.pool_size)), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if len(errors) == len(results):
            raise SandboxError(f"could not start any sandbox container: {errors[0]}")
        for _ in errors:  # keep the pool at full size; a failing engine shows up as sandbox_error results
            self._spawn(self._replace_missing())

    async def _create(self) -> _Container:
        async with self._create_lock:  # creation rate limit: a crash loop must not hammer the engine
            wait = self._last_create + self.min_create_interval - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self._last_create = time.monotonic()
        c = await asyncio.to_thread(self._create_sync)
        try:
            reader, writer = await asyncio.open_connection(sock=c[1])
            box = _Container(c[0], reader, writer, c[1])
            async with asyncio.timeout(30):
                hello = await box.receive()
            if not hello.get("ready"):
                raise SandboxError(f"sandbox agent said {hello!r} instead of ready")
        except BaseException:
            await asyncio.to_thread(_remove, c[0])
            raise
        self.created += 1
        self._all.add(box)
        self._idle.put_nowait(box)
        return box

    def _create_sync(self):
        import docker.types

        mb = self.container_memory_mb
        container = self.client.containers.create(
            # The agent's source travels in the environment, so `ps` shows a short command line.
            self.image, command=[self.interpreters["python"], "-I", "-S", "-c",
                                 "import os; exec(os.environ.pop('SLIME_ENV_AGENT'))"],
            environment={"SLIME_ENV_AGENT": AGENT_SOURCE},
            stdin_open=True, tty=False, network_mode="none", mem_limit=f"{mb}m", memswap_limit=f"{mb}m",
            nano_cpus=int(self.cpus * 1e9), pids_limit=self.pids_limit, read_only=True, user="65534:65534",
            cap_drop=["ALL"], security_opt=["no-new-privileges"], ipc_mode="private", shm_size=f"{self.tmpfs_mb}m",
            tmpfs={"/work": f"size={self.tmpfs_mb}m,mode=1777", "/tmp": f"size={self.tmpfs_mb}m,mode=1777"},
            ulimits=[docker.types.Ulimit(name="nofile", soft=self.nofile, hard=self.nofile),
                     docker.types.Ulimit(name="core", soft=0, hard=0)],
            labels={LABEL: "1", OWNER_LABEL: _owner()})
        return container, attach_and_start(container, _remove)

    async def _execute(self, request: ExecRequest) -> ExecResult:
        await self.start()
        lang = get_language(request.language)
        try:
            async with asyncio.timeout(request.timeout_s + 60):
                box = await self._idle.get()
        except TimeoutError:
            return self._result("sandbox_error", reason="no sandbox container became available within "
                                                        f"{request.timeout_s + 60:g}s (is the Docker engine up?)")
        self._run_ids += 1
        rid = self._run_ids
        files = {**request.files, lang.filename: request.code.encode()}
        mem = min(request.memory_mb, self.container_memory_mb)
        message = {"id": rid, "argv": lang.argv(self.interpreters),
                   "files": {p: base64.b64encode(d).decode() for p, d in files.items()},
                   "stdin": base64.b64encode(request.stdin.encode()).decode(), "timeout_s": request.timeout_s,
                   "memory_bytes": mem << 20, "cpu_s": math.ceil(request.timeout_s) + 1,
                   "fsize_bytes": self.fsize_mb << 20, "nofile": self.nofile,
                   "output_limit": request.output_limit_bytes}
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(request.timeout_s + GRACE_S):
                await box.send(message)
                answer = await box.receive()
        except TimeoutError:
            self._spawn(self._replace(box))
            return self._result("timeout", duration_s=time.perf_counter() - t0,
                                reason=f"no answer within {request.timeout_s + GRACE_S:g}s: container replaced")
        except asyncio.CancelledError:
            self._spawn(self._recover(box, rid))  # kill the run, then reuse the container (or replace it)
            raise
        except (OSError, EOFError, asyncio.IncompleteReadError, ValueError) as e:
            self._spawn(self._replace(box))
            return self._result("sandbox_error", duration_s=time.perf_counter() - t0,
                                reason=f"container stopped answering ({type(e).__name__}): replaced")
        if answer.get("id") != rid or "error" in answer:
            self._spawn(self._replace(box))
            return self._result("sandbox_error", duration_s=time.perf_counter() - t0,
                                reason=f"sandbox agent: {answer.get('error', 'answer for another run')}")
        self._release(box)
        status, reason = classify(exit_code=answer["exit_code"], timed_out=answer["timed_out"],
                                  output_exceeded=answer["output_exceeded"], oom=answer["oom"],
                                  stderr=answer["stderr"], timeout_s=request.timeout_s, memory_mb=mem,
                                  output_limit_bytes=request.output_limit_bytes)
        return self._result(status, exit_code=answer["exit_code"], stdout=answer["stdout"], stderr=answer["stderr"],
                            duration_s=answer["duration_s"], truncated=answer["output_exceeded"], reason=reason)

    def _release(self, box: _Container) -> None:
        box.runs += 1
        if self.max_runs_per_container and box.runs >= self.max_runs_per_container:
            self._spawn(self._replace(box))
        else:
            self._idle.put_nowait(box)

    async def _recover(self, box: _Container, rid: int) -> None:
        """After a cancelled call: ask the agent to kill the run, wait for its answer, reuse the container."""
        try:
            async with asyncio.timeout(GRACE_S):
                await box.send({"abort": rid})
                while (await box.receive()).get("id") != rid:
                    pass
        except Exception:  # noqa: BLE001 - any doubt: replace it
            await self._replace(box)
            return
        self._release(box)

    async def _replace(self, box: _Container) -> None:
        self.replaced += 1
        self._all.discard(box)
        box.close_stream()
        await asyncio.to_thread(_remove, box.container)
        await self._replace_missing()

    async def _replace_missing(self) -> None:
        delay = 0.5
        while True:  # the pool keeps its size: retried (with backoff) until the engine gives a container
            try:
                await self._create()
                return
            except Exception:  # noqa: BLE001 - runs wait meanwhile, and time out if it takes too long
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _discard_all(self) -> None:
        boxes, self._all = list(self._all), set()
        for box in boxes:
            box.close_stream()
        if boxes:
            await asyncio.to_thread(lambda: [_remove(b.container) for b in boxes])

    async def close(self) -> None:
        """Remove every container of this pool."""
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self._discard_all()
        self._loop = None

    def _remove_all_sync(self) -> None:
        for box in list(self._all):
            _remove(box.container)
        self._all.clear()


def _remove(container) -> None:
    try:
        container.remove(force=True)
    except Exception:  # noqa: BLE001 - already gone
        pass
