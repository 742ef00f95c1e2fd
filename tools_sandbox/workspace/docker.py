"""`DockerWorkspace`: a workspace in its own Docker container, the agent as its first process.

The container runs the image's file system with the static agent bind-mounted at `/.slime_env/agent` as its
entrypoint; requests go over the container's attach stream (stdin in, multiplexed stdout out), so a command
costs a fork/exec inside the container. Limits: memory = memory + swap (hard), CPU quota, pids, no network
unless asked (`allowlist` goes through `proxy.AllowlistProxy` on an internal network), `no-new-privileges`,
raw sockets and device nodes dropped. Every container carries the labels `slime_env.workspace`, the run's id and
its owner process (host, pid and start time): `reap()` removes those whose owner is gone.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import struct
import uuid
from typing import Any

from slime_env.lifeline import owner_alive, owner_id  # the owner label's value, as the run's processes carry it
from slime_env.tools_sandbox.docker_pool import attach_and_start
from slime_env.tools_sandbox.workspace.agent_build import agent_binary
from slime_env.tools_sandbox.workspace.base import Workspace
from slime_env.tools_sandbox.workspace.protocol import AgentConnection
from slime_env.tools_sandbox.workspace.types import WorkspaceError, WorkspaceSpec

LABEL = "slime_env.workspace"
OWNER_LABEL = "slime_env.workspace.owner"
RUN_LABEL = "slime_env.workspace.run"
SNAPSHOT_REPO = "slime-env-snapshot"
AGENT_PATH = "/.slime_env/agent"
DROPPED_CAPS = ["NET_RAW", "MKNOD", "AUDIT_WRITE", "SYS_CHROOT"]
_LIVE: dict[str, Any] = {}  # containers of this process not removed yet: removed at exit, whatever else happens


@atexit.register
def _remove_live() -> None:
    for container in list(_LIVE.values()):
        _remove(container)
    _LIVE.clear()


def docker_client(timeout_s: float = 120.0):
    from slime_env.tools_sandbox.docker_pool import docker_client as client

    try:
        return client(timeout_s)
    except Exception as e:  # noqa: BLE001 - SandboxError naming the cause
        raise WorkspaceError(str(e)) from None


class _ImageInfo:
    """What a workspace needs to know of its image: its default working directory and user."""

    @classmethod
    def get(cls, client, image: str) -> tuple[str, str | None]:
        try:
            attrs = client.images.get(image).attrs  # asked each time: a tag rebuilt since is another image
        except Exception:  # noqa: BLE001 - ImageNotFound or API error
            raise WorkspaceError(f"docker image {image!r} is not on this host (no registry is used: build it "
                                 f"first, e.g. from a task's Dockerfile)") from None
        config = attrs.get("Config") or {}
        return config.get("WorkingDir") or "/", config.get("User") or None


class DockerWorkspace(Workspace):
    """A workspace in a Docker container (see the module docstring). Make it with `await DockerWorkspace.start(
    spec)`; `run_id` labels it for `reap(run_id=...)`."""

    backend = "docker"
    _snapshots = itertools.count(1)

    def __init__(self, spec: WorkspaceSpec, *, client, run_id: str, workspace_id: str | None = None,
                 network: str | None = None):
        super().__init__(spec, workspace_id=workspace_id or uuid.uuid4().hex[:12])
        self.client, self.run_id, self._network = client, run_id, network
        self.container = None
        self.snapshots: list[str] = []
        self._image_workdir, self._image_user = _ImageInfo.get(client, spec.image)
        self._stderr_tail = b""

    @classmethod
    async def start(cls, spec: WorkspaceSpec, *, client=None, run_id: str = "default",
                    network: str | None = None) -> DockerWorkspace:
        client = client or await asyncio.to_thread(docker_client)
        workspace = cls(spec, client=client, run_id=run_id, network=network)
        await workspace._boot(spec.image)
        return workspace

    @property
    def workdir(self) -> str:
        return self.spec.workdir or self._image_workdir

    @property
    def default_user(self) -> str | None:
        return self.spec.user or self._image_user

    async def _boot(self, image: str) -> None:
        try:
            self.container, sock = await asyncio.to_thread(self._create, image)
        except WorkspaceError:
            raise
        except Exception as e:  # noqa: BLE001 - the engine refused: name the image and the cause
            raise WorkspaceError(f"could not start a workspace from {image!r}: {type(e).__name__}: {e}") from None
        try:
            self._agent = await self._connect(sock)
            await self._agent.ready(timeout_s=60.0)
            self._oom_seen = await self._oom_count() or 0
        except BaseException as e:
            await asyncio.to_thread(_remove, self.container)
            if isinstance(e, Exception):
                raise WorkspaceError(f"the workspace agent in {image!r} did not start: {e}; "
                                     f"{self._stderr_tail.decode('utf-8', 'replace')[-500:]}") from None
            raise

    def _create(self, image: str):
        import docker.types

        limits = self.spec.limits
        mb = limits.memory_mb
        network = self._network or ("none" if limits.network == "none" else "bridge")
        container = self.client.containers.create(
            image, entrypoint=[AGENT_PATH], command=[], stdin_open=True, tty=False, user="0:0",
            working_dir=self.workdir, environment=dict(self.spec.env), hostname="workspace",
            network_mode=network, mem_limit=f"{mb}m", memswap_limit=f"{mb}m", nano_cpus=int(limits.cpus * 1e9),
            pids_limit=limits.pids, cap_drop=DROPPED_CAPS, security_opt=["no-new-privileges"],
            mounts=[docker.types.Mount(target=AGENT_PATH, source=str(agent_binary()), type="bind", read_only=True)],
            labels={LABEL: "1", OWNER_LABEL: owner_id(), RUN_LABEL: self.run_id, f"{LABEL}.id": self.id})
        _LIVE[container.id] = container
        return container, attach_and_start(container, _remove)

    async def _connect(self, sock) -> AgentConnection:
        reader, writer = await asyncio.open_connection(sock=sock)

        async def read() -> bytes:
            """The agent's stdout, from the attach stream's frames (8-byte headers; stream 2 is stderr)."""
            while True:
                try:
                    header = await reader.readexactly(8)
                    data = await reader.readexactly(struct.unpack(">I", header[4:])[0])
                except asyncio.IncompleteReadError:
                    return b""
                if header[0] == 1:
                    return data
                self._stderr_tail = (self._stderr_tail + data)[-4000:]

        async def write(data: bytes) -> None:
            writer.write(data)
            await writer.drain()

        def on_close() -> None:
            try:
                writer.close()
            except Exception:  # noqa: BLE001 - the loop may be gone
                pass

        return AgentConnection(read, write, on_close)

    async def _stop(self) -> None:
        container, snapshots = self.container, list(self.snapshots)
        self.snapshots.clear()

        def remove() -> None:
            if container is not None:
                _remove(container)
            for tag in snapshots:
                try:
                    self.client.images.remove(tag, force=True, noprune=False)
                except Exception:  # noqa: BLE001 - gone already
                    pass

        await asyncio.to_thread(remove)

    async def _snapshot(self) -> str:
        tag = f"{SNAPSHOT_REPO}:{self.id}-{next(self._snapshots)}"
        repository, _, version = tag.partition(":")
        await asyncio.to_thread(self.container.commit, repository=repository, tag=version,
                                conf={"Labels": {LABEL: "snapshot", OWNER_LABEL: owner_id(), RUN_LABEL: self.run_id}})
        self.snapshots.append(tag)
        return tag

    async def _restore(self, snapshot: str) -> AgentConnection:
        if snapshot not in self.snapshots:
            raise WorkspaceError(f"workspace {self.id} has no snapshot {snapshot!r}")
        old = self.container
        await asyncio.to_thread(_remove, old)
        await self._boot(snapshot)
        return self._agent

    def size_rw(self) -> int | None:
        """Bytes this workspace has written to its file system (Docker's `SizeRw`), or None if unknown."""
        try:
            (info,) = self.client.api.containers(all=True, filters={"id": self.container.id}, size=True)
        except Exception:  # noqa: BLE001 - gone, or the engine is busy: the next round asks again
            return None
        return info.get("SizeRw")


def _remove(container) -> None:
    _LIVE.pop(container.id, None)
    try:
        container.remove(force=True)
    except Exception:  # noqa: BLE001 - already gone
        pass


def reap(client=None, *, run_id: str | None = None, all_owners: bool = False) -> dict[str, int]:
    """Remove workspace containers and snapshot images whose owner process is gone (all of one run with `run_id`,
    all of them with `all_owners`); returns how many of each were removed. Safe beside live runs."""
    client = client or docker_client()
    removed = {"containers": 0, "images": 0, "networks": 0}

    def stale(labels: dict[str, Any]) -> bool:
        if all_owners:
            return True
        if run_id is not None:
            return labels.get(RUN_LABEL) == run_id
        return not owner_alive(labels.get(OWNER_LABEL, ""))

    # sparse: the labels come with the listing; a full listing inspects each container, and one that another run
    # removes meanwhile fails the whole call with NotFound
    for c in client.containers.list(all=True, filters={"label": LABEL}, sparse=True):
        if stale(c.attrs.get("Labels") or {}):
            try:
                c.remove(force=True)
                removed["containers"] += 1
            except Exception:  # noqa: BLE001 - removed concurrently
                pass
    for image in client.images.list(filters={"label": f"{LABEL}=snapshot"}):
        if stale(image.labels or {}):
            for tag in image.tags or [image.id]:
                try:
                    client.images.remove(tag, force=True)
                    removed["images"] += 1
                except Exception:  # noqa: BLE001
                    pass
    for net in client.networks.list(filters={"label": f"{LABEL}=network"}):
        if stale(net.attrs.get("Labels") or {}):
            try:
                net.remove()
                removed["networks"] += 1
            except Exception:  # noqa: BLE001 - still in use, or gone
                pass
    return removed
