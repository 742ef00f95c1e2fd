"""`Gateway`: OpenAI- and Anthropic-compatible endpoints per agent session in front of any policy, recording exact
token ledgers.

Each session is reached at `{base_url}/sessions/{session_id}/v1` with its own unguessable key (the `api_key` the
agent is given); a wrong or missing key, an unknown or expired session get the same 401, so one agent cannot learn
of, read or write another's session. The server binds to 127.0.0.1 unless told otherwise and refuses bodies over
`max_body_bytes` (413). Requests are rendered with the model's chat template, the token ids go to the policy (SGLang
`/generate`, an OpenAI-compatible server, the embedded engine, a scripted policy), tool calls are parsed with the
family's parser, and the reply is an ordinary chat completion, OpenAI response or Anthropic message (or their
streams) — see `conversation` for how calls map to branches, `openai_api`, `responses_api` and `anthropic_api` for the
wire formats.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from slime_env.errors import InvalidInput, RenderError, RenderMismatch
from slime_env.gateway import anthropic_api, responses_api
from slime_env.gateway.conversation import Conversation, GatewayError
from slime_env.gateway.openai_api import Completion, error_body, parse_chat_request, sse
from slime_env.gateway.validation import check_json, finite
from slime_env.http import RemoteError
from slime_env.trajectory import Trajectory
from slime_env.types import Task

log = logging.getLogger("slime_env.gateway")


@dataclass
class AgentSession:
    """One agent's session: its key, its conversation branches and its expiry."""

    id: str
    key: str
    conversation: Conversation
    task: Any = None
    expires_at: float = 0.0
    created: float = field(default_factory=time.time)
    calls: int = 0
    errors: list[str] = field(default_factory=list)
    in_flight: int = 0  # calls being answered (a session is never expired under them)
    abandoned: int = 0  # calls whose client left before the reply: not recorded
    expired: bool = False  # past its TTL: its key no longer works; its recorded calls wait for close / collection
    responses: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # Responses API: id -> its conversation
    # (time.time(), what): failures on the host's side while the session was open — the engine failing a call (502),
    # the gateway stopping. `AgentEnv` makes an episode whose agent saw one last `infra_error`, never a 0.
    host_faults: list[tuple[float, str]] = field(default_factory=list)

    def recorded(self) -> int:
        return sum(len(b.calls) for b in self.conversation.branches)


