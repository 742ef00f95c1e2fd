"""`serve-engine`'s OpenAI-compatible routes, as SGLang serves them beside `/generate`: `POST /v1/chat/completions`
(streamed or not), `POST /v1/completions` (non-streaming) and `GET /v1/models`, so `vf-eval` and other OpenAI clients
reach the engine without `serve-gateway` in front.

Chat requests go through the gateway's own pieces: `parse_chat_request` (the same checks and 400s), a `Conversation`
of one call (the model's chat template, tool calls parsed with `--parser`) and `Completion` (the body, or SSE chunks
that reassemble to it). Nothing is recorded: each request is its own conversation. For token-exact ledgers per agent
session, put `serve-gateway` in front instead. Never imported by the core `slime_env` modules.
"""

from __future__ import annotations

import functools
import time
import uuid
from typing import Any

from aiohttp import web

from slime_env.errors import InvalidInput, RenderError
from slime_env.gateway.conversation import Conversation
from slime_env.gateway.openai_api import Completion, error_body, parse_chat_request, sse
from slime_env.gateway.validation import GatewayError, number, seed


class OpenAIRoutes:
    """The routes over one policy (`TransformersPolicy`) and its tokenizer; `model` is the name they answer with."""

    def __init__(self, policy: Any, model: str, parser: str | None = "hermes", max_new_tokens: int = 1024):
        from slime_env.parsers import get_parser

        self.policy, self.model, self.max_new_tokens = policy, model, max_new_tokens
        self.parser, self.parser_name = get_parser(parser), parser
        self.context = getattr(policy, "context_length", None)  # the model's, when its config says

    @functools.cached_property
    def renderer(self) -> Any:
        """The model's chat template, read on the first OpenAI call (an engine serving only /generate never reads
        it)."""
        from slime_env.renderers import get_renderer

        return get_renderer(self.policy.tokenizer)

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/chat/completions", self.chat), web.post("/v1/completions", self.completions),
                web.get("/v1/models", self.models)]

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.model, "object": "model", "created": 0, "owned_by": "slime_env"}
        if self.context is not None:  # as vLLM and SGLang say it: clients (our gateway) refuse longer prompts
            card["max_model_len"] = self.context
        return web.json_response({"object": "list", "data": [card]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        try:
            req = parse_chat_request(await _body(request))
            conv = Conversation(self.renderer, self.parser, parser_name=self.parser_name)
            try:
                call = conv.begin(req.messages, req.tools)
            except (RenderError, ValueError) as e:
                raise GatewayError(400, f"the model's chat template cannot render this request: {e}") from None
            t0 = time.perf_counter()
            gen = await self._generate(call.ids, req.sampling, req.max_tokens)
            reply = conv.finish(call, gen, time.perf_counter() - t0, stop=req.sampling.get("stop") or ())
        except GatewayError as e:
            return web.json_response(error_body(e), status=e.status)
        done = Completion(reply, gen.finish_reason, len(call.ids), len(gen.token_ids),
                          [self.renderer.decode([t]) for t in gen.token_ids] if req.logprobs else (), gen.logprobs,
                          req.model or self.model, stop_sequence=call.stop_sequence)
        if not req.stream:
            return web.json_response(done.body(req.logprobs))
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await out.prepare(request)
        for event in done.chunks(req.logprobs, req.include_usage):
            await out.write(sse(event))
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def completions(self, request: web.Request) -> web.Response:
        """Plain completions: a prompt (text, or token ids) continued; `logprobs` gives the sampled tokens'."""
        try:
            body = await _body(request)
            if body.get("stream"):
                raise GatewayError(400, "stream: /v1/completions answers whole (use /v1/chat/completions to stream)",
                                   param="stream")
            for name, unset in (("echo", (None, False)), ("best_of", (None, 1)), ("suffix", (None, "")),
                                ("logit_bias", (None, {}))):
                if body.get(name) not in unset:
                    raise GatewayError(400, f"{name}: not supported by serve-engine's /v1/completions", param=name)
            if body.get("n", 1) not in (1, None):
                raise GatewayError(400, f"n={body['n']}: one choice per call", param="n")
            ids = self._prompt_ids(body.get("prompt"))
            sampling = {k: v for k, v in {"temperature": number(body, "temperature", 0, 2),
                                          "top_p": number(body, "top_p", 0, 1, low_open=True),
                                          "sampling_seed": seed(body, "seed")}.items() if v is not None}
            stop = body.get("stop")
            if stop is not None:
                stop = [stop] if isinstance(stop, str) else stop
                if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
                    raise GatewayError(400, "stop: a string or a list of non-empty strings", param="stop")
                sampling["stop"] = stop
            max_tokens = body.get("max_tokens", 16)  # OpenAI's default for this route
            if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
                raise GatewayError(400, f"max_tokens: expected a positive integer, got {max_tokens!r}",
                                   param="max_tokens")
            gen = await self._generate(ids, sampling, max_tokens)
        except GatewayError as e:
            return web.json_response(error_body(e), status=e.status)
        text = gen.text if gen.text is not None else self.renderer.decode(gen.token_ids)
        logprobs = None
        if body.get("logprobs"):
            tokens = [self.renderer.decode([t]) for t in gen.token_ids]
            offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
            logprobs = {"tokens": tokens, "token_logprobs": [float(lp) for lp in gen.logprobs], "top_logprobs": None,
                        "text_offset": offsets}
        return web.json_response({
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": body.get("model") or self.model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                         "finish_reason": "length" if gen.finish_reason == "length" else "stop"}],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(gen.token_ids),
                      "total_tokens": len(ids) + len(gen.token_ids)}})

    def _prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str) and prompt:
            return list(self.renderer.tokenizer.encode(prompt, add_special_tokens=False))
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        raise GatewayError(400, "prompt: a non-empty string or a list of token ids (one prompt per call)",
                           param="prompt")

    async def _generate(self, ids: list[int], sampling: dict[str, Any], max_tokens: int | None) -> Any:
        """The engine's generation, its room capped by the model's context (a prompt that leaves none is a 400)."""
        room = max_tokens or self.max_new_tokens
        if self.context is not None:
            room = min(room, self.context - len(ids))
            if room < 1:
                raise GatewayError(400, f"this request's {len(ids)} prompt tokens leave no room in the model's "
                                        f"context of {self.context} tokens", param="messages",
                                   code="context_length_exceeded")
        params = {**sampling, "max_new_tokens": room, "stop_token_ids": sorted(self.renderer.stop_token_ids)}
        try:
            return await self.policy.generate(ids, params)
        except InvalidInput as e:  # the engine refused the request's own parameters
            raise GatewayError(400, f"the engine refused this request: {e}") from None


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError):
        raise GatewayError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise GatewayError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body
