"""The `allowlist` network: an HTTP(S) proxy on the host that lets a workspace reach only `allowed_hosts`.

Workspaces of that mode sit on an internal Docker network (no route out) and get `HTTP_PROXY` / `HTTPS_PROXY`
pointing at this proxy on the network's gateway address. `CONNECT host:port` (HTTPS) and absolute-URI requests
(plain HTTP) are forwarded when the host matches an allowed entry (`example.org`, `*.example.org`, an IP or a
CIDR); everything else gets 403. Programs that ignore the proxy variables reach nothing: it fails closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from urllib.parse import urlsplit

from slime_env.tools_sandbox.workspace.types import WorkspaceError

NETWORK_PREFIX = "slime-env-allowlist-"


def host_allowed(host: str, allowed: tuple[str, ...]) -> bool:
    """Whether `host` matches one of `allowed` (exact names, `*.suffix`, IPs, CIDRs; case-insensitive)."""
    host = host.strip("[]").lower().rstrip(".")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    for entry in allowed:
        entry = entry.lower().rstrip(".")
        if entry.startswith("*."):
            if host.endswith(entry[1:]) and host != entry[2:]:
                return True
        elif "/" in entry and address is not None:
            with contextlib.suppress(ValueError):
                if address in ipaddress.ip_network(entry, strict=False):
                    return True
        elif host == entry:
            return True
    return False


class AllowlistProxy:
    """One proxy per allowed-host list, listening on `host` (the internal network's gateway); `await start()`,
    `url`, `await close()`. Counts what it forwarded and refused (`forwarded`, `refused`)."""

    def __init__(self, allowed_hosts: tuple[str, ...], *, host: str = "127.0.0.1", port: int = 0):
        self.allowed, self.host, self.port = tuple(allowed_hosts), host, port
        self.forwarded = self.refused = 0
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> AllowlistProxy:
        try:
            self._server = await asyncio.start_server(self._serve, self.host, self.port)
        except OSError as e:
            raise WorkspaceError(f"the allowlist proxy could not listen on {self.host}:{self.port}: {e}") from None
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            async with asyncio.timeout(30):
                head = await reader.readuntil(b"\r\n\r\n")
            method, target, _ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
            if method.upper() == "CONNECT":
                host, _, port = target.rpartition(":")
                rest = b""
            else:
                url = urlsplit(target)
                host, port = url.hostname or "", str(url.port or 80)
                path = (url.path or "/") + (f"?{url.query}" if url.query else "")
                rest = head.replace(target.encode("latin-1"), path.encode("latin-1"), 1)
            if not host or not port.isdigit() or not host_allowed(host, self.allowed):
                self.refused += 1
                writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                await writer.drain()
                return
            try:
                async with asyncio.timeout(30):
                    up_reader, up_writer = await asyncio.open_connection(host.strip("[]"), int(port))
            except (OSError, TimeoutError):
                writer.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                await writer.drain()
                return
            self.forwarded += 1
            if rest:
                up_writer.write(rest)
            else:
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            pass
        finally:
            self._tasks.discard(task)
            writer.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (OSError, ConnectionError):
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            writer.close()
