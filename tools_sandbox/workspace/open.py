"""`open_workspace(spec, backend=)`: start one workspace on a backend, with its wall time and disk watched and, for
the `allowlist` network, the internal network and proxy it needs."""

from __future__ import annotations

import asyncio
import os
import uuid
import weakref
from typing import Any

from slime_env.tools_sandbox.workspace.base import Workspace
from slime_env.tools_sandbox.workspace.types import WorkspaceError, WorkspaceSpec
from slime_env.tools_sandbox.workspace.watchdog import Watchdog

BACKENDS = ("docker", "bwrap")
_RUN_ID = os.environ.get("SLIME_ENV_RUN_ID") or uuid.uuid4().hex[:12]
_networks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def run_id() -> str:
    """This process's run id (labels every workspace it starts; `SLIME_ENV_RUN_ID` sets it)."""
    return _RUN_ID


async def open_workspace(spec: WorkspaceSpec, *, backend: str = "docker", client=None,
                         run: str | None = None) -> Workspace:
    """A started workspace for `spec` on `backend` (`docker`, `bwrap`, or `auto`: Docker if an engine answers);
    WorkspaceError naming the image or the backend's missing piece."""
    if backend == "auto":
        backend = await asyncio.to_thread(_auto_backend)
    if backend == "docker":
        from slime_env.tools_sandbox.workspace.docker import DockerWorkspace, docker_client

        client = client or await asyncio.to_thread(docker_client)
        network, env, release = None, {}, None
        if spec.limits.network == "allowlist":
            network, proxy_url, release = await _allowlist_network(client, spec.limits.allowed_hosts, run or _RUN_ID)
            env = {name: proxy_url for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")}
            env |= {"NO_PROXY": "localhost,127.0.0.1", "no_proxy": "localhost,127.0.0.1"}
        if env:
            from dataclasses import replace

            spec = replace(spec, env={**env, **spec.env})
        try:
            workspace = await DockerWorkspace.start(spec, client=client, run_id=run or _RUN_ID, network=network)
        except BaseException:
            if release is not None:
                await release()
            raise
        if release is not None:
            workspace.on_stop(release)
    elif backend == "bwrap":
        from slime_env.tools_sandbox.workspace.bwrap import BwrapWorkspace

        workspace = await BwrapWorkspace.start(spec, run_id=run or _RUN_ID)
    else:
        raise WorkspaceError(f"unknown workspace backend {backend!r}: use one of {BACKENDS} or 'auto'")
    Watchdog.for_loop().watch(workspace)
    return workspace


def _auto_backend() -> str:
    from slime_env.tools_sandbox.workspace.docker import docker_client

    try:
        docker_client(timeout_s=10)
        return "docker"
    except WorkspaceError:
        return "bwrap"


def internal_network(client, prefix: str, run: str) -> tuple[Any, str]:
    """(network, its gateway address): a new internal Docker bridge network (no route out) named `prefix`, `run` and
    a random tail, labelled as ours so that the reaper finds it. Blocking: call it in a thread."""
    from slime_env.tools_sandbox.workspace.docker import LABEL, OWNER_LABEL, RUN_LABEL, owner_id

    net = client.networks.create(f"{prefix}{run}-{uuid.uuid4().hex[:6]}", driver="bridge", internal=True,
                                 labels={LABEL: "network", OWNER_LABEL: owner_id(), RUN_LABEL: run})
    net.reload()
    return net, net.attrs["IPAM"]["Config"][0]["Gateway"]


async def _allowlist_network(client, allowed: tuple[str, ...], run: str):
    """(internal network name, proxy URL, release) for `allowed`: one network and proxy per event loop and host list,
    shared by the workspaces that use it; `await release()` when one stops (the last one removes both)."""
    from slime_env.tools_sandbox.workspace.proxy import NETWORK_PREFIX, AllowlistProxy

    loop = asyncio.get_running_loop()
    per_loop = _networks.setdefault(loop, {})
    key = tuple(sorted(allowed))
    if key not in per_loop:
        net, gateway = await asyncio.to_thread(internal_network, client, NETWORK_PREFIX, run)
        try:
            proxy = await AllowlistProxy(key, host=gateway).start()
        except BaseException:
            await asyncio.to_thread(net.remove)
            raise
        per_loop[key] = {"net": net, "proxy": proxy, "users": 0}
    entry = per_loop[key]
    entry["users"] += 1

    async def release() -> None:
        entry["users"] -= 1
        if entry["users"] == 0 and per_loop.get(key) is entry:
            del per_loop[key]
            await entry["proxy"].close()
            try:
                await asyncio.to_thread(entry["net"].remove)
            except Exception:  # noqa: BLE001 - the reaper removes what is left
                pass

    return entry["net"].name, entry["proxy"].url, release
