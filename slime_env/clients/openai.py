"""`OpenAIPolicy`: OpenAI-compatible `/completions` servers (vLLM and others), token ids in and out.

The prompt is sent as token ids. The generated ids are taken from the server's answer, never from
re-tokenizing its text: `choices[0].token_ids` (vLLM with `return_token_ids`), else
`logprobs.tokens` written as `token_id:N` (vLLM with `return_tokens_as_token_ids`). A server that
returns neither cannot keep the ledger exact: `strict=True` (the default) refuses with
`ProtocolError`; `strict=False` re-tokenizes the text with `tokenizer` and marks the generation
(`Generation.text` kept, log-probs kept only when the counts agree, else the call fails) — a known
source of id / log-prob misalignment, so only for evaluation.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from slime_env import Generation
from slime_env.clients.session import Usage
from slime_env.http import HttpClient, ProtocolError

_FINISH = {"stop": "stop", "length": "length", "abort": "abort", "eos": "stop"}
# Our (SGLang-style) sampling param -> the /completions field (vLLM's SamplingParams extensions included).
_PASSTHROUGH = {"top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                "sampling_seed": "seed", "seed": "seed", "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos",
                "min_new_tokens": "min_tokens", "min_tokens": "min_tokens", "logit_bias": "logit_bias",
                "bad_words": "bad_words", "allowed_token_ids": "allowed_token_ids"}


def completion_request(model: str, input_ids: Sequence[int], params: Mapping[str, Any]) -> dict[str, Any]:
    """The `/completions` body for SGLang-style sampling params (vLLM extensions included)."""
    body: dict[str, Any] = {
        "model": model, "prompt": list(input_ids), "max_tokens": int(params.get("max_new_tokens", 128)),
        "temperature": float(params.get("temperature", 1.0)), "top_p": float(params.get("top_p", 1.0)),
        "logprobs": 1, "echo": False, "n": 1,
        # vLLM extensions: exact ids back, special tokens kept, stop strings kept (as SGLang's no_stop_trim)
        "return_token_ids": True, "return_tokens_as_token_ids": True, "skip_special_tokens": False,
        "include_stop_str_in_output": True, "spaces_between_special_tokens": False,
    }
    if params.get("stop"):
        body["stop"] = [params["stop"]] if isinstance(params["stop"], str) else list(params["stop"])
    for ours, theirs in _PASSTHROUGH.items():
        value = params.get(ours)
        if value is None or (ours == "top_k" and value in (-1, 0)):
            continue
        body[theirs] = list(value) if isinstance(value, (tuple, set, frozenset)) else value
    return body


def parse_completion(body: Any, *, tokenizer: Any = None, strict: bool = True) -> Generation:
    """A `Generation` from one `/completions` answer; ProtocolError naming what is missing."""
    try:
        choice = body["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise ProtocolError(f"/completions answer has no choices[0]: {str(body)[:200]}") from None
    text = choice.get("text") or ""
    lp = choice.get("logprobs") or {}
    logprobs = lp.get("token_logprobs")
    if logprobs is None:
        raise ProtocolError("/completions answer has no logprobs.token_logprobs (request sent logprobs=1)")
    ids = choice.get("token_ids")
    if ids is None and lp.get("tokens") and all(isinstance(t, str) and t.startswith("token_id:")
                                                for t in lp["tokens"]):
        ids = [int(t.split(":", 1)[1]) for t in lp["tokens"]]
    if ids is None:
        if strict or tokenizer is None:
            raise ProtocolError("the server returned no generated token ids (vLLM: return_token_ids / "
                                "return_tokens_as_token_ids); refusing to re-tokenize text in strict mode")
        warnings.warn("OpenAIPolicy(strict=False): re-tokenizing generated text; ids may not be the sampled ones",
                      stacklevel=3)
        ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != len(logprobs) or any(x is None for x in logprobs):
        raise ProtocolError(f"{len(ids)} generated ids but {len(logprobs)} log-probs (or a missing log-prob)")
    finish = choice.get("finish_reason")
    if finish not in _FINISH:
        raise ProtocolError(f"finish_reason {finish!r} is not stop / length / abort")
    usage = body.get("usage") or {}
    cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    return Generation(token_ids=tuple(int(i) for i in ids), logprobs=tuple(float(x) for x in logprobs),
                      finish_reason=_FINISH[finish], text=text, prompt_tokens=int(usage.get("prompt_tokens") or 0),
                      cached_tokens=int(cached))


class OpenAIPolicy:
    """A `slime_env.Policy` for an OpenAI-compatible server: `base_url` like "http://host:8000/v1".

    See the module docstring for how generated ids are obtained and what `strict` means.
    """

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None, strict: bool = True,
                 tokenizer: Any = None, max_connections: int = 256, timeout_s: float = 600.0, max_retries: int = 3,
                 backoff_s: float = 0.2):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self.http = HttpClient(base_url, max_connections=max_connections, timeout_s=timeout_s,
                               max_retries=max_retries, backoff_s=backoff_s, headers=headers)
        self.model, self.strict, self.tokenizer = model, strict, tokenizer
        self.usage = Usage()

    async def generate(self, input_ids: Sequence[int], sampling_params: Mapping[str, Any]) -> Generation:
        t0 = time.perf_counter()
        body = await self.http.request("POST", "/completions", completion_request(self.model, input_ids,
                                                                                 sampling_params))
        gen = parse_completion(body, tokenizer=self.tokenizer, strict=self.strict)
        return self.usage.record(gen, input_ids, time.perf_counter() - t0)

    async def close(self) -> None:
        await self.http.close()
