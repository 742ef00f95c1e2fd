"""`slime-env serve-tinker`: an HTTP server that the `tinker` SDK (and so `tinker-cookbook`) talks to unchanged.

Routes, bodies and the futures protocol follow the SDK's client (tinker 0.38): every training or sampling call
answers at once with `{"request_id": ...}`; the SDK then long-polls `POST /api/v1/retrieve_future` and gets
`{"type": "try_again", ...}` while the work runs, the result (JSON, or protobuf for `ForwardBackwardOutput` and
`SampleResponse`), or `{"error": ..., "category": "user" | "server"}`, which the SDK raises as `RequestFailedError`.
Work runs in arrival order on one worker thread, so the SDK's ordering of forward_backward / optim_step holds.
Routes the SDK has that are not built here answer 404 with a JSON body naming what is refused.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from slime_env.errors import InvalidInput
from slime_env.trainers.tinker.backend import TinkerBackend
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


class TinkerServer:
    """The routes over one `TinkerBackend`."""

    def __init__(self, backend: TinkerBackend):
        self.backend = backend
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slime_env-tinker")
        self.futures: dict[str, asyncio.Task] = {}
        self.sessions: dict[str, float] = {}
        self.sampling_sessions: dict[str, str] = {}  # sampling_session_id -> sampler key
        self._ids = itertools.count()
        self.calls: dict[str, int] = {}

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        get = {"/api/v1/healthz": self.healthz, "/api/v1/get_server_capabilities": self.capabilities}
        post = {
            "/api/v1/client/config": self.client_config, "/api/v1/client/dynamic_config": self.dynamic_config,
            "/api/v1/create_session": self.create_session, "/api/v1/session_heartbeat": self.heartbeat,
            "/api/v1/telemetry": self.telemetry, "/api/v1/create_model": self.create_model,
            "/api/v1/get_info": self.get_info, "/api/v1/forward_backward": self.forward_backward,
            "/api/v1/optim_step": self.optim_step, "/api/v1/save_weights": self.save_weights,
            "/api/v1/load_weights": self.load_weights, "/api/v1/save_weights_for_sampler": self.save_for_sampler,
            "/api/v1/create_sampling_session": self.create_sampling_session, "/api/v1/asample": self.sample,
            "/api/v1/retrieve_future": self.retrieve_future,
        }
        for path, handler in get.items():
            app.router.add_get(path, handler)
        for path, handler in post.items():
            app.router.add_post(path, handler)
        app.router.add_post("/api/v1/sessions/{session_id}/finish", self.finish_session)
        app.router.add_post("/api/v1/cancel_future", self.cancel_future)
        app.router.add_get("/api/v1/samplers/{sampler_id}", self.get_sampler)
        app.router.add_route("*", "/{tail:.*}", self.refused)
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
        body = await request.json()
        request_id = body.get("request_id")
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
        body = await request.json()
        self.sessions[body.get("session_id", "")] = time.time()
        return web.json_response({"type": "session_heartbeat"})

    async def finish_session(self, request: web.Request) -> web.Response:
        self.sessions.pop(request.match_info["session_id"], None)
        return web.json_response({})

    async def cancel_future(self, request: web.Request) -> web.Response:
        body = await request.json()
        task = self.futures.pop(body.get("request_id", ""), None)
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
        body = await request.json()
        model_id = f"{body.get('session_id')}:train:{body.get('model_seq_id')}"  # the id the SDK derives too
        return self._submit("create_model", self._create_model, body.get("base_model"), body.get("lora_config"),
                            model_id)

    def _create_model(self, base_model: str, lora: dict | None, model_id: str) -> dict:
        return {"type": "create_model", "model_id": self.backend.create_model(base_model, lora, model_id)}

    async def get_info(self, request: web.Request) -> web.Response:
        body = await request.json()
        try:
            return web.json_response(self.backend.info(body.get("model_id")))
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
        outputs, metrics = self.backend.forward_backward(call.model_id, call.loss_fn, call.loss_fn_config,
                                                         call.data, call.forward_only)
        return encode_forward_backward_output(outputs, metrics)

    async def optim_step(self, request: web.Request) -> web.Response:
        body = await request.json()
        params = body.get("adam_params")
        if params is None:
            return self._submit("optim_step", _fail, f"optimizer {body.get('optimizer_params')!r} is not served: "
                                "this server runs Adam (pass tinker.AdamParams)")
        return self._submit("optim_step", self._optim_step, body.get("model_id"), params)

    def _optim_step(self, model_id: str, params: dict) -> dict:
        return {"metrics": self.backend.optim_step(model_id, params)}

    async def save_weights(self, request: web.Request) -> web.Response:
        body = await request.json()
        return self._submit("save_weights", self._save_weights, body.get("model_id"), body.get("path"))

    def _save_weights(self, model_id: str, name: str | None) -> dict:
        return {"type": "save_weights", "path": self.backend.save_state(model_id, name or f"step-{next(self._ids)}")}

    async def load_weights(self, request: web.Request) -> web.Response:
        body = await request.json()
        create = body.get("model_id") is None  # create-via-load: the model is new, named as the SDK names it
        model_id = f"{body.get('session_id')}:train:{body.get('model_seq_id')}" if create else body["model_id"]
        return self._submit("load_weights", self._load_weights, model_id, body.get("path", ""),
                            bool(body.get("optimizer")), create, body.get("base_model"))

    def _load_weights(self, model_id: str, path: str, optimizer: bool, create: bool, base_model: str | None) -> dict:
        self.backend.check_base_model(base_model)
        return {"type": "load_weights", "path": path,
                "model_id": self.backend.load_state(model_id, path, optimizer, create=create)}

    async def save_for_sampler(self, request: web.Request) -> web.Response:
        body = await request.json()
        return self._submit("save_weights_for_sampler", self._save_for_sampler, body.get("model_id"),
                            body.get("path"))

    def _save_for_sampler(self, model_id: str, name: str | None) -> dict:
        path = self.backend.save_for_sampler(model_id, name)
        if name is not None:
            return {"type": "save_weights_for_sampler", "path": path}
        session_id = f"sampling-{uuid.uuid4().hex[:12]}"
        self.sampling_sessions[session_id] = path
        return {"type": "save_weights_for_sampler", "sampling_session_id": session_id}

    # --- sampling ------------------------------------------------------------------------------------------------
    async def create_sampling_session(self, request: web.Request) -> web.Response:
        body = await request.json()
        try:
            key = self.backend.check_sampler(body.get("model_path"), body.get("base_model"))
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
        body = await request.json()
        return self._submit("sample", self._sample, body, samples=max(1, int(body.get("num_samples", 1))))

    async def _sample(self, body: dict) -> bytes:
        if body.get("sampling_session_id"):
            key = self.sampling_sessions.get(body["sampling_session_id"])
            if key is None:
                raise InvalidInput(f"no sampling session {body['sampling_session_id']!r} on this server")
        else:
            key = self.backend.check_sampler(body.get("model_path"), body.get("base_model"))
        for option in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            if body.get(option):
                raise InvalidInput(f"{option} is not served (prompt_logprobs and sampled log-probs are)")
        if body.get("target_prompt_logprobs") is not None:
            raise InvalidInput("target_prompt_logprobs is not served (prompt_logprobs is)")
        ids = prompt_tokens(body.get("prompt") or {})
        sp = body.get("sampling_params") or {}
        stop = sp.get("stop")
        stop = [stop] if isinstance(stop, str) else list(stop or [])
        params: dict[str, Any] = {"max_new_tokens": int(sp.get("max_tokens") or 128),
                                  "temperature": float(sp.get("temperature", 1.0)),
                                  "top_p": float(sp.get("top_p", 1.0)), "top_k": int(sp.get("top_k", -1)),
                                  "stop": [s for s in stop if isinstance(s, str)],
                                  "stop_token_ids": [s for s in stop if isinstance(s, int)]}
        if sp.get("stop") is not None and not stop:
            params["ignore_eos"] = True  # [] disables every stop, EOS included
        n = int(body.get("num_samples", 1))
        if n < 1:
            raise InvalidInput(f"num_samples must be >= 1, got {n}")
        seeds = [None] * n if sp.get("seed") is None else [int(sp["seed"]) + i for i in range(n)]
        async with self.backend.sampling(key) as policy:  # the engine holding these weights (pushed there if not)
            gens = await asyncio.gather(*(policy.generate(ids, {**params, **({} if s is None else
                                                                             {"sampling_seed": s})}) for s in seeds))
            # the first prompt token has no log-prob (None in the SDK)
            prompt_lp = [float("nan")] + await policy.score(ids) if body.get("prompt_logprobs") else None
        seqs = [(list(g.token_ids), list(g.logprobs), "stop" if g.finish_reason == "stop" else "length") for g in gens]
        return encode_sample_response(seqs, prompt_lp)


def prompt_tokens(prompt: dict) -> list[int]:
    """The token ids of a JSON `ModelInput` (text chunks only)."""
    ids: list[int] = []
    for i, chunk in enumerate(prompt.get("chunks") or []):
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise InvalidInput(f"prompt chunk {i} is {chunk.get('type')!r}; this server takes text tokens only")
        ids.extend(int(t) for t in chunk.get("tokens") or [])
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
