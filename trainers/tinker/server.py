"""`slime-env serve-tinker`: an HTTP server that the `tinker` SDK (and so `tinker-cookbook`) talks to unchanged.

Routes, bodies and the futures protocol follow the SDK's client (tinker 0.38): every training or sampling call
answers at once with `{"request_id": ...}`; the SDK then long-polls `POST /api/v1/retrieve_future` and gets
`{"type": "try_again", ...}` while the work runs, the result (JSON, or protobuf for `ForwardBackwardOutput` and
`SampleResponse`), or `{"error": ..., "category": "user" | "server"}`, which the SDK raises as `RequestFailedError`.
Work runs in arrival order on one worker thread, so the SDK's ordering of forward_backward / optim_step holds.
Routes the SDK has that are not built here answer 404 with a JSON body naming what is refused. A body that is not
JSON, not an object, or has a field of the wrong type is a 400 in the SDK's error shape (`{"error", "category":
"user", "detail"}`, raised as `BadRequestError`) naming the field; the work itself never sees it.

Sessions: a model belongs to the session it was created in (`<session_id>:train:<n>`); `create_model` and
`load_weights` need a session this server created and has not finished. `POST /sessions/{id}/finish` refuses that
session's later training calls and frees its training clients (their adapters and optimizer states), after the
calls already queued.

Checkpoints: `ttl_seconds` (`save_state`, `save_weights_for_sampler`) is honoured: past it the checkpoint's folder is
removed and loading or sampling it is a 404 naming the expiry (the SDK's `NotFoundError`). `compute_logprobs` / `sample`
with `prompt_logprobs_last_n` return log-probs for the last n prompt tokens only (the rest `None`).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from slime_env.errors import InvalidInput
from slime_env.trainers.tinker.backend import CheckpointGone, TinkerBackend
from slime_env.trainers.tinker.wire import decode_forward_backward, encode_forward_backward_output, \
    encode_sample_response

log = logging.getLogger(__name__)
PROTO = "application/x-protobuf"
POLL_S = 20.0  # how long one retrieve_future waits before answering try_again (the SDK waits 45 s)

REFUSED = {
    "/api/v1/save_weights_external": "exporting weights to external storage",
    "/api/v1/copy_weights": "copying checkpoints between runs",
    "/api/v1/create_custom_loss": "server-side custom losses (the SDK runs them client-side: forward_backward_custom)",
    "/api/v1/retrieve_futures": "the sampling completion queue (sample_use_retrieve_futures is off)",
    "/api/v1/join_sampling_session": "joining sampling sessions from unpickled clients",
    "/api/v1/unload_model": "unloading models",
}


def user_error(message: str, status: int = 400) -> web.Response:
    """The SDK's error body: it raises `BadRequestError` (400), `NotFoundError` (404), ... with `message`."""
    return web.json_response({"error": message, "category": "user", "detail": message}, status=status)


