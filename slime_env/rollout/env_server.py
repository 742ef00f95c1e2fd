"""`slime-env serve-env ID`: any registered env over HTTP, and `RemoteEnv`, the `Env` that talks to it.

Protocol (JSON):
- `POST /sessions {"env_kwargs": {...}}` -> `{"session_id", "parser", "tools"}`; 503 "at capacity" when full
- `POST /sessions/{id}/reset {"seed", "task"}` -> `{"observation": [messages], "info"}`
- `POST /sessions/{id}/step {"action": {...}}` -> `{"observation", "reward", "terminated", "truncated", "info"}`
- `DELETE /sessions/{id}` closes the env; `GET /health` -> `{"sessions", "capacity"}`; `GET /info`.
Errors answer `{"error": message}`: 400 malformed request, 404 unknown session, 500 the env raised,
503 at capacity, 504 the env took longer than `request_timeout_s`. Sessions idle for longer than
`idle_timeout_s` are closed by a reaper (on by default).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from slime_env.env import Env
from slime_env.errors import InvalidInput
from slime_env.http import HttpClient, RemoteError
from slime_env.registry import make, spec
from slime_env.rollout.wire import (
    action_to_dict,
    env_created,
    reset_answer,
    run_reset,
    run_step,
    step_answer,
    task_payload,
)
from slime_env.types import Action


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


class _Session:
    def __init__(self, env: Env):
        self.env = env
        self.lock = asyncio.Lock()
        self.last_used = time.monotonic()


class EnvServer:
    """Serves env `env_id`; see the module docstring for the protocol."""

    def __init__(self, env_id: str, *, env_kwargs: Mapping[str, Any] | None = None, max_sessions: int = 1024,
                 idle_timeout_s: float | None = 600.0, request_timeout_s: float = 300.0):
        spec(env_id)  # fail now, with the registry's message, if the id is unknown
        self.env_id, self.env_kwargs = env_id, dict(env_kwargs or {})
        self.max_sessions, self.idle_timeout_s, self.request_timeout_s = max_sessions, idle_timeout_s, request_timeout_s
        self.sessions: dict[str, _Session] = {}
        self._reaper: asyncio.Task | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes([web.post("/sessions", self.create), web.post("/sessions/{sid}/reset", self.reset),
                        web.post("/sessions/{sid}/step", self.step), web.delete("/sessions/{sid}", self.close),
                        web.get("/health", self.health), web.get("/info", self.info)])
        app.on_startup.append(self._start_reaper)
        app.on_cleanup.append(self._shutdown)
        return app

    async def _start_reaper(self, app: web.Application) -> None:
        if self.idle_timeout_s:
            self._reaper = asyncio.create_task(self._reap())

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(max(0.05, self.idle_timeout_s / 4))
            now = time.monotonic()
            for sid, s in list(self.sessions.items()):
                if now - s.last_used > self.idle_timeout_s and not s.lock.locked():
                    await self._drop(sid)

    async def _shutdown(self, app: web.Application) -> None:
        if self._reaper:
            self._reaper.cancel()
        for sid in list(self.sessions):
            await self._drop(sid)

    async def _drop(self, sid: str) -> None:
        s = self.sessions.pop(sid, None)
        if s is not None:
            try:
                await s.env.close()
            except Exception:  # noqa: BLE001 - closing is best effort
                pass

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json() if request.can_read_body else {}
        except json.JSONDecodeError:
            raise web.HTTPBadRequest(text=json.dumps({"error": "body is not valid JSON"}),
                                     content_type="application/json") from None
        if not isinstance(body, dict):
            raise web.HTTPBadRequest(text=json.dumps({"error": "body must be a JSON object"}),
                                     content_type="application/json")
        return body

    async def create(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if len(self.sessions) >= self.max_sessions:
            return _error(503, f"at capacity: {len(self.sessions)} of {self.max_sessions} sessions in use")
        kwargs = body.get("env_kwargs") or {}
        if not isinstance(kwargs, dict):
            return _error(400, "env_kwargs must be an object")
        try:
            env = make(self.env_id, **{**self.env_kwargs, **kwargs})
        except Exception as e:  # noqa: BLE001
            return _error(400, f"cannot make {self.env_id}: {e}")
        sid = uuid.uuid4().hex
        self.sessions[sid] = _Session(env)
        return web.json_response(env_created(sid, env))

    async def _call(self, request: web.Request, fn) -> web.Response:
        sid = request.match_info["sid"]
        s = self.sessions.get(sid)
        if s is None:
            return _error(404, f"no session {sid} (closed, reaped after {self.idle_timeout_s}s idle, or never made)")
        body = await self._body(request)
        async with s.lock:
            s.last_used = time.monotonic()
            try:
                result = await asyncio.wait_for(fn(s.env, body), self.request_timeout_s)
            except InvalidInput as e:
                return _error(400, str(e))
            except TimeoutError:
                return _error(504, f"the env took longer than {self.request_timeout_s}s")
            except Exception as e:  # noqa: BLE001 - the env's error goes back to the client, named
                return _error(500, f"{type(e).__name__}: {e}")
            finally:
                s.last_used = time.monotonic()
        return web.json_response(result)

    async def reset(self, request: web.Request) -> web.Response:
        async def do(env: Env, body: dict[str, Any]):
            return _plain_info(await run_reset(env, body.get("seed"), body.get("task")))
        return await self._call(request, do)

    async def step(self, request: web.Request) -> web.Response:
        async def do(env: Env, body: dict[str, Any]):
            return _plain_info(await run_step(env, body.get("action")))
        return await self._call(request, do)

    async def close(self, request: web.Request) -> web.Response:
        await self._drop(request.match_info["sid"])
        return web.json_response({"closed": True})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"sessions": len(self.sessions), "capacity": self.max_sessions})

    async def info(self, request: web.Request) -> web.Response:
        return web.json_response({"env_id": self.env_id, "sessions": len(self.sessions)})


def _plain_info(answer: dict[str, Any]) -> dict[str, Any]:
    """JSON cannot carry arbitrary info objects: keep the info if it is plain, else its repr."""
    try:
        answer["info"] = json.loads(json.dumps(answer["info"]))
    except (TypeError, ValueError):
        answer["info"] = {"repr": repr(answer["info"])}
    return answer


class RemoteEnv(Env):
    """An `Env` served by `slime-env serve-env` at `url`. Its parser and tools come from the server
    when the session is created (at the first reset). Steps are never retried (a step must not run
    twice); session creation and close are. A dead server makes the episode fail with the reason."""

    def __init__(self, url: str, *, env_kwargs: Mapping[str, Any] | None = None, client: HttpClient | None = None):
        self.client = client or shared_client(url)
        self.env_kwargs = dict(env_kwargs or {})
        self.session_id: str | None = None
        self.parser = None  # type: ignore[assignment]
        self.tools = None

    async def reset(self, *, seed=None, options=None):
        if self.session_id is None:
            created = await self.client.request("POST", "/sessions", {"env_kwargs": self.env_kwargs})
            self.session_id, self.parser, self.tools = (created["session_id"], created.get("parser"),
                                                        created.get("tools"))
            self.stop = tuple(created.get("stop") or ())  # the env's stop strings reach the sampling params
            self.describe_tools = bool(created.get("describe_tools", True))
        out = await self.client.request("POST", f"/sessions/{self.session_id}/reset",
                                        {"seed": seed, "task": task_payload(options)}, max_retries=0)
        self.tools = out.get("tools", self.tools)
        return reset_answer(out, "remote")

    async def step(self, action: Action):
        if self.session_id is None:
            raise RemoteError("RemoteEnv.step before reset")
        out = await self.client.request("POST", f"/sessions/{self.session_id}/step",
                                        {"action": action_to_dict(action)}, max_retries=0)
        return step_answer(out, "remote")

    async def close(self) -> None:
        if self.session_id is not None:
            sid, self.session_id = self.session_id, None
            try:
                await self.client.request("DELETE", f"/sessions/{sid}", max_retries=1)
            except RemoteError:
                pass  # the server's reaper closes it


_CLIENTS: dict[str, HttpClient] = {}


def shared_client(url: str, *, max_connections: int = 512, timeout_s: float = 330.0) -> HttpClient:
    """One pooled client per server URL, shared by all `RemoteEnv`s of this process (a client per env
    would open a connection pool per episode)."""
    if url not in _CLIENTS:
        _CLIENTS[url] = HttpClient(url, max_connections=max_connections, timeout_s=timeout_s)
    return _CLIENTS[url]


async def close_shared_clients() -> None:
    """Close the pooled connections of `shared_client` (call before the event loop ends)."""
    for client in _CLIENTS.values():
        await client.close()


def serve(env_id: str, host: str = "127.0.0.1", port: int = 8100, **kwargs: Any) -> None:
    """Serve `env_id` until interrupted; prints `listening on http://HOST:PORT` when ready."""
    from slime_env.http import serve_forever

    server = EnvServer(env_id, **kwargs)
    serve_forever(server.app, host=host, port=port, backlog=4096)  # thousands of episodes connect at once
