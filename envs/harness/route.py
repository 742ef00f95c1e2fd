"""How a harness inside a workspace reaches the gateway, and nothing else.

Docker: the workspace sits on an internal network of its own (no route out: `internal=True`, one per event loop,
labelled for the reaper, removed with its last workspace), and a TCP relay listening on that network's gateway address
forwards to the gateway on the host's loopback. The harness is given the relay's address as its base URL; the rest of
the host and the internet stay unreachable (the gateway itself binds to 127.0.0.1). Bubblewrap: the workspace shares
the host's network namespace (`network="public"`), so it reaches 127.0.0.1 directly — use Docker where the network
must be closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from dataclasses import replace
from urllib.parse import urlsplit, urlunsplit

from slime_env.tools_sandbox.workspace import Workspace, WorkspaceError, WorkspaceSpec

NETWORK_PREFIX = "slime-env-harness-"
_nets: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loop -> {"name", "gateway", "users", "relays"}
_locks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loop -> the lock that makes its network once


async def start_workspace(spec: WorkspaceSpec, *, backend: str = "docker") -> Workspace:
    """A started workspace for `spec` from which the gateway is reachable (module docstring)."""
    from slime_env.tools_sandbox.workspace.open import open_workspace, run_id
    from slime_env.tools_sandbox.workspace.watchdog import Watchdog

    if backend == "bwrap":
        return await open_workspace(spec.with_limits(network="public", allowed_hosts=()), backend="bwrap")
    if backend != "docker":
        raise WorkspaceError(f"unknown workspace backend {backend!r} for a harness: 'docker' or 'bwrap'")
    from slime_env.tools_sandbox.workspace.docker import DockerWorkspace, docker_client

    client = await asyncio.to_thread(docker_client)
    net = await _network(client, run_id())
    spec = replace(spec.with_limits(network="public", allowed_hosts=()),
                   env={**spec.env, "NO_PROXY": "*", "no_proxy": "*"})
    try:
        ws = await DockerWorkspace.start(spec, client=client, run_id=run_id(), network=net["name"])
    except BaseException:
        await _release(net)
        raise
    ws.harness_route = net  # type: ignore[attr-defined]
    ws.on_stop(lambda: _release(net))
    Watchdog.for_loop().watch(ws)
    return ws


async def gateway_url_for(ws: Workspace, url: str) -> str:
    """`url` (the gateway's, on 127.0.0.1) as the harness in `ws` reaches it."""
    net = getattr(ws, "harness_route", None)
    if net is None:  # bubblewrap on the host's network: loopback is the host's
        return url
    parts = urlsplit(url)
    target = (parts.hostname or "127.0.0.1", parts.port or 80)
    async with _locks.setdefault(asyncio.get_running_loop(), asyncio.Lock()):  # one relay per gateway
        relay = net["relays"].get(target)
        if relay is None:
            relay = net["relays"][target] = await asyncio.start_server(
                lambda r, w: _relay(r, w, target), net["gateway"], 0)
    port = relay.sockets[0].getsockname()[1]
    return urlunsplit((parts.scheme, f"{net['gateway']}:{port}", parts.path, parts.query, parts.fragment))


async def _network(client, run: str) -> dict:
    loop = asyncio.get_running_loop()
    async with _locks.setdefault(loop, asyncio.Lock()):  # episodes starting at once share one network
        return await _network_locked(client, run, loop)


async def _network_locked(client, run: str, loop: asyncio.AbstractEventLoop) -> dict:
    from slime_env.tools_sandbox.workspace.open import internal_network

    net = _nets.get(loop)
    if net is None:
        handle, gateway = await asyncio.to_thread(internal_network, client, NETWORK_PREFIX, run)
        net = _nets[loop] = {"name": handle.name, "handle": handle, "gateway": gateway, "users": 0, "relays": {}}
    net["users"] += 1
    return net


async def _release(net: dict) -> None:
    net["users"] -= 1
    if net["users"] > 0:
        return
    loop = asyncio.get_running_loop()
    if _nets.get(loop) is net:
        del _nets[loop]
    for server in net["relays"].values():
        server.close()
        with contextlib.suppress(Exception):
            await server.wait_closed()
    with contextlib.suppress(Exception):  # the reaper removes what is left
        await asyncio.to_thread(net["handle"].remove)


async def _relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, target: tuple[str, int]) -> None:
    try:
        up_reader, up_writer = await asyncio.open_connection(*target)
    except OSError:
        writer.close()
        return
    await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer), return_exceptions=True)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    finally:
        with contextlib.suppress(Exception):
            writer.close()