class Gateway:
    """OpenAI-compatible chat completions per agent session (module docstring), recording each session's calls as
    token-exact branches.

    `Gateway(policy, renderer, parser=None, *, model="slime-env", strict=False, max_new_tokens=1024,
    max_context_tokens=None, overrides=None, session_ttl_s=3600, max_body_bytes=4 MiB)`; `max_context_tokens`
    (default: the policy's `context_length`, where it has one): a request whose prompt leaves no room in it is a 400
    that names the limit; `overrides`: sampling
    parameters that replace the agent's (an RL run samples at its own temperature, whatever the agent asks);
    `await start(host, port)` -> base URL;
    `open_session(task)` -> the session (its `id`, `key`) and `session_url(session)`; `close_session(id)` -> one
    `Trajectory` per branch; `collect_expired()` -> the trajectories of sessions that expired unclosed; `await stop()`.

    A session expires `session_ttl_s` after its last call ended (never while a call runs): its key stops working,
    but what it recorded is kept until `close_session` or `collect_expired` (logged, never dropped). A call whose
    client disconnected before the reply (a client timeout, then a retry) is not recorded.
    """

    def __init__(self, policy: Any, renderer: Any, parser: Any = None, *, model: str = "slime-env",
                 strict: bool = False, max_new_tokens: int = 1024, max_context_tokens: int | None = None,
                 overrides: dict[str, Any] | None = None, session_ttl_s: float = 3600.0,
                 max_body_bytes: int = 4 << 20):
        from slime_env.parsers import get_parser

        self.policy, self.renderer, self.parser = policy, renderer, get_parser(parser)
        self.parser_name = parser if isinstance(parser, str) else None
        self.model, self.strict = model, strict
        self.max_new_tokens = max_new_tokens
        # None: the policy's own context (an engine that knows its model's, e.g. the embedded one), else unbounded
        known = getattr(policy, "context_length", None)
        self.max_context_tokens = max_context_tokens if max_context_tokens is not None else \
            (known if isinstance(known, int) else None)  # an engine server's is asked at start()
        # "episode" seeds are the step runner's (one per episode and turn); here each call samples freshly
        self.overrides = {k: v for k, v in (overrides or {}).items() if not (k == "sampling_seed" and v == "episode")}
        self.session_ttl_s, self.max_body_bytes = session_ttl_s, max_body_bytes
        self.sessions: dict[str, AgentSession] = {}
        self.base_url: str | None = None
        self._runner: web.AppRunner | None = None
        self.app = web.Application(client_max_size=max_body_bytes)
        self.app.router.add_post("/sessions/{sid}/v1/chat/completions", self._chat)
        self.app.router.add_get("/sessions/{sid}/v1/models", self._models)
        self.app.router.add_post("/sessions/{sid}/v1/messages", self._messages)
        self.app.router.add_post("/sessions/{sid}/v1/responses", self._responses)
        # A standalone gateway (`slime-env serve-gateway`) is driven over HTTP with an admin key; in-process users
        # call open_session / close_session and leave it None (the routes then answer 404).
        self.admin_key: str | None = None
        self.app.router.add_post("/admin/sessions", self._admin_open)
        self.app.router.add_post("/admin/sessions/{sid}/close", self._admin_close)
        self.app.router.add_post("/admin/expired/collect", self._admin_collect)

    # --- lifecycle --------------------------------------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on `host:port` (0: a free port); returns the base URL."""
        if self.max_context_tokens is None and hasattr(self.policy, "fetch_context_length"):
            # an engine server (SGLang, vLLM, serve-engine) says its model's context length itself
            self.max_context_tokens = await self.policy.fetch_context_length()
        # handler_cancellation: a client that disconnects (its timeout) cancels its call, which records nothing
        self._runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.base_url = f"http://{host}:{port}"
        return self.base_url

    async def stop(self) -> None:
        """Stop serving (the sessions and what they recorded stay: `start` again serves them). Every open session
        records the outage as a host fault: an agent whose calls it broke ends `infra_error`, not with a 0."""
        now = time.time()
        for s in self.sessions.values():
            s.host_faults.append((now, "the gateway stopped"))
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open_session(self, task: Any = None) -> AgentSession:
        """A new session with an unguessable id and key (expired sessions that recorded nothing are dropped here)."""
        self._expire()
        now = time.monotonic()
        s = AgentSession(secrets.token_urlsafe(16), "sk-" + secrets.token_urlsafe(32),
                         Conversation(self.renderer, self.parser, strict=self.strict, parser_name=self.parser_name),
                         Task.coerce(task if task is not None else ""),
                         expires_at=now + self.session_ttl_s)
        self.sessions[s.id] = s
        return s

    def session_url(self, session: AgentSession, api: str = "openai") -> str:
        """The `base_url` an agent is given for `session`: OpenAI clients' (ending in /v1) or, with
        `api="anthropic"`, Anthropic clients' (they add /v1/messages themselves)."""
        if self.base_url is None:
            raise RuntimeError("Gateway.start() has not run")
        return f"{self.base_url}/sessions/{session.id}" + ("/v1" if api == "openai" else "")

    def close_session(self, session_id: str, *, reward: float = 0.0, status: str = "completed",
                      reason: str = "") -> list[Trajectory]:
        """End the session (its key stops working) and return one trajectory per branch, in creation order. An
        expired session closes like any other (what it recorded was kept)."""
        s = self.sessions.pop(session_id)
        return [self._trajectory(s, b, reward, status, reason) for b in s.conversation.branches]

    def collect_expired(self, *, reward: float = 0.0) -> dict[str, list[Trajectory]]:
        """The sessions that expired without being closed, closed now: {session id: its trajectories}, `truncated`
        with the reason (a run collects them at the end of a step, so no recorded call is lost)."""
        self._expire()
        out = {}
        for sid in [s.id for s in self.sessions.values() if s.expired]:
            out[sid] = self.close_session(sid, reward=reward, status="truncated",
                                          reason=f"the session expired ({self.session_ttl_s:g}s without a call) and "
                                                 "was never closed")
        return out

    def _expire(self) -> None:
        """Mark sessions past their TTL (no call running) expired: one that recorded nothing is dropped, one that
        recorded calls is kept for `close_session` / `collect_expired`, and logged."""
        now = time.monotonic()
        for s in list(self.sessions.values()):
            if s.expired or s.in_flight or s.expires_at >= now:
                continue
            s.expired = True
            if not s.conversation.branches:
                del self.sessions[s.id]
            else:
                log.warning("gateway session %s expired (%gs without a call) with %d recorded calls: kept until "
                            "close_session or collect_expired", s.id, self.session_ttl_s, s.recorded())

    # --- routes -----------------------------------------------------------------------------------------------
    def _session(self, request: web.Request) -> AgentSession:
        s = self.sessions.get(request.match_info["sid"])
        auth = request.headers.get("Authorization", "")
        key = auth[7:] if auth.startswith("Bearer ") else request.headers.get("x-api-key", "")
        # One answer for an unknown session, an expired one and a wrong key: nothing is learnt by guessing.
        if s is None or s.expired or (s.expires_at < time.monotonic() and not s.in_flight) \
                or not hmac.compare_digest(key.encode(), s.key.encode()):
            raise GatewayError(401, "invalid API key for this session (or the session ended)",
                               kind="authentication_error")
        s.expires_at = time.monotonic() + self.session_ttl_s
        return s

    async def _body(self, request: web.Request) -> Any:
        """The request's JSON, checked (`validation.check_json`); a `GatewayError` for any body that is not."""
        try:
            body = await request.json()
        except web.HTTPRequestEntityTooLarge:
            raise GatewayError(413, f"the request body is larger than this gateway's limit of {self.max_body_bytes} "
                                    "bytes", code="request_too_large") from None
        except RecursionError:
            raise GatewayError(400, "the request body is JSON nested too deeply") from None
        except ValueError:
            raise GatewayError(400, "the request body is not valid JSON") from None
        check_json(body)
        return body

    def _admin(self, request: web.Request) -> None:
        auth = request.headers.get("Authorization", "")
        if self.admin_key is None:
            raise web.HTTPNotFound()
        if not hmac.compare_digest(auth.encode(), f"Bearer {self.admin_key}".encode()):
            raise GatewayError(401, "invalid admin key", kind="authentication_error")

    async def _admin_body(self, request: web.Request) -> dict[str, Any]:
        body = await self._body(request) if request.can_read_body else {}
        if body is None:
            return {}
        if not isinstance(body, dict):
            raise GatewayError(400, "the request body must be a JSON object")
        return body

    async def _admin_open(self, request: web.Request) -> web.Response:
        """`POST /admin/sessions` {"task": ...} -> {"session_id", "api_key", "openai_base_url",
        "anthropic_base_url"}."""
        try:
            self._admin(request)
            body = await self._admin_body(request)
            try:
                s = self.open_session(body.get("task"))
            except (InvalidInput, TypeError, ValueError) as e:
                raise GatewayError(400, f"task: {e}", param="task") from None
        except GatewayError as e:
            return web.json_response(error_body(e), status=e.status)
        return web.json_response({"session_id": s.id, "api_key": s.key, "openai_base_url": self.session_url(s),
                                  "anthropic_base_url": self.session_url(s, api="anthropic")})

    async def _admin_close(self, request: web.Request) -> web.Response:
        """`POST /admin/sessions/{id}/close` {"reward": r} -> {"trajectories": [...]} (one per branch)."""
        try:
            self._admin(request)
            body = await self._admin_body(request)
            reward = finite(body.get("reward", 0.0), "reward")
            sid = request.match_info["sid"]
            if sid not in self.sessions:
                raise GatewayError(404, f"no session {sid!r} (closed or collected already)", kind="not_found_error",
                                   param="session_id")
        except GatewayError as e:
            return web.json_response(error_body(e), status=e.status)
        trajs = self.close_session(sid, reward=reward)
        return web.json_response({"trajectories": [t.to_dict() for t in trajs]})

    async def _admin_collect(self, request: web.Request) -> web.Response:
        """`POST /admin/expired/collect` {"reward": r} -> {"sessions": {id: [trajectory, ...]}}: `collect_expired`."""
        try:
            self._admin(request)
            body = await self._admin_body(request)
            reward = finite(body.get("reward", 0.0), "reward")
        except GatewayError as e:
            return web.json_response(error_body(e), status=e.status)
        done = self.collect_expired(reward=reward)
        return web.json_response({"sessions": {sid: [t.to_dict() for t in ts] for sid, ts in done.items()}})

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._session(request)
        except GatewayError as e:
            return web.json_response(error_body(e), status=e.status)
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model", "created": 0,
                                                              "owned_by": "slime_env"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        """OpenAI chat completions."""
        answered = await self._answer(request, parse_chat_request, error_body)
        if isinstance(answered, web.Response):
            return answered
        _, req, done = answered
        if not req.stream:
            return web.json_response(done.body(req.logprobs))
        events = [sse(event) for event in done.chunks(req.logprobs, req.include_usage)] + [b"data: [DONE]\n\n"]
        return await self._stream(request, events)

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        """Anthropic Messages: the same conversation and ledger as chat completions, another wire format."""
        answered = await self._answer(request, anthropic_api.parse_messages_request, anthropic_api.error_body)
        if isinstance(answered, web.Response):
            return answered
        _, req, done = answered
        if not req.stream:
            return web.json_response(anthropic_api.message_body(done))
        return await self._stream(request, [f"event: {name}\n".encode() + sse(data)
                                            for name, data in anthropic_api.events(done)])

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        """OpenAI Responses: the same conversation and ledger as chat completions, another wire format;
        `previous_response_id` continues from the session's own record of its responses."""
        answered = await self._answer(request, responses_api.parse_request, error_body,
                                      resolve=lambda s, req: req.resolve(s.responses))
        if isinstance(answered, web.Response):
            return answered
        s, req, done = answered
        body = responses_api.response_body(done, req, done.id.replace("chatcmpl-", "resp_"))
        if req.store:
            s.responses[body["id"]] = responses_api.record(req, done)
        if not req.stream:
            return web.json_response(body)
        return await self._stream(request, [f"event: {e['type']}\n".encode() + sse(e)
                                            for e in responses_api.events(body, done)])

    async def _answer(self, request: web.Request, parse: Any, error: Any,
                      resolve: Any = None) -> tuple[AgentSession, Any, Completion] | web.Response:
        """(the session, the parsed request, its completion), or the error response in the route's format.
        `resolve(session, request)` completes a request from the session's record (`previous_response_id`)."""
        try:
            s = self._session(request)
            s.in_flight += 1
            try:
                req = parse(await self._body(request))
                if resolve is not None:
                    resolve(s, req)
                return s, req, await self._complete(s, req, request)
            finally:
                s.in_flight -= 1
                s.expires_at = time.monotonic() + self.session_ttl_s  # the TTL counts from the end of a call too
        except GatewayError as e:
            return web.json_response(error(e), status=e.status)

    @staticmethod
    async def _stream(request: web.Request, events: list[bytes]) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await out.prepare(request)
        for event in events:
            await out.write(event)
        await out.write_eof()
        return out

    async def _complete(self, s: AgentSession, req: Any, request: web.Request | None = None) -> Completion:
        conv = s.conversation
        try:
            call = conv.begin(req.messages, req.tools)
        except RenderMismatch as e:
            raise GatewayError(500, f"strict mode: {e}", kind="server_error") from None
        except (RenderError, ValueError) as e:
            raise GatewayError(400, f"the model's chat template cannot render this request: {e}") from None
        ids = call.ids
        room = req.max_tokens or self.max_new_tokens
        if self.max_context_tokens is not None:
            room = min(room, self.max_context_tokens - len(ids))
            if room < 1:
                conv.abandon(call)
                raise GatewayError(400, f"this request's {len(ids)} prompt tokens leave no room in the model's "
                                        f"context of {self.max_context_tokens} tokens", param="messages",
                                   code="context_length_exceeded")
        stops = sorted({*self.renderer.stop_token_ids, *(self.overrides.get("stop_token_ids") or ())})
        params = {**req.sampling, **self.overrides, "max_new_tokens": room, "stop_token_ids": stops}
        if "stop" in req.sampling and "stop" in self.overrides:  # both the agent's stop strings and the run's
            params["stop"] = list(dict.fromkeys([*req.sampling["stop"], *self.overrides["stop"]]))
        t0 = time.perf_counter()
        try:
            gen = await self.policy.generate(ids, params)
        except asyncio.CancelledError:  # the client disconnected (handler cancellation) or the server stops
            conv.abandon(call)
            s.abandoned += 1
            raise
        except Exception as e:  # noqa: BLE001 - the engine's failure is the agent's 502, the session stays usable
            conv.abandon(call)
            s.errors.append(f"{type(e).__name__}: {e}")
            if isinstance(e, InvalidInput) or (isinstance(e, RemoteError) and e.status is not None
                                               and 400 <= e.status < 500):
                # the engine refused the request's own parameters: the client's 400, not an engine failure
                raise GatewayError(400, f"the engine refused this request: {e}") from None
            s.host_faults.append((time.time(), f"the engine failed: {type(e).__name__}: {e}"))
            raise GatewayError(502, f"the engine failed: {type(e).__name__}: {e}", kind="server_error") from None
        latency = time.perf_counter() - t0
        if request is not None and (request.transport is None or request.transport.is_closing()):
            conv.abandon(call)  # the client left while the engine worked: a reply nobody receives is not recorded
            s.abandoned += 1
            raise GatewayError(499, "the client disconnected before the reply")
        reply = conv.finish(call, gen, latency, stop=req.sampling.get("stop") or ())
        s.calls += 1
        return Completion(reply, gen.finish_reason, len(ids), len(gen.token_ids),
                          [self.renderer.decode([t]) for t in gen.token_ids] if req.logprobs else (),
                          gen.logprobs, req.model or self.model, stop_sequence=call.stop_sequence)

    # --- results ----------------------------------------------------------------------------------------------
    def _trajectory(self, s: AgentSession, b: Any, reward: float, status: str, reason: str) -> Trajectory:
        led = b.ledger
        if not b.calls:
            status, reason = "failed", reason or "no generation on this branch (the call failed)"
        gen_s = sum(c["latency_s"] for c in b.calls)
        return Trajectory(
            task=s.task,
            prompt_ids=led.prompt_ids, response_ids=led.response_ids, loss_mask=led.loss_mask,
            rollout_logprobs=led.rollout_logprobs, spans=led.spans, turn_rewards=[0.0] * max(len(b.calls) - 1, 0)
            + [reward], reward=reward, status=status, reason=reason, agent_id="agent", num_turns=len(b.calls),
            messages=list(b.history), response_text=self.renderer.decode(led.response_ids) if led.response_ids else "",
            timings={"total_s": time.time() - s.created, "generate_s": gen_s, "env_s": 0.0,
                     "framework_s": 0.0},
            metadata={"session": s.id, "branch": b.index, "parent_branch": b.parent, "fork_at": b.fork_at,
                      "branch_reason": b.reason, "calls": b.calls, "history_rewrites": b.history_rewrites,
                      "abandoned_calls": s.abandoned, "weight_versions": [c["weight_version"] for c in b.calls],
                      "weight_version_tokens": [c["completion_tokens"] for c in b.calls]})
