"""`slime-env serve-sandbox`: a sandbox over HTTP with SandboxFusion's `POST /run_code` API.

Routes: `POST /run_code` (SandboxFusion request and response shapes, see `slime_env.tools_sandbox.fusion`),
`GET /health` (backend, runs executing, runs queued), `GET /v1/ping` ("pong", as SandboxFusion).
At most `max_concurrency` runs execute at once; a request that waits longer than `queue_timeout_s`
for a slot gets 503 (retry-safe: its code never ran). Malformed requests get 400 naming the field.
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web
from slime_env.tools_sandbox.base import Sandbox
from slime_env.tools_sandbox.fusion import parse_request, to_response

from slime_env.errors import InvalidInput

SANDBOX_KEY = web.AppKey("sandbox", Sandbox)


def make_app(sandbox: Sandbox, *, max_concurrency: int | None = None, queue_timeout_s: float = 30.0,
             max_body_mb: int = 64) -> web.Application:
    """The aiohttp app serving `sandbox` (which the caller owns and closes)."""
    slots = asyncio.Semaphore(max_concurrency or sandbox.max_concurrency)
    state = {"queued": 0, "served": 0, "rejected": 0}

    async def run_code(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return _error(400, "request body is not valid JSON")
        try:
            kwargs = parse_request(body)
        except InvalidInput as e:
            return _error(400, str(e))
        state["queued"] += 1
        try:
            async with asyncio.timeout(queue_timeout_s):
                await slots.acquire()
        except TimeoutError:
            state["rejected"] += 1
            return _error(503, f"queue timeout: no free slot within {queue_timeout_s:g}s", status_field="SandboxError")
        finally:
            state["queued"] -= 1
        try:
            result = await sandbox.run(**kwargs)
        except InvalidInput as e:
            return _error(400, str(e))
        finally:
            slots.release()
        state["served"] += 1
        return web.json_response(to_response(result))

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "backend": sandbox.backend, "describe": sandbox.describe(),
                                  "running": sandbox.live, **state})

    async def ping(request: web.Request) -> web.Response:
        return web.Response(text="pong")

    app = web.Application(client_max_size=max_body_mb << 20)
    app[SANDBOX_KEY] = sandbox
    app.add_routes([web.post("/run_code", run_code), web.get("/health", health), web.get("/v1/ping", ping)])
    return app


def _error(status: int, message: str, status_field: str = "SandboxError") -> web.Response:
    return web.Response(status=status, content_type="application/json",
                        text=json.dumps({"status": status_field, "message": message}))


def serve(sandbox: Sandbox, *, host: str = "127.0.0.1", port: int = 8080, max_concurrency: int | None = None,
          queue_timeout_s: float = 30.0) -> None:
    """Serve until interrupted; prints `listening on http://HOST:PORT` once bound (port 0 picks one)."""
    from slime_env.http import serve_forever

    print(f"sandbox: {sandbox.describe()}", flush=True)
    serve_forever(lambda: make_app(sandbox, max_concurrency=max_concurrency, queue_timeout_s=queue_timeout_s),
                  host=host, port=port, on_exit=sandbox.close)
