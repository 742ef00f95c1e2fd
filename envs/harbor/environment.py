"""A Harbor task's container: its image (`task_image`), the workspace spec it runs in (`workspace_spec`), a
started workspace with Harbor's log folders (`open_task_workspace`).

Images: `[environment].docker_image` is used as it is, as Harbor uses it (unless `force_build` and there is an
environment/Dockerfile); otherwise environment/Dockerfile is built as `task.image_tag()` — the task's name and a
hash of environment/, so an unchanged task reuses its image and an edited one gets a new tag. A prebuilt image
with a non-empty environment/ and no Dockerfile gets environment/ uploaded into its workdir, as Harbor does.
"""

from __future__ import annotations

import asyncio
import shlex
from collections.abc import Awaitable, Callable
from pathlib import Path

from slime_env.envs.harbor.config import EnvironmentConfig
from slime_env.envs.harbor.task import HarborTask
from slime_env.errors import InvalidInput
from slime_env.tools_sandbox.workspace import Limits, Workspace, WorkspaceError, WorkspaceSpec

LOGS_DIR = "/logs"
AGENT_LOGS = "/logs/agent"
VERIFIER_LOGS = "/logs/verifier"
ARTIFACTS_DIR = "/logs/artifacts"
TESTS_DIR = "/tests"
SOLUTION_DIR = "/solution"

OpenWorkspace = Callable[[WorkspaceSpec], Awaitable[Workspace]]
_NETWORK = {"no-network": "none", "public": "public", "allowlist": "allowlist"}


async def docker_open(spec: WorkspaceSpec) -> Workspace:
    """The default way to start a workspace: a new Docker container (`open_workspace`: wall time and disk watched,
    the allowlist network set up), labelled with the run id `harbor`."""
    from slime_env.tools_sandbox.workspace.open import open_workspace

    return await open_workspace(spec, backend="docker", run="harbor")


def _image_present(tag: str) -> bool:
    from slime_env.tools_sandbox.workspace.base_images import image_exists
    from slime_env.tools_sandbox.workspace.docker import docker_client

    return image_exists(docker_client(), tag)


async def build_context_image(task: HarborTask, folder: Path, tag: str, *, log=None) -> str:
    """`folder`/Dockerfile built as `tag` unless an image of that tag exists already; returns the tag."""
    from slime_env.tools_sandbox.workspace.images import build_image

    if not (folder / "Dockerfile").is_file():
        compose = " (docker-compose environments are not supported)" if (folder / "docker-compose.yaml").exists() \
            else ""
        raise InvalidInput(f"{task.given_path or task.path}: no {folder.name}/Dockerfile to build{compose}")
    if not await asyncio.to_thread(_image_present, tag):
        await asyncio.to_thread(build_image, folder, tag, timeout_s=task.config.environment.build_timeout_sec,
                                log=log)
    return tag


async def task_image(task: HarborTask, *, force_build: bool = False, log=None) -> str:
    """The image the task's agent runs in: `docker_image`, or environment/Dockerfile built (see the module)."""
    env = task.config.environment
    if env.docker_image and not (force_build and (task.environment_dir / "Dockerfile").is_file()):
        return env.docker_image
    return await build_context_image(task, task.environment_dir, task.image_tag(), log=log)


def uploads_environment_dir(task: HarborTask, image: str) -> bool:
    """Harbor uploads environment/ into the workdir of a prebuilt image when environment/ has files but no
    Dockerfile or compose file."""
    folder = task.environment_dir
    return (image == task.config.environment.docker_image and folder.is_dir() and any(folder.iterdir())
            and not any((folder / n).exists() for n in ("Dockerfile", "docker-compose.yaml")))


def workspace_spec(task: HarborTask, image: str, *, environment: EnvironmentConfig | None = None,
                   network: str | None = None, limits: Limits | None = None, environ=None) -> WorkspaceSpec:
    """The workspace a task's container becomes: its image, `[environment].workdir`, `[environment].env` (templates
    resolved), and limits from `cpus`, `memory_mb`, `storage_mb` (defaults: 1 CPU, 2048 MB) and the network
    policy (`network`: a Harbor network mode overriding the task's, e.g. the agent phase's)."""
    env_config = environment or task.config.environment
    if env_config.os != "linux":
        raise InvalidInput(f"{task.given_path or task.path}: [environment].os = {env_config.os!r}: only linux tasks "
                           f"run here")
    mode = network or env_config.network_mode
    hosts = tuple(env_config.allowed_hosts or ()) if mode == "allowlist" else ()
    if limits is None:
        timeout = (task.config.agent.timeout_sec or 3600.0) + task.config.verifier.timeout_sec
        limits = Limits(cpus=float(env_config.cpus or 1.0), memory_mb=int(env_config.memory_mb or 2048),
                        disk_mb=env_config.storage_mb or Limits().disk_mb, wall_time_s=min(7 * 86400.0,
                                                                                          timeout + 600.0),
                        network=_NETWORK[mode], allowed_hosts=hosts)
    env = task.resolved_env("environment", environ) if environment is None else dict(env_config.env)
    return WorkspaceSpec(image=image, workdir=env_config.workdir, env=env, limits=limits)


async def prepare_logs(ws: Workspace) -> None:
    """Harbor's log folders (/logs/agent, /logs/verifier, /logs/artifacts), writable by everyone as Harbor's
    bind mounts are (chmod 777)."""
    dirs = " ".join((AGENT_LOGS, VERIFIER_LOGS, ARTIFACTS_DIR))
    result = await ws.exec(f"mkdir -p {dirs} && chmod 777 {dirs}", user=0, timeout_s=60)
    if result.status != "ok":
        raise WorkspaceError(f"could not make the log folders in workspace {ws.id}: {result.stderr or result.reason}")


async def open_task_workspace(task: HarborTask, *, image: str | None = None,
                              open_workspace: OpenWorkspace | None = None,
                              network: str | None = None, limits: Limits | None = None) -> Workspace:
    """A started workspace for the task's agent: the image (built if needed), Harbor's log folders, environment/
    uploaded into a prebuilt image's workdir when Harbor would. The network is the agent phase's
    (`[agent].network_mode`, else the environment's) unless `network` says otherwise."""
    image = image or await task_image(task)
    spec = workspace_spec(task, image, network=network or task.config.agent.network_mode, limits=limits)
    ws = await (open_workspace or docker_open)(spec)
    try:
        await prepare_logs(ws)
        if uploads_environment_dir(task, image):
            await ws.upload(task.environment_dir, ws.workdir)
    except BaseException:
        await ws.close()
        raise
    return ws


def agent_user(task: HarborTask, ws: Workspace) -> str | int | None:
    """Who the agent runs as: `[agent].user`, else the image's USER (None: root)."""
    return task.config.agent.user if task.config.agent.user is not None else ws.default_user


def verifier_user(task: HarborTask, ws: Workspace) -> str | int | None:
    return task.config.verifier.user if task.config.verifier.user is not None else ws.default_user


def q(path: str) -> str:
    return shlex.quote(path)
