"""The host side of the workspace agent's protocol (`agent.c` states the frame format).

`AgentConnection` sends requests over a byte stream (a container's attach socket, a bubblewrap process's pipes) and
routes each answer to its caller by request id, so many requests are in flight at once.
"""

from __future__ import annotations

import asyncio
import itertools
import struct
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from slime_env.tools_sandbox.workspace.types import FileInfo

OPS = {"exec": 1, "read": 2, "write": 3, "list": 4, "killall": 5, "cancel": 6, "ping": 7}
K_EXEC_DONE, K_OK, K_DATA, K_ERRNO, K_LIST, K_READY = 1, 2, 3, 4, 5, 6
TAGS = {"arg": 1, "env": 2, "cwd": 3, "stdin": 4, "timeout_ms": 5, "output_limit": 6, "uid": 7, "gid": 8, "path": 9,
        "data": 10, "mode": 11, "parents": 12, "max_bytes": 13, "target": 14, "detach": 15}
T_EXIT, T_TIMED_OUT, T_OUTPUT_EXCEEDED, T_DURATION_US, T_STDOUT, T_STDERR = 20, 21, 22, 23, 24, 25
T_SPAWN_ERROR, T_ERRNO, T_ENTRY, T_KILLED = 26, 27, 28, 29
_KINDS = {"f": "file", "d": "dir", "l": "link", "o": "other"}


class AgentGone(ConnectionError):
    """The agent's stream ended (the workspace stopped, was killed, or its agent crashed)."""


def _field(tag: int, value: bytes) -> bytes:
    return struct.pack("<BI", tag, len(value)) + value


def encode(request_id: int, op: str, fields: Mapping[str, Any]) -> bytes:
    """One request frame: `fields` are strings, bytes, ints, bools, lists (argv) or dicts (env)."""
    body = [struct.pack("<IB", request_id, OPS[op])]
    for name, value in fields.items():
        if value is None:
            continue
        if name == "argv":
            body.extend(_field(TAGS["arg"], a.encode()) for a in value)
        elif name == "env":
            body.extend(_field(TAGS["env"], f"{k}={v}".encode()) for k, v in value.items())
        elif isinstance(value, bool | int):
            body.append(_field(TAGS[name], struct.pack("<q", int(value))))
        else:
            body.append(_field(TAGS[name], value if isinstance(value, bytes) else str(value).encode()))
    payload = b"".join(body)
    return struct.pack("<I", len(payload)) + payload


def decode(frame: bytes) -> tuple[int, int, dict[str, Any]]:
    """(request id, kind, fields) of one answer frame (without its length prefix)."""
    request_id, kind = struct.unpack_from("<IB", frame)
    out: dict[str, Any] = {}
    entries: list[FileInfo] = []
    off = 5
    while off < len(frame):
        tag, length = struct.unpack_from("<BI", frame, off)
        value = frame[off + 5: off + 5 + length]
        off += 5 + length
        if tag in (T_EXIT, T_TIMED_OUT, T_OUTPUT_EXCEEDED, T_DURATION_US, T_ERRNO, T_KILLED):
            number = struct.unpack("<q", value)[0]
            out[{T_EXIT: "exit_code", T_TIMED_OUT: "timed_out", T_OUTPUT_EXCEEDED: "output_exceeded",
                 T_DURATION_US: "duration_us", T_ERRNO: "errno", T_KILLED: "killed"}[tag]] = number
        elif tag == T_STDOUT:
            out["stdout"] = value
        elif tag == T_STDERR:
            out["stderr"] = value
        elif tag == T_SPAWN_ERROR:
            out["spawn_error"] = value.decode("utf-8", "replace")
        elif tag == TAGS["data"]:
            out["data"] = value
        elif tag == T_ENTRY:
            size, mode = struct.unpack_from("<qI", value, 1)
            entries.append(FileInfo(name=value[13:].decode("utf-8", "surrogateescape"),
                                    kind=_KINDS.get(chr(value[0]), "other"), size=size, mode=mode))
    if kind == K_LIST:
        out["entries"] = sorted(entries, key=lambda e: e.name)
    if kind == K_EXEC_DONE and "spawn_error" not in out:
        out["timed_out"] = bool(out.get("timed_out"))
        out["output_exceeded"] = bool(out.get("output_exceeded"))
        out["duration_s"] = out.pop("duration_us", 0) / 1e6
        out.setdefault("stdout", b"")
        out.setdefault("stderr", b"")
    return request_id, kind, out


class AgentConnection:
    """Requests to one agent over `read()` (the agent's stdout bytes; b"" at the end) and `write(data)`.

    `await ready()` waits for the agent's hello; `await request(op, **fields)` returns the answer's fields.
    `close()` stops reading and fails every pending request with `AgentGone`.
    """

    def __init__(self, read: Callable[[], Awaitable[bytes]], write: Callable[[bytes], Awaitable[None]],
                 on_close: Callable[[], None] | None = None):
        self._read, self._write, self._on_close = read, write, on_close
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._ready = asyncio.get_running_loop().create_future()
        self._closed: str | None = None
        self._reader = asyncio.get_running_loop().create_task(self._read_loop())
        self._write_lock = asyncio.Lock()

    async def ready(self, timeout_s: float = 30.0) -> None:
        async with asyncio.timeout(timeout_s):
            await asyncio.shield(self._ready)

    async def request(self, op: str, **fields: Any) -> dict[str, Any]:
        if self._closed is not None:
            raise AgentGone(self._closed)
        request_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            async with self._write_lock:
                await self._write(encode(request_id, op, fields))
            kind, answer = await future
        except asyncio.CancelledError:
            if op == "exec" and self._closed is None:  # the caller gave up: the command's process group goes too
                try:
                    async with self._write_lock:
                        await self._write(encode(next(self._ids), "cancel", {"target": request_id}))
                except Exception:  # noqa: BLE001 - the stream is gone: the command died with it
                    pass
            raise
        except (OSError, ConnectionError) as e:
            raise AgentGone(f"writing to the agent failed: {e}") from None
        finally:
            self._pending.pop(request_id, None)
        return answer

    async def _read_loop(self) -> None:
        buf = bytearray()
        reason = "the agent's stream ended"
        try:
            while True:
                chunk = await self._read()
                if not chunk:
                    break
                buf += chunk
                while len(buf) >= 4:
                    (length,) = struct.unpack_from("<I", buf)
                    if len(buf) < 4 + length:
                        break
                    frame = bytes(buf[4: 4 + length])
                    del buf[: 4 + length]
                    request_id, kind, fields = decode(frame)
                    if kind == K_READY:
                        if not self._ready.done():
                            self._ready.set_result(None)
                        continue
                    future = self._pending.get(request_id)
                    if future is not None and not future.done():
                        future.set_result((kind, fields))
        except (OSError, ConnectionError, asyncio.IncompleteReadError, struct.error) as e:
            reason = f"the agent's stream failed ({type(e).__name__}: {e})"
        except asyncio.CancelledError:
            reason = "the connection was closed"
        self._fail(reason)

    def _fail(self, reason: str) -> None:
        if self._closed is None:
            self._closed = reason
        for future in self._pending.values():
            if not future.done():
                future.set_exception(AgentGone(reason))
        if not self._ready.done():
            self._ready.set_exception(AgentGone(reason))
            self._ready.exception()  # retrieved: nobody may be waiting
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close()

    def close(self) -> None:
        self._reader.cancel()
        self._fail("the connection was closed")

    @property
    def alive(self) -> bool:
        return self._closed is None