def refusing_bad_input(handler: Any) -> Any:
    """`handler` with bad input found while reading a request answered as the client's 400, not aiohttp's 500
    "Server got itself in trouble"; anything else that escapes it is a server error, still in the SDK's shape. A
    wrapper, not an aiohttp middleware: aiohttp caches each handler's middleware chain in a module-level cache of
    1,024 entries, which kept a closed server alive, its model among it, for the rest of the process."""

    @functools.wraps(handler)
    async def refusing(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except InvalidInput as e:
            return user_error(str(e), 404 if isinstance(e, CheckpointGone) else 400)
        except web.HTTPException:
            raise
        except Exception as e:  # noqa: BLE001 - logged here, answered in the SDK's shape
            log.error("%s %s failed", request.method, request.path, exc_info=e)
            message = f"{request.path}: {type(e).__name__}: {e}"
            return web.json_response({"error": message, "category": "server", "detail": message}, status=500)

    return refusing


async def json_body(request: web.Request) -> dict[str, Any]:
    """The request's JSON object; InvalidInput naming the route when it is not JSON or not an object."""
    try:
        body = await request.json()
    except ValueError as e:
        raise InvalidInput(f"{request.path}: the body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise InvalidInput(f"{request.path}: the body must be a JSON object, got {type(body).__name__}")
    return body


KIND_NAMES = {int: "an integer", float: "a number", str: "a string", dict: "an object", list: "a list",
              bool: "a boolean"}


def field(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = None, *,
          where: str = "") -> Any:
    """`body[name]` when it is of `kind` (`default` when absent or null); InvalidInput naming the field (`where` its
    parent: "sampling_params.") otherwise."""
    value = body.get(name)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = "a number" if float in kinds else " or ".join(KIND_NAMES[k] for k in kinds)
        raise InvalidInput(f"{where}{name} must be {names}, got {value!r}")
    return value


def ttl_seconds(body: dict[str, Any]) -> int | None:
    """The request's `ttl_seconds` (None: the checkpoint never expires); InvalidInput unless a positive integer. The
    hosted service takes 3600 s to 10 years; any positive number of seconds is taken here."""
    ttl = field(body, "ttl_seconds", int)
    if ttl is not None and ttl < 1:
        raise InvalidInput(f"ttl_seconds must be >= 1, got {ttl} (seconds until the checkpoint is removed; "
                           "leave it out to keep the checkpoint)")
    return ttl


class TinkerServer:
    """The routes over one `TinkerBackend`."""

    def __init__(self, backend: TinkerBackend):
        self.backend = backend
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slime_env-tinker")
        self.futures: dict[str, asyncio.Task] = {}
        self.sessions: dict[str, float] = {}  # live sessions -> last heartbeat
        self.finished: set[str] = set()  # sessions finished: their training calls are refused
        self.sampling_sessions: dict[str, str] = {}  # sampling_session_id -> sampler key
        self._ids = itertools.count()
        self.calls: dict[str, int] = {}

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        get = {"/api/v1/healthz": self.healthz, "/api/v1/get_server_capabilities": self.capabilities,
               "/api/v1/samplers/{sampler_id}": self.get_sampler}
        post = {
            "/api/v1/client/config": self.client_config, "/api/v1/client/dynamic_config": self.dynamic_config,
            "/api/v1/create_session": self.create_session, "/api/v1/session_heartbeat": self.heartbeat,
            "/api/v1/telemetry": self.telemetry, "/api/v1/create_model": self.create_model,
            "/api/v1/get_info": self.get_info, "/api/v1/forward_backward": self.forward_backward,
            "/api/v1/optim_step": self.optim_step, "/api/v1/save_weights": self.save_weights,
            "/api/v1/load_weights": self.load_weights, "/api/v1/save_weights_for_sampler": self.save_for_sampler,
            "/api/v1/create_sampling_session": self.create_sampling_session, "/api/v1/asample": self.sample,
            "/api/v1/retrieve_future": self.retrieve_future, "/api/v1/cancel_future": self.cancel_future,
            "/api/v1/sessions/{session_id}/finish": self.finish_session,
        }
        for path, handler in get.items():
            app.router.add_get(path, refusing_bad_input(handler))
        for path, handler in post.items():
            app.router.add_post(path, refusing_bad_input(handler))
        app.router.add_route("*", "/{tail:.*}", refusing_bad_input(self.refused))
        app.on_cleanup.append(self._cleanup)
        return app

    async def _cleanup(self, _app: web.Application) -> None:
        for task in self.futures.values():
            task.cancel()
        self.worker.shutdown(wait=False, cancel_futures=True)
        self.backend.close()

    # --- futures -------------------------------------------------------------------------------------------------
    def _submit(self, kind: str, work, *args, model_id: str | None = None, samples: int = 0) -> web.Response:
        """Run `work(*args)` on the worker thread (a coroutine function runs on the loop); answer its future."""
        self.calls[kind] = self.calls.get(kind, 0) + 1
        request_id = f"{kind}-{next(self._ids)}-{uuid.uuid4().hex[:6]}"
        loop = asyncio.get_running_loop()
        fut = work(*args) if asyncio.iscoroutinefunction(work) else loop.run_in_executor(self.worker, work, *args)
        self.futures[request_id] = asyncio.ensure_future(fut)
        body = {"request_id": request_id}
        if model_id is not None:
            body["model_id"] = model_id
        if samples:  # one id per requested sample; the SDK stamps them onto the returned sequences
            body["sample_sequence_ids"] = [f"{request_id}/{i}" for i in range(samples)]
        return web.json_response(body)

    async def retrieve_future(self, request: web.Request) -> web.Response:
        request_id = field(await json_body(request), "request_id", str)
        task = self.futures.get(request_id)
        if task is None:
            return web.json_response({"error": f"no request {request_id!r} on this server", "category": "user"})
        if not task.done():
            await asyncio.wait([task], timeout=POLL_S)
        if not task.done():
            return web.json_response({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        self.futures.pop(request_id, None)
        error = task.exception()
        if error is not None:
            user = isinstance(error, (InvalidInput, ValueError, KeyError))
            if not user:
                log.error("request %s failed", request_id, exc_info=error)
            return web.json_response({"error": f"{type(error).__name__}: {error}",
                                      "category": "user" if user else "server"})
        result = task.result()
        if isinstance(result, bytes):
            return web.Response(body=result, content_type=PROTO)
        return web.json_response(result)

    # --- service -------------------------------------------------------------------------------------------------
    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def capabilities(self, request: web.Request) -> web.Response:
        b = self.backend
        return web.json_response({"supported_models": [{"model_name": b.base_model, "trainable": True,
                                                        "sampleable": True,
                                                        "max_context_length": b.max_context_length}]})

    async def client_config(self, request: web.Request) -> web.Response:
        # Plain httpx transport, no zstd, custom losses client-side, per-request sample polling.
        return web.json_response({"pjwt_auth_enabled": False, "proto_compress_fwdbwd": False,
                                  "use_pyqwest_transport": False, "custom_loss_server_side": False,
                                  "sample_use_retrieve_futures": False, "sample_join_sampling_session": False})

    async def dynamic_config(self, request: web.Request) -> web.Response:
        return web.json_response({"refresh_interval_sec": 3600, "sample_cancel_enabled": False})

    async def create_session(self, request: web.Request) -> web.Response:
        session_id = f"session-{uuid.uuid4().hex[:12]}"
        self.sessions[session_id] = time.time()
        return web.json_response({"type": "create_session", "session_id": session_id})

    async def heartbeat(self, request: web.Request) -> web.Response:
        session_id = field(await json_body(request), "session_id", str)
        if session_id in self.sessions:  # a heartbeat never revives a finished session
            self.sessions[session_id] = time.time()
        return web.json_response({"type": "session_heartbeat"})

    async def finish_session(self, request: web.Request) -> web.Response:
        session_id = request.match_info["session_id"]
        if self.sessions.pop(session_id, None) is not None:
            self.finished.add(session_id)
            # on the worker: after the session's calls already queued, before any later one
            asyncio.get_running_loop().run_in_executor(self.worker, self.backend.free_session, session_id)
        return web.json_response({})

    def _session_of(self, model_id: str | None) -> str:
        """The live session a model id belongs to (`<session_id>:train:<n>`); InvalidInput naming it otherwise."""
        session_id = (model_id or "").partition(":train:")[0]
        if session_id in self.finished:
            raise InvalidInput(f"model {model_id!r}: its session {session_id!r} is finished (POST /api/v1/sessions/"
                               f"{session_id}/finish); create a new session for more training")
        if session_id not in self.sessions:
            raise InvalidInput(f"session_id {session_id!r} is not a session of this server (create_session first)")
        return session_id

    async def cancel_future(self, request: web.Request) -> web.Response:
        task = self.futures.pop(field(await json_body(request), "request_id", str, ""), None)
        if task is not None:
            task.cancel()
        return web.json_response({})

    async def telemetry(self, request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"status": "accepted"})

    async def refused(self, request: web.Request) -> web.Response:
        what = REFUSED.get(request.path)
        if what is None and ("/checkpoints" in request.path or "training_runs" in request.path):
            what = "the checkpoint and training-run REST listing"
        message = (f"{request.method} {request.path}: {what or 'this route'} is not served by slime-env "
                   "serve-tinker (docs/tinker.md lists what is)")
        return web.json_response({"error": message, "category": "user", "detail": message}, status=404)

    # --- training ------------------------------------------------------------------------------------------------
    async def create_model(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        # the id the SDK derives too
        model_id = f"{field(body, 'session_id', str)}:train:{field(body, 'model_seq_id', int)}"
        self._session_of(model_id)
        self.backend.check_optimizer(field(body, "optimizer_config", dict))  # fixed for the model's life: now
        return self._submit("create_model", self._create_model, field(body, "base_model", str),
                            field(body, "lora_config", dict), model_id)

    def _create_model(self, base_model: str, lora: dict | None, model_id: str) -> dict:
        return {"type": "create_model", "model_id": self.backend.create_model(base_model, lora, model_id)}

    async def get_info(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        try:
            return web.json_response(self.backend.info(field(body, "model_id", str)))
        except InvalidInput as e:
            return web.json_response({"error": str(e), "category": "user", "detail": str(e)}, status=404)

    async def forward_backward(self, request: web.Request) -> web.Response:
        raw = await request.read()
        if request.headers.get("Content-Encoding") == "zstd":
            import zstandard

            raw = zstandard.ZstdDecompressor().decompress(raw)
        return self._submit("forward_backward", self._forward_backward, raw)

    def _forward_backward(self, raw: bytes) -> bytes:
        call = decode_forward_backward(raw)
        self._session_of(call.model_id)
        outputs, metrics = self.backend.forward_backward(call.model_id, call.loss_fn, call.loss_fn_config,
                                                         call.data, call.forward_only)
        return encode_forward_backward_output(outputs, metrics)

    async def optim_step(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        params = field(body, "adam_params", dict)
        model_id = field(body, "model_id", str)
        if params is None:
            return self._submit("optim_step", _fail, f"optimizer {body.get('optimizer_params')!r} is not served: "
                                "this server runs Adam (pass tinker.AdamParams)")
        return self._submit("optim_step", self._optim_step, model_id, params)

    def _optim_step(self, model_id: str, params: dict) -> dict:
        self._session_of(model_id)  # checked when it runs: a finish queued before it wins
        return {"metrics": self.backend.optim_step(model_id, params)}

    async def save_weights(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        return self._submit("save_weights", self._save_weights, field(body, "model_id", str),
                            field(body, "path", str), bool(field(body, "overwrite", bool, False)), ttl_seconds(body))

    def _save_weights(self, model_id: str, name: str | None, overwrite: bool, ttl: int | None) -> dict:
        self._session_of(model_id)
        return {"type": "save_weights", "path": self.backend.save_state(model_id, name or f"step-{next(self._ids)}",
                                                                        overwrite=overwrite, ttl_seconds=ttl)}

    async def load_weights(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        create = body.get("model_id") is None  # create-via-load: the model is new, named as the SDK names it
        model_id = f"{field(body, 'session_id', str)}:train:{field(body, 'model_seq_id', int)}" if create else \
            field(body, "model_id", str)
        self._session_of(model_id)
        self.backend.check_optimizer(field(body, "optimizer_config", dict))
        self.backend.check_not_expired(field(body, "path", str, ""))  # a 404 now; one that does not exist: its load
        return self._submit("load_weights", self._load_weights, model_id, field(body, "path", str, ""),
                            bool(field(body, "optimizer", bool, False)), create, field(body, "base_model", str))

    def _load_weights(self, model_id: str, path: str, optimizer: bool, create: bool, base_model: str | None) -> dict:
        self._session_of(model_id)
        self.backend.check_base_model(base_model)
        return {"type": "load_weights", "path": path,
                "model_id": self.backend.load_state(model_id, path, optimizer, create=create)}

    async def save_for_sampler(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        return self._submit("save_weights_for_sampler", self._save_for_sampler, field(body, "model_id", str),
                            field(body, "path", str), ttl_seconds(body))

    def _save_for_sampler(self, model_id: str, name: str | None, ttl: int | None) -> dict:
        self._session_of(model_id)
        path = self.backend.save_for_sampler(model_id, name, ttl)
        if name is not None:
            return {"type": "save_weights_for_sampler", "path": path}
        session_id = f"sampling-{uuid.uuid4().hex[:12]}"
        self.sampling_sessions[session_id] = path
        return {"type": "save_weights_for_sampler", "sampling_session_id": session_id}

    # --- sampling ------------------------------------------------------------------------------------------------
    async def create_sampling_session(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        try:
            key = self.backend.check_sampler(field(body, "model_path", str), field(body, "base_model", str))
        except InvalidInput as e:
            return web.json_response({"error": str(e), "category": "user", "detail": str(e)}, status=404)
        session_id = f"sampling-{uuid.uuid4().hex[:12]}"
        self.sampling_sessions[session_id] = key
        return web.json_response({"type": "create_sampling_session", "sampling_session_id": session_id})

    async def get_sampler(self, request: web.Request) -> web.Response:
        """What `create_sampling_client(model_path=...)` asks of its new session: the base model."""
        sampler_id = request.match_info["sampler_id"]
        key = self.sampling_sessions.get(sampler_id)
        if key is None:
            message = f"no sampling session {sampler_id!r} on this server"
            return web.json_response({"error": message, "category": "user", "detail": message}, status=404)
        return web.json_response({"sampler_id": sampler_id, "base_model": self.backend.base_model,
                                  "model_path": None if key == "base" else key})

    async def sample(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        # Everything is read and checked here: a bad field is the client's 400 now, not a failed future
        session_id = field(body, "sampling_session_id", str)
        if session_id:
            key = self.sampling_sessions.get(session_id)
            if key is None:
                raise InvalidInput(f"no sampling session {session_id!r} on this server")
            if key != "base":  # its weights may have expired since the session was made
                self.backend.check_sampler(key, None)
        else:
            key = self.backend.check_sampler(field(body, "model_path", str), field(body, "base_model", str))
        for option in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            if body.get(option):
                raise InvalidInput(f"{option} is not served (prompt_logprobs and sampled log-probs are)")
        if body.get("target_prompt_logprobs") is not None:
            raise InvalidInput("target_prompt_logprobs is not served (prompt_logprobs is)")
        ids = prompt_tokens(field(body, "prompt", dict, {}))
        limit = self.backend.max_context_length
        if len(ids) >= limit:
            raise InvalidInput(f"prompt: {len(ids)} tokens leave no room in max_context_length {limit} (the server's "
                               "--max-context-length)")
        last_n = field(body, "prompt_logprobs_last_n", int)
        if last_n is not None:
            if not body.get("prompt_logprobs"):
                raise InvalidInput("prompt_logprobs_last_n applies to prompt log-probs: set prompt_logprobs "
                                   "(include_prompt_logprobs=True)")
            if not 1 <= last_n <= len(ids) - 1:
                raise InvalidInput(f"prompt_logprobs_last_n {last_n}: between 1 and {len(ids) - 1} (the prompt's "
                                   f"{len(ids)} tokens less the first, which has no log-prob)")
        n = field(body, "num_samples", int, 1)
        if n < 1:
            raise InvalidInput(f"num_samples must be >= 1, got {n}")
        params, seed = sampling_params(field(body, "sampling_params", dict, {}), room=limit - len(ids))
        seeds = [None] * n if seed is None else [seed + i for i in range(n)]
        return self._submit("sample", self._sample, key, ids, params, seeds, bool(body.get("prompt_logprobs")),
                            last_n, samples=n)

    async def _sample(self, key: str, ids: list[int], params: dict[str, Any], seeds: list[int | None],
                      prompt_logprobs: bool, last_n: int | None = None) -> bytes:
        async with self.backend.sampling(key) as policy:  # the engine holding these weights (pushed there if not)
            gens = await asyncio.gather(*(policy.generate(ids, {**params, **({} if s is None else
                                                                             {"sampling_seed": s})}) for s in seeds))
            # the first prompt token has no log-prob (None in the SDK)
            prompt_lp = [float("nan")] + await policy.score(ids) if prompt_logprobs else None
        if prompt_lp is not None and last_n is not None:  # the last n answered, the rest NaN (None in the SDK)
            prompt_lp[:len(ids) - last_n] = [float("nan")] * (len(ids) - last_n)
        seqs = [(list(g.token_ids), list(g.logprobs), "stop" if g.finish_reason == "stop" else "length") for g in gens]
        return encode_sample_response(seqs, prompt_lp)


def sampling_params(sp: dict[str, Any], room: int) -> tuple[dict[str, Any], int | None]:
    """The SDK's `SamplingParams` as the engine's sampling parameters (and the seed), each field checked by name;
    `max_tokens` capped at the `room` the prompt leaves in the context, as SGLang caps it."""
    stop = sp.get("stop")
    stop = [stop] if isinstance(stop, (str, int)) and not isinstance(stop, bool) else stop
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, (str, int)) for s in stop)):
        raise InvalidInput(f"sampling_params.stop must be a string, a token id or a list of them, got {stop!r}")
    kinds = [("max_tokens", int), ("temperature", (int, float)), ("top_p", (int, float)), ("top_k", int),
             ("seed", int)]
    get = {name: field(sp, name, kind, where="sampling_params.") for name, kind in kinds}
    params: dict[str, Any] = {"max_new_tokens": min(get["max_tokens"] or 128, room),
                              "temperature": float(1.0 if get["temperature"] is None else get["temperature"]),
                              "top_p": float(1.0 if get["top_p"] is None else get["top_p"]),
                              "top_k": -1 if get["top_k"] is None else get["top_k"],
                              "stop": [s for s in stop or () if isinstance(s, str)],
                              "stop_token_ids": [s for s in stop or () if isinstance(s, int)]}
    if stop is not None and not stop:
        params["ignore_eos"] = True  # [] disables every stop, EOS included
    return params, get["seed"]


def prompt_tokens(prompt: dict) -> list[int]:
    """The token ids of a JSON `ModelInput` (text chunks only)."""
    ids: list[int] = []
    chunks = prompt.get("chunks") or []
    if not isinstance(chunks, list):
        raise InvalidInput(f"prompt.chunks must be a list, got {chunks!r}")
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, dict):
            raise InvalidInput(f"prompt.chunks[{i}] must be an object, got {chunk!r}")
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise InvalidInput(f"prompt chunk {i} is {chunk.get('type')!r}; this server takes text tokens only")
        tokens = chunk.get("tokens") or []
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise InvalidInput(f"prompt.chunks[{i}].tokens must be a list of token ids")
        ids.extend(tokens)
    if not ids:
        raise InvalidInput("the prompt has no tokens")
    return ids


def _fail(message: str):
    raise InvalidInput(message)


async def start(backend: TinkerBackend, host: str = "127.0.0.1", port: int = 0) -> tuple[web.AppRunner, str]:
    """Start the server on the running loop; returns (runner, base URL)."""
    runner = web.AppRunner(TinkerServer(backend).app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # port 0 picks a free one
    return runner, f"http://{host}:{bound}"
