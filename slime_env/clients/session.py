"""What the engine clients share: their construction (`ServerClient`: pooled HTTP, usage counters, the LoRA adapters
loaded), per-episode views (one request id per call, abort of the live one), and the served model's context length."""

from __future__ import annotations

import dataclasses

import inspect
import itertools
from collections.abc import Mapping, Sequence
from types import EllipsisType
from typing import Any

from slime_env import Generation
from slime_env.http import HttpClient


class EpisodeSession:
    """What `run_episode` gets from `policy.for_episode(session_id)`.

    Each call is sent with `rid=f"{session_id}-{turn}"` (plus `generate_kwargs`, e.g. SGLang's routing
    key); `abort()` calls `policy.abort(rid)` for the latest request, which, if still running, returns
    its partial tokens with finish_reason "abort".
    """

    def __init__(self, policy: Any, session_id: str, **generate_kwargs: Any):
        self.policy, self.session_id, self.generate_kwargs = policy, session_id, generate_kwargs
        self._turns = itertools.count()
        self.live_rid: str | None = None

    async def generate(self, input_ids: Sequence[int], sampling_params: Mapping[str, Any],
                       **kwargs: Any) -> Generation:
        """One call of the policy under this session's rid; `kwargs` (a VLM ledger's `images`) pass through."""
        # live_rid stays set after the call returns or is cancelled: an abort that arrives just after a
        # timeout cancelled the call must still reach the engine (aborting a finished rid is harmless).
        self.live_rid = f"{self.session_id}-{next(self._turns)}"
        return await self.policy.generate(input_ids, sampling_params, rid=self.live_rid, **self.generate_kwargs,
                                          **kwargs)

    async def abort(self) -> bool:
        rid = self.live_rid
        if rid is None:
            return False
        result = self.policy.abort(rid)
        if inspect.isawaitable(result):
            await result
        return result is not False


class Usage(dict):
    """Per-policy usage counters: calls, prompt / completion / cached tokens, latency."""

    def __init__(self) -> None:
        super().__init__(calls=0, prompt_tokens=0, completion_tokens=0, cached_tokens=0, latency_s=0.0)

    def record(self, gen: Generation, input_ids: Sequence[int], latency_s: float) -> Generation:
        """Count one call; return the generation with prompt tokens and latency filled in."""
        prompt = gen.prompt_tokens or len(input_ids)
        self["calls"] += 1
        self["prompt_tokens"] += prompt
        self["completion_tokens"] += len(gen.token_ids)
        self["cached_tokens"] += gen.cached_tokens
        self["latency_s"] += latency_s
        return dataclasses.replace(gen, prompt_tokens=prompt, latency_s=latency_s)


class LoadedAdapters:
    """The LoRA adapters a server client loaded ("name@version", oldest first): requests name the newest, and the
    generations they give carry it. The client defines `unload_lora_adapter(name)`."""

    loras: list[str]

    def _adapter(self, adapter: str | None | EllipsisType) -> str | None:
        """A request's adapter: `...` is the newest this client loaded (None before any), None the base model."""
        return (self.loras[-1] if self.loras else None) if adapter is ... else adapter

    def _loaded(self, lora_name: str) -> None:
        self.loras = [n for n in self.loras if n != lora_name] + [lora_name]

    def _forget(self, lora_name: str) -> None:
        self.loras = [n for n in self.loras if n != lora_name]

    @staticmethod
    def _tagged(gen: Generation, adapter: str, **changes: Any) -> Generation:
        """`gen` as made by `adapter`: its tokens' version is the adapter's (the servers report the base model's)."""
        return dataclasses.replace(gen, adapter=adapter, weight_version=adapter.rpartition("@")[2], **changes)

    async def unload_lora_adapters(self, keep: int) -> list[str]:
        """Unload all but the newest `keep` adapters this client loaded (the run's staleness bound + 1 stay, so
        every in-flight request's adapter is still there); returns the names unloaded."""
        old = self.loras[:-keep] if keep > 0 else list(self.loras)
        for name in old:
            await self.unload_lora_adapter(name)
        return old



class ServerClient(LoadedAdapters):
    """A client of one engine server at `url`: a connection pool of `max_connections`, per-request `timeout_s`,
    `max_retries` with exponential backoff from `backoff_s` (connection errors and 5xx, never 4xx), `headers` on every
    request; its `usage` counters, and the adapters it loaded (`loras`, oldest first: requests name the newest)."""

    def __init__(self, url: str, *, max_connections: int = 256, timeout_s: float = 600.0,
                 connect_timeout_s: float = 10.0, max_retries: int = 3, backoff_s: float = 0.2,
                 headers: Mapping[str, str] | None = None):
        self.url = url.rstrip("/")
        self.http = HttpClient(self.url, max_connections=max_connections, timeout_s=timeout_s,
                               connect_timeout_s=connect_timeout_s, max_retries=max_retries, backoff_s=backoff_s,
                               headers=headers)
        self.usage = Usage()
        self.loras: list[str] = []


async def served_context_length(http: Any) -> int | None:
    """The context length the server's `/v1/models` reports for its model (`max_model_len`: vLLM, SGLang and
    `slime-env serve-engine` give it), or None when it says none or cannot be asked."""
    try:
        body = await http.request("GET", "/v1/models", max_retries=0)
        value = (body.get("data") or [{}])[0].get("max_model_len")
    except Exception:  # noqa: BLE001 - an older server, or none of this route: no limit known
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
