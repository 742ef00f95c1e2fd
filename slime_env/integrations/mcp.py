"""MCP servers as tools of a `ToolEnv`: `ToolEnv([MCPServer(["python", "server.py"])])` (extra `[mcp]`).

`MCPServer` connects with the official `mcp` SDK to a server started as a subprocess over stdio
(`command=[...]`) or reachable over streamable HTTP (`url=`), lists its tools (their JSON schemas
go to the chat template as they are) and calls them for the env. One connection is shared by every
episode of an event loop (`per_episode=False`, the default) or opened per episode and closed with
it (`per_episode=True`: a server that keeps per-session state). Every call has a timeout; a server
that errors, hangs or dies gives the model an error observation, never a hang, and the next call
reconnects (at most `max_reconnects` times in a row). A server that cannot be reached fails `reset`
with the reason, so the episode is recorded as failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from slime_env.errors import InvalidInput
from slime_env.tools import Tool

log = logging.getLogger("slime_env.mcp")


class MCPConnectionError(ConnectionError):
    """The MCP server could not be reached, or closed the connection."""


class MCPToolError(RuntimeError):
    """The MCP server reported that the tool call failed (`isError`)."""


class MCPServer:
    """An MCP server whose tools a `ToolEnv` calls (see the module docstring).

    `command` (argv of a stdio server; `env`, `cwd` for it) or `url` (streamable HTTP). `timeout_s` bounds
    each call of this server's tools (None, the default: the `ToolEnv`'s `tool_timeout_s` does; given, it wins over
    the env's for these tools), `connect_timeout_s` the connection and the tool listing. A stdio server's stderr
    is kept (its last 200 lines: `stderr()`), logged at DEBUG, and quoted in connection errors — never written
    into this process's stderr. `include` keeps only the named tools;
    `prefix` is prepended to their names (two servers with a `search` tool). `close()` ends a shared connection.
    `max_concurrency` bounds the calls in flight to this server (1 for a server whose state is not safe under
    concurrent calls, e.g. one that rewrites a file per call); `tool_concurrency` does the same per tool name.
    Tools that can only be called task-augmented (`execution.taskSupport: "required"`) are not offered:
    `skipped_tools` names them with the reason. Every call asks for progress notifications: `progress[tool]` holds
    how many arrived over all calls and the last one (`progress`, `total`, `message`); they are logged at DEBUG.
    """

    def __init__(self, command: Sequence[str] | None = None, *, url: str | None = None,
                 env: Mapping[str, str] | None = None, cwd: str | None = None, per_episode: bool = False,
                 timeout_s: float | None = None, connect_timeout_s: float = 30.0, include: Sequence[str] | None = None,
                 prefix: str = "", max_reconnects: int = 3, name: str | None = None,
                 max_concurrency: int | None = None, tool_concurrency: Mapping[str, int] | None = None):
        if (command is None) == (url is None):
            raise InvalidInput("MCPServer needs exactly one of command=[...] (stdio) or url= (streamable HTTP)")
        if command is not None and (isinstance(command, str) or not command):
            raise InvalidInput("MCPServer command must be a non-empty list: the program and its arguments")
        self.command, self.url = (list(command) if command is not None else None), url
        self.env, self.cwd = dict(env) if env else None, cwd
        self.per_episode, self.timeout_s, self.connect_timeout_s = per_episode, timeout_s, connect_timeout_s
        self.include = set(include) if include is not None else None
        self.prefix, self.max_reconnects = prefix, max_reconnects
        self.name = name or (" ".join(self.command) if self.command else url)
        for limit in [max_concurrency, *(tool_concurrency or {}).values()]:
            if limit is not None and (not isinstance(limit, int) or limit < 1):
                raise InvalidInput(f"MCPServer {self.name!r}: concurrency limits must be integers >= 1, got {limit!r}")
        self.max_concurrency, self.tool_concurrency = max_concurrency, dict(tool_concurrency or {})
        self.skipped_tools: dict[str, str] = {}
        self.progress: dict[str, dict[str, Any]] = {}
        self._shared: _Holder | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return f"MCPServer({self.name!r})"

    def stderr(self, lines: int = 20) -> str:
        """The last `lines` lines the (current connection's) stdio server wrote to its stderr."""
        holder = self._shared
        conn = holder.conn if holder is not None else None
        return conn.errlog.tail(lines) if conn is not None and conn.errlog is not None else ""

    async def episode_tools(self) -> tuple[list[Tool], Callable[[], Awaitable[None]] | None]:
        """The server's tools for one episode, and what releases them (None for a shared connection)."""
        if self.per_episode:
            holder = _Holder(self)
            await holder.live()
            return holder.tools(), holder.close
        holder = await self._shared_holder()
        await holder.live()
        return holder.tools(), None

    async def close(self) -> None:
        """Close the shared connection (a later episode opens a new one)."""
        holder, self._shared = self._shared, None
        if holder is not None:
            await holder.close()

    async def __aenter__(self) -> MCPServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _shared_holder(self) -> _Holder:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # a connection belongs to the event loop that opened it
            self._loop, self._shared = loop, None
        if self._shared is None:
            self._shared = _Holder(self)
        return self._shared

    def _target(self, errlog: Any = None) -> Any:
        from mcp import StdioServerParameters
        from mcp.client.stdio import stdio_client

        if self.url is not None:
            return self.url
        params = StdioServerParameters(command=self.command[0], args=self.command[1:], env=self.env, cwd=self.cwd)
        return stdio_client(params, errlog=errlog.file) if errlog is not None else params


class _Holder:
    """A connection that is reopened when it dies; the tools it lists call through it."""

    def __init__(self, server: MCPServer):
        self.server = server
        self.conn: _Connection | None = None
        self.failures = 0
        self.listed: list[Any] = []
        self._lock = asyncio.Lock()
        self._closed = False
        limit = server.max_concurrency
        self._server_slots = asyncio.Semaphore(limit) if limit else None
        self._tool_slots = {name: asyncio.Semaphore(n) for name, n in server.tool_concurrency.items()}

    async def live(self) -> _Connection:
        async with self._lock:
            if self._closed:
                raise MCPConnectionError(f"MCP server {self.server.name!r}: connection was closed")
            if self.conn is not None and self.conn.alive:
                return self.conn
            if self.conn is not None:
                await self.conn.close()
                self.conn = None
                self.failures += 1
                if self.failures > self.server.max_reconnects:
                    raise MCPConnectionError(f"MCP server {self.server.name!r} failed {self.failures} times; "
                                             f"not reconnecting (max_reconnects={self.server.max_reconnects})")
            conn = _Connection(self.server)
            await conn.start()
            self.conn, self.listed = conn, conn.tools
            return conn

    def tools(self) -> list[Tool]:
        out = []
        for t in self.listed:
            if self.server.include is not None and t.name not in self.server.include:
                continue
            if getattr(getattr(t, "execution", None), "task_support", None) == "required":
                self.server.skipped_tools[t.name] = ("execution.taskSupport is 'required': it can only be called "
                                                     "task-augmented, which this client does not do")
                continue
            out.append(Tool(name=self.server.prefix + t.name, description=t.description or "",
                            parameters=dict(t.input_schema or {"type": "object", "properties": {}}),
                            call=self._caller(t.name), timeout_s=self.server.timeout_s))
        return out

    def _caller(self, remote_name: str) -> Callable[[dict[str, Any], Mapping[str, Any]], Awaitable[Any]]:
        async def call(arguments: dict[str, Any], injected: Mapping[str, Any]) -> Any:
            async with contextlib.AsyncExitStack() as slots:
                for slot in (self._server_slots, self._tool_slots.get(remote_name)):
                    if slot is not None:
                        await slots.enter_async_context(slot)
                conn = await self.live()
                result = await conn.call(remote_name, arguments)
            self.failures = 0
            return result

        return call

    async def close(self) -> None:
        async with self._lock:
            self._closed = True
            conn, self.conn = self.conn, None
        if conn is not None:
            await conn.close()


class _Connection:
    """One MCP client session, held open by a task of its own (the SDK's context managers must be
    entered and left in the same task; episodes call from theirs)."""

    def __init__(self, server: MCPServer):
        self.server = server
        self.tools: list[Any] = []
        self.client: Any = None
        self._task: asyncio.Task | None = None
        self._ready: asyncio.Future | None = None
        self._stop = asyncio.Event()
        self._dead: str | None = None
        self.errlog = _StderrTail(server.name) if server.command is not None else None

    @property
    def alive(self) -> bool:
        return self._dead is None and self._task is not None and not self._task.done()

    async def start(self) -> None:
        self._ready = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._hold(), name=f"mcp {self.server.name}")
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), self.server.connect_timeout_s)
        except TimeoutError:
            await self.close()
            raise MCPConnectionError(f"MCP server {self.server.name!r} did not answer within "
                                     f"{self.server.connect_timeout_s:g}s") from None

    async def _hold(self) -> None:
        from mcp import Client

        try:
            async with Client(self.server._target(self.errlog),
                              read_timeout_seconds=self.server.connect_timeout_s) as client:
                listed = await client.list_tools()
                self.client, self.tools = client, list(listed.tools)
                self._ready.set_result(None)
                await self._stop.wait()
        except BaseException as e:  # noqa: BLE001 - recorded for the caller; a cancelled hold is a close
            self._dead = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            if not self._ready.done():
                self._ready.set_exception(MCPConnectionError(
                    f"cannot connect to MCP server {self.server.name!r}: {_cause(e)}{self._stderr_note()}"))
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            if self._dead is None:
                self._dead = "closed"
            if self.errlog is not None:
                self.errlog.close()

    def _progress(self, tool: str) -> Callable[..., Awaitable[None]]:
        async def on_progress(progress: float, total: float | None = None, message: str | None = None) -> None:
            seen = self.server.progress.setdefault(tool, {"notifications": 0})
            seen.update(notifications=seen["notifications"] + 1, progress=progress, total=total, message=message)
            log.debug("%s %s progress %s/%s %s", self.server.name, tool, progress, total, message or "")

        return on_progress

    def _stderr_note(self) -> str:
        tail = self.errlog.tail(5) if self.errlog is not None else ""
        return f"; its stderr ended with: {tail!r}" if tail else ""

    async def call(self, name: str, arguments: dict[str, Any]) -> Any:
        from mcp import MCPError

        try:
            # Without a timeout of its own the ToolEnv's bounds the call (it cancels this await); the SDK's read
            # timeout then only guards against a server that never answers.
            result = await self.client.call_tool(name, arguments, read_timeout_seconds=self.server.timeout_s or 3600.0,
                                                 progress_callback=self._progress(name))
        except MCPError as e:
            if not self.alive or "closed" in str(e).lower():
                self._dead = self._dead or str(e)
                await asyncio.sleep(0.05)  # the dying server's last stderr lines reach the reader
                raise MCPConnectionError(f"MCP server {self.server.name!r} closed the connection ({e}); "
                                         f"the next call reconnects{self._stderr_note()}") from None
            raise
        text = _result_text(result)
        if result.is_error:
            raise MCPToolError(text)
        from slime_env.tools import ToolOutput

        # the raw blocks (URIs, blobs, images as the server sent them) stay on the call's ToolRecord for the env
        raw = {"content": [b.model_dump(mode="json", by_alias=True, exclude_none=True) for b in result.content or ()]}
        if result.structured_content is not None:
            raw["structured_content"] = result.structured_content
        return ToolOutput(text, raw)

    async def close(self) -> None:
        self._stop.set()
        task = self._task
        if task is None or task.done():
            return
        try:
            await asyncio.wait_for(asyncio.shield(task), 10.0)
        except (TimeoutError, Exception):  # noqa: BLE001 - a server that will not stop is cancelled
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


