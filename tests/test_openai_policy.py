"""OpenAIPolicy contract tests against a server of our own that answers in vLLM's `/v1/completions` shape.

The server is a test double with recorded-shape answers (no vLLM can run here). Set
SLIME_ENV_OPENAI_URL (e.g. http://127.0.0.1:8000/v1) and SLIME_ENV_OPENAI_MODEL to also run the live
test against a real vLLM server.
"""

from __future__ import annotations

import asyncio
import os

import pytest
from aiohttp import web
from helpers import LocalServer
from slime_env.clients.openai import OpenAIPolicy, completion_request, parse_completion

from slime_env.http import ProtocolError, RemoteError

# A vLLM 0.11 answer to {"prompt": [...], "logprobs": 1, "return_token_ids": true,
# "return_tokens_as_token_ids": true}, reduced to the fields the client reads.
RECORDED = {
    "id": "cmpl-1", "object": "text_completion", "model": "m",
    "choices": [{"index": 0, "text": " Paris.", "finish_reason": "stop", "stop_reason": None,
                 "token_ids": [12366, 13, 2],
                 "logprobs": {"tokens": ["token_id:12366", "token_id:13", "token_id:2"],
                              "token_logprobs": [-0.25, -0.5, -0.125], "top_logprobs": [{}, {}, {}],
                              "text_offset": [0, 6, 7]}}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
              "prompt_tokens_details": {"cached_tokens": 4}},
}


def _without(key: str) -> dict:
    choice = {k: v for k, v in RECORDED["choices"][0].items() if k != key}
    return {**RECORDED, "choices": [choice]}


class RecordedServer:
    """Answers /v1/completions with a chosen recorded body; keeps the requests it got."""

    def __init__(self, answer: dict, status: int = 200):
        self.answer, self.status, self.requests = answer, status, []

    async def handle(self, request: web.Request) -> web.Response:
        self.requests.append(await request.json())
        return web.json_response(self.answer, status=self.status)

    async def __aenter__(self):
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        self.server = await LocalServer(app).__aenter__()
        self.url = self.server.url + "/v1"
        return self

    async def __aexit__(self, *exc):
        await self.server.__aexit__(*exc)


def _call(answer, status=200, **kw):
    async def main():
        async with RecordedServer(answer, status) as server:
            policy = OpenAIPolicy(server.url, "m", max_retries=0, **kw)
            try:
                gen = await policy.generate([1, 2, 3], {"max_new_tokens": 16, "temperature": 0.5, "top_k": 20,
                                                        "stop": "</s>", "stop_token_ids": [2]})
                return gen, server.requests
            finally:
                await policy.close()

    return asyncio.run(main())


def test_request_shape_and_ids_from_token_ids():
    gen, requests = _call(RECORDED)
    body = requests[0]
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 16 and body["logprobs"] == 1
    assert body["return_token_ids"] and body["return_tokens_as_token_ids"] and not body["skip_special_tokens"]
    assert body["stop"] == ["</s>"] and body["stop_token_ids"] == [2] and body["top_k"] == 20
    assert gen.token_ids == (12366, 13, 2) and gen.logprobs == (-0.25, -0.5, -0.125)
    assert gen.finish_reason == "stop" and gen.text == " Paris." and gen.cached_tokens == 4


def test_ids_from_token_id_strings_when_token_ids_absent():
    gen, _ = _call(_without("token_ids"))
    assert gen.token_ids == (12366, 13, 2)


def test_strict_refuses_to_retokenize(smollm2_tok):
    answer = _without("token_ids")
    answer["choices"][0]["logprobs"] = {**answer["choices"][0]["logprobs"], "tokens": [" Paris", ".", "</s>"]}
    with pytest.raises(ProtocolError, match="refusing to re-tokenize"):
        _call(answer)
    answer["choices"][0]["logprobs"]["token_logprobs"] = [-0.25, -0.5]
    answer["choices"][0]["text"] = " Paris."
    with pytest.warns(UserWarning, match="re-tokenizing"):
        gen, _ = _call(answer, strict=False, tokenizer=smollm2_tok)
    assert list(gen.token_ids) == smollm2_tok.encode(" Paris.", add_special_tokens=False)


def test_malformed_answers_are_named():
    with pytest.raises(ProtocolError, match="no choices"):
        _call({"choices": []})
    with pytest.raises(ProtocolError, match="no logprobs.token_logprobs"):
        _call(_without("logprobs"))
    bad = _without("finish_reason")
    with pytest.raises(ProtocolError, match="finish_reason None"):
        _call(bad)
    with pytest.raises(RemoteError, match="answered 400"):
        _call({"error": "bad"}, status=400)


def test_parse_and_request_helpers():
    assert parse_completion(RECORDED).prompt_tokens == 5
    body = completion_request("m", [5], {"top_k": -1, "sampling_seed": 3})
    assert "top_k" not in body and body["seed"] == 3 and body["max_tokens"] == 128
    # every sampling field vLLM's /completions documents goes through (SGLang's min_new_tokens as min_tokens)
    body = completion_request("m", [5], {"ignore_eos": True, "min_new_tokens": 4, "presence_penalty": 0.5,
                                         "frequency_penalty": 0.25, "stop_token_ids": (7, 9), "logit_bias": {"5": -1}})
    assert body["ignore_eos"] is True and body["min_tokens"] == 4 and body["presence_penalty"] == 0.5
    assert body["frequency_penalty"] == 0.25 and body["stop_token_ids"] == [7, 9] and body["logit_bias"] == {"5": -1}


@pytest.mark.skipif(not os.environ.get("SLIME_ENV_OPENAI_URL"),
                    reason="set SLIME_ENV_OPENAI_URL and SLIME_ENV_OPENAI_MODEL to test a live vLLM server")
def test_live_openai_compatible_server():
    async def main():
        policy = OpenAIPolicy(os.environ["SLIME_ENV_OPENAI_URL"], os.environ.get("SLIME_ENV_OPENAI_MODEL", ""))
        try:
            return await policy.generate([1, 2, 3, 4], {"max_new_tokens": 8, "temperature": 0})
        finally:
            await policy.close()

    gen = asyncio.run(main())
    assert 0 < len(gen.token_ids) == len(gen.logprobs) <= 8
