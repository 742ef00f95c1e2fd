"""HTTP plumbing shared by the remote clients (engines, env servers): pooled aiohttp sessions,
timeouts and retries.

Retries (with exponential backoff and jitter) happen on connection errors and 5xx answers only:
a 4xx is the request's fault and is raised at once with the server's message.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import aiohttp
import orjson

from slime_env.errors import SlimeEnvError

_JSON_HEADERS = {"Content-Type": "application/json"}


def json_dumps(value: Any) -> bytes:
    """JSON bytes of a request body: orjson (several times faster on long id lists) where it can encode the value,
    the standard library otherwise (e.g. integers beyond 64 bits)."""
    try:
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY)
    except TypeError:  # orjson.JSONEncodeError
        return json.dumps(value).encode()


def json_loads(raw: bytes | str) -> Any:
    """Parse a JSON answer (orjson; the standard library for what only it accepts, like NaN)."""
    try:
        return orjson.loads(raw)
    except ValueError:  # orjson.JSONDecodeError
        return json.loads(raw)


class RemoteError(SlimeEnvError):
    """A server answered with an error, or could not be reached after all retries."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class ProtocolError(RemoteError):
    """A server answered, but not in the shape the protocol requires (e.g. no log-probs)."""


class HttpClient:
    """One pooled aiohttp session per event loop, with retrying JSON requests."""

    def __init__(self, base_url: str, *, max_connections: int = 256, timeout_s: float = 600.0,
                 connect_timeout_s: float = 10.0, max_retries: int = 3, backoff_s: float = 0.2,
                 headers: Mapping[str, str] | None = None):
        self.base_url = base_url.rstrip("/")
        self.max_connections = max_connections
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.headers = dict(headers or {})
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closer: Any = None  # see _close_at_loop_shutdown
        self.retries = 0  # total retries made, for metrics and tests

    def __getstate__(self) -> dict[str, Any]:
        # A copy in another process (a rollout worker) opens its own pool on first use.
        return {**self.__dict__, "_session": None, "_loop": None, "_closer": None}

    def session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            # aiohttp sessions belong to one loop; a new loop (e.g. a new asyncio.run) gets a new pool
            connector = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=self.max_connections)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self.timeout, headers=self.headers)
            self._loop = loop
        return self._session

    async def request(self, method: str, path: str, body: Any = None, *,
                      headers: Mapping[str, str] | None = None, expect_json: bool = True,
                      max_retries: int | None = None) -> Any:
        """`max_retries` overrides the client's (0 for calls that must not run twice, like an env step)."""
        url = f"{self.base_url}{path}"
        last: Exception | None = None
        retries = self.max_retries if max_retries is None else max_retries
        data = None if body is None else json_dumps(body)
        send_headers = headers if body is None else {**_JSON_HEADERS, **headers} if headers else _JSON_HEADERS
        session = self.session()
        if self._closer is None or self._closer[0] is not session:
            # Close this pool when its event loop shuts down (asyncio.run and friends finalise async
            # generators before closing the loop), even if nobody calls close(): slime, for one, never does.
            closer = _close_at_loop_shutdown(session)
            await closer.__anext__()
            self._closer = (session, closer)
        for attempt in range(retries + 1):
            if attempt:
                self.retries += 1
                await asyncio.sleep(self.backoff_s * (2 ** (attempt - 1)) * (0.5 + random.random()))
                session = self.session()  # closed meanwhile (close() from elsewhere): a fresh pool
            try:
                async with session.request(method, url, data=data, headers=send_headers) as resp:
                    raw = await resp.read()
                    if resp.status >= 400:
                        text = raw.decode("utf-8", "replace")
                        if resp.status >= 500:
                            last = RemoteError(f"{method} {url} answered {resp.status}: {text[:300]}", resp.status)
                            continue
                        raise RemoteError(f"{method} {url} answered {resp.status}: {text[:500]}", resp.status)
                    if not expect_json:
                        return raw.decode("utf-8", "replace")
                    try:
                        return json_loads(raw)
                    except ValueError:
                        raise ProtocolError(f"{method} {url} answered non-JSON: {raw[:200]!r}") from None
            except aiohttp.ClientConnectionError as e:  # refused, reset, server disconnected
                last = RemoteError(f"{method} {url}: connection failed: {e!r}")
        raise RemoteError(f"{last} (after {retries} retries)",
                          getattr(last, "status", None)) from last

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None


async def _close_at_loop_shutdown(session: aiohttp.ClientSession) -> AsyncIterator[None]:
    """Started once per session; suspended until the loop's `shutdown_asyncgens()` closes it, then closes the
    session on that loop while it still runs (no "Unclosed client session", no leaked sockets)."""
    try:
        yield  # never resumed: only aclose() (the loop's shutdown, or garbage collection) ends it
    finally:
        if not session.closed:
            await session.close()


def serve_forever(make_app: Callable[[], Any], *, host: str, port: int, backlog: int = 128,
                  on_exit: Callable[[], Awaitable[None]] | None = None) -> None:
    """Serve the aiohttp app `make_app()` until interrupted (every `slime-env serve-*` command).

    Prints `listening on http://HOST:PORT` once bound (port 0 picks a free one): tests and scripts wait
    for that line. `on_exit` runs after the server stops (close pools, sandboxes, retrievers).
    """
    from aiohttp import web

    async def main() -> None:
        runner = web.AppRunner(make_app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port, backlog=backlog)
        await site.start()
        print(f"listening on http://{host}:{site._server.sockets[0].getsockname()[1]}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()
            if on_exit is not None:
                await on_exit()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