class _StderrTail:
    """A stdio server's stderr: a pipe read by a daemon thread that keeps the last `lines` lines (bounded) and logs
    each at DEBUG."""

    def __init__(self, name: str, lines: int = 200):
        read_fd, write_fd = os.pipe()
        self.file = os.fdopen(write_fd, "w")  # the SDK passes it to the server process as its stderr
        self.lines: deque[str] = deque(maxlen=lines)
        self.name = name
        threading.Thread(target=self._read, args=(read_fd,), daemon=True, name=f"mcp-stderr {name}").start()

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "r", errors="replace") as f:
            for line in f:
                self.lines.append(line.rstrip("\n"))
                log.debug("%s stderr: %s", self.name, line.rstrip("\n"))

    def tail(self, n: int = 20) -> str:
        return "\n".join(list(self.lines)[-n:])

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()  # our copy of the write end: the reader ends when the server's goes too


def _cause(error: BaseException) -> str:
    """The first real cause inside anyio's exception groups."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _result_text(result: Any) -> str:
    """A `CallToolResult` as text a model can use: text blocks as they are; a text resource inline under its URI; a
    resource link, a binary resource, an image or audio as a line with URI, name, MIME type and size; structured
    content as JSON when there is nothing else."""
    parts = []
    for block in result.content or ():
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind == "resource":
            res = block.resource
            if getattr(res, "text", None) is not None:
                parts.append(f"[resource {res.uri}{_mime(res)}]\n{res.text}")
            else:
                parts.append(f"[binary resource {res.uri}{_mime(res, _b64_size(getattr(res, 'blob', '')))}]")
        elif kind == "resource_link":
            about = f": {block.description}" if getattr(block, "description", None) else ""
            parts.append(f"[resource link {block.name} <{block.uri}>{_mime(block, block.size)}{about}]")
        elif kind in ("image", "audio"):
            parts.append(f"[{kind}{_mime(block, _b64_size(block.data))}]")
        else:
            parts.append(f"[{kind or type(block).__name__} content]")
    if not parts and result.structured_content is not None:
        import json

        parts.append(json.dumps(result.structured_content, ensure_ascii=False, default=str))
    return "\n".join(parts)


def _mime(block: Any, size: int | None = None) -> str:
    bits = [b for b in (getattr(block, "mime_type", None) or getattr(block, "mimeType", None),
                        f"{size} bytes" if size is not None else None) if b]
    return f" ({', '.join(bits)})" if bits else ""


def _b64_size(data: str) -> int | None:
    """Decoded size of base64 `data` (None when it is not base64)."""
    import base64
    import binascii

    try:
        return len(base64.b64decode(data or "", validate=True))
    except (binascii.Error, ValueError):
        return None


__all__ = ["MCPConnectionError", "MCPServer", "MCPToolError"]
