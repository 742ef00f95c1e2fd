"""`BwrapWorkspace`: a workspace in bubblewrap over a root file system, for hosts without a Docker engine.

The root is an image's file system (exported once from a local Docker image, or made from Debian's/Ubuntu's
archive for the base images `base_images` knows, or a folder given by path) under a per-workspace overlay, mounted
in a private mount namespace that dies with the workspace (nothing stays mounted on the host). bubblewrap gives
it its own pid, ipc, uts and — unless the network is `public` — network namespace, `--die-with-parent`, and the
same static agent as the Docker backend as its first process. As root, a cgroup per workspace holds memory and
process-count limits. Needs root (the overlay mount). Not here: a CPU quota and the `allowlist` network.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import json
import os
import shlex
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

from slime_env.tools_sandbox.workspace.agent_build import agent_binary
from slime_env.tools_sandbox.workspace.base import Workspace
from slime_env.tools_sandbox.workspace.protocol import AgentConnection
from slime_env.tools_sandbox.workspace.types import WorkspaceError, WorkspaceSpec

WORK_PREFIX = "slime_env-ws-"
_LIVE_DIRS: set[Path] = set()  # folders of this process's workspaces: removed at exit (their mounts die with us)


@atexit.register
def _remove_live() -> None:
    for d in list(_LIVE_DIRS):
        shutil.rmtree(d, ignore_errors=True)
    _LIVE_DIRS.clear()
# What a root process inside keeps (Docker's default set, less raw sockets and device nodes).
CAPS = ("CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL", "CAP_SETGID", "CAP_SETUID",
        "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_SETFCAP")


# The environment of a workspace whose root is a folder (no image config to read it from).
FOLDER_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
              "HOME": "/root"}


def rootfs_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "slime_env" / "rootfs"


def work_root() -> Path:
    return Path(os.environ.get("SLIME_ENV_WORKSPACE_DIR") or tempfile.gettempdir())


def _image_config(image: str) -> dict:
    """The root folder and config (workdir, user, env) for `image`: a folder path, or a Docker image exported once."""
    if image.startswith("/"):
        if not Path(image).is_dir():
            raise WorkspaceError(f"workspace root file system {image!r} is not a folder")
        return {"root": image, "workdir": "/", "user": None, "env": dict(FOLDER_ENV)}
    from slime_env.tools_sandbox.workspace.docker import docker_client

    try:
        client = docker_client(timeout_s=600)
    except WorkspaceError:
        return _from_recipe(image)
    try:
        attrs = client.images.get(image).attrs
    except Exception:  # noqa: BLE001 - ImageNotFound
        raise WorkspaceError(f"image {image!r} is not on this host (build it first)") from None
    config = attrs.get("Config") or {}
    target = rootfs_cache() / attrs["Id"].split(":")[-1][:16]
    if not (target / ".complete").exists():
        _export(client, image, target)
    env = dict(e.split("=", 1) for e in config.get("Env") or [] if "=" in e)
    return {"root": str(target / "root"), "workdir": config.get("WorkingDir") or "/",
            "user": config.get("User") or None, "env": env}


def _export(client, image: str, target: Path) -> None:
    tmp = target.with_name(target.name + f".tmp-{uuid.uuid4().hex[:6]}")
    (tmp / "root").mkdir(parents=True)
    container = client.containers.create(image, command=["/bin/true"], entrypoint=[])
    try:
        tar = subprocess.Popen(["tar", "-x", "-C", str(tmp / "root"), "--exclude=dev/*"], stdin=subprocess.PIPE,
                               stderr=subprocess.PIPE)
        for chunk in container.export():
            tar.stdin.write(chunk)
        tar.stdin.close()
        if tar.wait() != 0:
            raise WorkspaceError(f"exporting {image!r}: tar failed: {tar.stderr.read().decode()[-500:]}")
    finally:
        container.remove(force=True)
    (tmp / ".complete").write_text(image)
    try:
        tmp.rename(target)
    except OSError:  # another process exported it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)


def _from_recipe(image: str) -> dict:
    """No Docker engine: a root file system for a known public base image, made from the package archives."""
    from slime_env.tools_sandbox.workspace.base_images import recipe_for

    recipe = recipe_for(image)
    target = rootfs_cache() / f"recipe-{recipe.distro}-{recipe.suite}-{recipe.python or 'none'}"
    if not (target / ".complete").exists():
        raise WorkspaceError(f"no Docker engine here and no root file system for {image!r} in {target}: make one with "
                             f"`mmdebstrap --variant=apt {recipe.suite} {target}/root` (then touch {target}/.complete)")
    return {"root": str(target / "root"), "workdir": "/", "user": None, "env": dict(FOLDER_ENV)}


class BwrapWorkspace(Workspace):
    """A workspace in bubblewrap (see the module docstring); `await BwrapWorkspace.start(spec)`."""

    backend = "bwrap"
    _slots = itertools.count()
    _cgroups = None

    def __init__(self, spec: WorkspaceSpec, *, run_id: str, image: dict):
        super().__init__(spec, workspace_id=uuid.uuid4().hex[:12])
        self.run_id, self.image = run_id, image
        self.dir = work_root() / f"{WORK_PREFIX}{self.id}"
        self.proc: asyncio.subprocess.Process | None = None
        self.snapshots: list[str] = []
        self._cgroup = None
        self._stderr = b""

    @classmethod
    async def start(cls, spec: WorkspaceSpec, *, run_id: str = "default") -> BwrapWorkspace:
        if os.geteuid() != 0:
            raise WorkspaceError("the bubblewrap workspace backend needs root (it mounts an overlay per workspace)")
        for tool in ("bwrap", "unshare"):
            if shutil.which(tool) is None:
                raise WorkspaceError(f"the bubblewrap workspace backend needs {tool}: apt-get install -y "
                                     f"{'bubblewrap' if tool == 'bwrap' else 'util-linux'}")
        if spec.limits.network == "allowlist":
            raise WorkspaceError("the bubblewrap backend has no allowlist network: use Docker, or network none/public")
        image = await asyncio.to_thread(_image_config, spec.image)
        ws = cls(spec, run_id=run_id, image=image)
        for sub in ("upper", "work", "merged", "snapshots"):
            (ws.dir / sub).mkdir(parents=True)
        _LIVE_DIRS.add(ws.dir)
        from slime_env.tools_sandbox.workspace.docker import owner_id

        (ws.dir / "owner.json").write_text(json.dumps({"owner": owner_id(), "run": run_id, "image": spec.image}))
        try:
            ws._agent = await ws._launch()
        except BaseException:
            await ws._stop()
            raise
        return ws

    @property
    def workdir(self) -> str:
        return self.spec.workdir or self.image["workdir"]

    @property
    def default_user(self) -> str | None:
        return self.spec.user or self.image["user"]

    def _cgroup_dirs(self) -> list[Path]:
        from slime_env.tools_sandbox.cgroups import CgroupParent

        if BwrapWorkspace._cgroups is None:
            BwrapWorkspace._cgroups = CgroupParent.detect() or False
        if not BwrapWorkspace._cgroups:
            return []
        if self._cgroup is None:
            self._cgroup = BwrapWorkspace._cgroups.slot(next(self._slots), self.spec.limits.pids)
            self._cgroup.prepare(self.spec.limits.memory_mb << 20)
        return list(dict.fromkeys(self._cgroup.dirs.values()))

    async def _launch(self) -> AgentConnection:
        d = self.dir
        env = {**self.image["env"], **self.spec.env}
        bwrap = ["--bind", str(d / "merged"), "/", "--proc", "/proc", "--dev", "/dev",
                 "--ro-bind", str(agent_binary()), "/.slime_env/agent", "--unshare-ipc", "--unshare-pid",
                 "--unshare-uts", "--unshare-cgroup-try", "--hostname", "workspace", "--die-with-parent",
                 "--cap-drop", "ALL", *[a for cap in CAPS for a in ("--cap-add", cap)], "--chdir", self.workdir,
                 "--clearenv", *[a for k, v in env.items() for a in ("--setenv", k, v)]]
        if self.spec.limits.network != "public":
            bwrap.append("--unshare-net")
        # The options go through a file (`--args`), not the command line: bwrap stays the workspace's first process,
        # and `ps` in the workspace showed its argv, host paths (the overlay's folders) and the environment included.
        (d / "bwrap.args").write_bytes(b"".join(a.encode() + b"\0" for a in bwrap))
        joins = "".join(f"echo $$ > {shlex.quote(str(c / 'cgroup.procs'))} && " for c in self._cgroup_dirs())
        script = (f"{joins}mount -t overlay overlay -o lowerdir={_q(self.image['root'])},upperdir={_q(d / 'upper')},"
                  f"workdir={_q(d / 'work')} {_q(d / 'merged')} && "
                  # as Docker does: the working directory exists
                  f"mkdir -p {_q(str(d / 'merged') + self.workdir)} && "
                  f"exec bwrap --args 3 /.slime_env/agent 3< {_q(d / 'bwrap.args')}")
        self.proc = await asyncio.create_subprocess_exec(
            "unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", script, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        proc = self.proc

        async def read() -> bytes:
            return await proc.stdout.read(65536)

        async def write(data: bytes) -> None:
            proc.stdin.write(data)
            await proc.stdin.drain()

        async def collect_stderr() -> None:
            while chunk := await proc.stderr.read(4096):
                self._stderr = (self._stderr + chunk)[-4000:]

        self._stderr_task = asyncio.get_running_loop().create_task(collect_stderr())
        agent = AgentConnection(read, write)
        try:
            await agent.ready(timeout_s=60.0)
        except Exception as e:  # noqa: BLE001
            await asyncio.sleep(0.1)
            raise WorkspaceError(f"the bubblewrap workspace for {self.spec.image!r} did not start ({e}): "
                                 f"{self._stderr.decode('utf-8', 'replace')[-800:]}") from None
        return agent

    async def _kill_process(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        if self._cgroup is not None:
            await asyncio.to_thread(self._cgroup.kill)

    async def _stop(self) -> None:
        await self._kill_process()
        await asyncio.to_thread(shutil.rmtree, self.dir, True)
        _LIVE_DIRS.discard(self.dir)

    async def _snapshot(self) -> str:
        name = f"{len(self.snapshots) + 1}"
        await asyncio.to_thread(_copy_tree, self.dir / "upper", self.dir / "snapshots" / name)
        self.snapshots.append(name)
        return name

    async def _restore(self, snapshot: str) -> AgentConnection:
        if snapshot not in self.snapshots:
            raise WorkspaceError(f"workspace {self.id} has no snapshot {snapshot!r}")
        await self._kill_process()

        def reset() -> None:
            for sub in ("upper", "work"):
                shutil.rmtree(self.dir / sub)
            _copy_tree(self.dir / "snapshots" / snapshot, self.dir / "upper")
            (self.dir / "work").mkdir()

        await asyncio.to_thread(reset)
        return await self._launch()

    async def _oom_count(self) -> int | None:
        return None if self._cgroup is None else await asyncio.to_thread(self._cgroup.oom_kills)

    def size_rw(self) -> int | None:
        """Bytes written to the workspace's file system (its overlay's upper folder)."""
        total = 0
        for root, _, files in os.walk(self.dir / "upper"):
            for f in files:
                try:
                    total += os.lstat(os.path.join(root, f)).st_size
                except OSError:
                    pass
        return total


def _q(path) -> str:
    return shlex.quote(str(path))


def _copy_tree(src: Path, dst: Path) -> None:
    subprocess.run(["cp", "-a", str(src), str(dst)], check=True, capture_output=True)


def reap_folders(*, run_id: str | None = None, all_owners: bool = False) -> int:
    """Remove workspace folders whose owner process is gone (their mounts died with them); returns how many."""
    from slime_env.tools_sandbox.workspace.docker import owner_alive

    removed = 0
    for d in work_root().glob(f"{WORK_PREFIX}*"):
        try:
            owner = json.loads((d / "owner.json").read_text())
        except (OSError, ValueError):
            owner = {}
        stale = all_owners or (owner.get("run") == run_id if run_id is not None
                               else not owner_alive(owner.get("owner", "")))
        if stale:
            shutil.rmtree(d, ignore_errors=True)
            removed += 1
    return removed
