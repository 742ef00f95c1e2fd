"""`serve-tinker --sampler-url`: an engine server (SGLang, our `serve-engine`, vLLM) as the sampler of every sampling
client, in place of the embedded engine.

A sampler path's adapter reaches the server through the run's own weight-sync channel for that policy
(`trainers.vllm_sync.channel_for`, which is `weight_sync.channel_for` for SGLang servers: `push_adapter` writes the
PEFT folder and loads it by name), named `tinker@<version>` with one version per sampler path, as RL syncs name theirs;
each request then names its adapter (SGLang's `lora_path`, vLLM's `model`). At most `kept` adapters stay loaded
(SGLang's `--max-loaded-loras` when it reports one): a new one evicts the least recently used that has no request
running. The base model samples without an adapter. `serve-engine` merges adapters into its weights, so only the last
one loaded generates (it says `lora_merged` in `/get_server_info`): there one adapter samples at a time, and a request
for another waits for the running ones, then loads its adapter again (the base: an adapter with no matrices).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from slime_env import Generation
from slime_env.errors import InvalidInput

KINDS = ("sglang", "vllm")
ADAPTER = "tinker"  # adapters load as "tinker@<version>"


def check_kind(kind: str) -> None:
    """InvalidInput naming `--sampler-kind` unless `kind` is one this module serves."""
    if kind not in KINDS:
        raise InvalidInput(f"--sampler-kind {kind!r}: one of {list(KINDS)}")


class ServerSampler:
    """Sampler weights on one engine server at `url` (`kind` sglang: SGLang or serve-engine; vllm), its adapter folders
    under `folder` (the server must see it: same host or shared filesystem)."""

    def __init__(self, url: str, kind: str, layout: Any, folder: str | Path, *, kept: int = 4):
        check_kind(kind)
        if kept < 1:
            raise InvalidInput(f"samplers kept on the server must be >= 1, got {kept}")
        if kind == "vllm":
            from slime_env.clients.vllm import VLLMPolicy

            self.policy: Any = VLLMPolicy(url)
        else:
            from slime_env.clients.sglang import SGLangPolicy

            self.policy = SGLangPolicy(url)
        self.kind, self.layout, self.folder, self.kept = kind, layout, Path(folder), kept
        self.merged: bool | None = None  # serve-engine: one adapter generates at a time (asked on first use)
        self.names: dict[str, str] = {}  # sampler key -> its adapter's name on the server
        self.loaded: OrderedDict[str, None] = OrderedDict()  # names loaded there, least recently used first
        self.active: str | None = None  # the adapter merged last (serve-engine)
        self.busy: dict[str | None, int] = {}  # requests running per adapter name (None: the base)
        self._versions = itertools.count(1)
        self._changed: asyncio.Condition | None = None
        self._channel: Any = None

    @asynccontextmanager
    async def sampling(self, key: str, folder: Path | None) -> AsyncIterator[SamplerView]:
        """A view sampling sampler `key` (`folder`: its PEFT adapter; None for the base model) on the server, whose
        adapter stays loaded (and, on serve-engine, generating) until the block ends."""
        if self._changed is None:
            self._changed = asyncio.Condition()
        async with self._changed:
            if self.merged is None:  # under the lock: no request runs before the answer is in
                await self._ask_server()
            name = await self._ready(key, folder)
            self.busy[name] = self.busy.get(name, 0) + 1
        try:
            yield SamplerView(self, name)
        finally:
            async with self._changed:
                self.busy[name] -= 1
                self._changed.notify_all()

    async def _ask_server(self) -> None:
        info = await self.policy.get_server_info() if hasattr(self.policy, "get_server_info") else {}
        self.merged = bool(info.get("lora_merged"))
        if info.get("max_loaded_loras"):  # SGLang's bound on loaded adapters
            self.kept = min(self.kept, int(info["max_loaded_loras"]))

    async def _ready(self, key: str, folder: Path | None) -> str | None:
        """The name `key` samples under, loaded (and the one generating, when merged); waits while that needs an
        adapter with requests running to go."""
        while True:
            if folder is None and not self.merged:
                return None  # the base: requests name no adapter
            name = self.names.get(key)
            if name in self.loaded and (not self.merged or self.active == name):
                self.loaded.move_to_end(name)
                return name
            if self.merged and self.busy.get(self.active, 0):
                await self._changed.wait()  # the merged adapter is generating: it stays until its requests end
                continue
            if name not in self.loaded and len(self.loaded) >= self.kept:
                idle = next((n for n in self.loaded if not self.busy.get(n)), None)
                if idle is None:
                    await self._changed.wait()
                    continue
                await self.policy.unload_lora_adapter(idle)
                del self.loaded[idle]
            return await self._push(key, folder)

    async def _push(self, key: str, folder: Path | None) -> str:
        """`key`'s adapter through the weight-sync channel, under its version (the base: an adapter of no matrices)."""
        from slime_env.agents.lora_adapter import LoRAAdapter
        from slime_env.trainers.vllm_sync import channel_for

        if self._channel is None:
            self._channel = channel_for(self.policy, self.layout, path=self.folder)
            self._channel.keep_adapters = 1 << 30  # evicted here (least recently used and idle), not by load order
        if key not in self.names:
            self.names[key] = f"{ADAPTER}@{next(self._versions)}"
        name = self.names[key]
        adapter = LoRAAdapter(ADAPTER, {}) if folder is None else \
            await asyncio.to_thread(LoRAAdapter.load, folder, ADAPTER)
        await self._channel.push_adapter(adapter, name.rpartition("@")[2])
        self.loaded[name] = None
        self.loaded.move_to_end(name)
        self.active = name
        return name

    async def prompt_logprobs(self, ids: Sequence[int], name: str | None) -> list[float]:
        """Log-probs of `ids[1:]` (SGLang's prefill-only `/generate`: `input_token_logprobs` from position 0)."""
        if self.kind == "vllm":
            raise InvalidInput("include_prompt_logprobs is not served by a vLLM sampler (--sampler-kind vllm): its "
                               "token-in route returns no prompt log-probs here (sampled log-probs are)")
        from slime_env.trainers.run.teacher import input_logprobs, token_logprobs

        body = {"input_ids": list(ids), **({"lora_path": name} if name is not None else {})}
        url = self.policy.url
        return token_logprobs(await input_logprobs(self.policy.http, url, body), ids, url)  # a teacher's scoring

    async def close(self) -> None:
        await self.policy.close()


class SamplerView:
    """What the server's `sample` calls (`generate`, `score`, as on `TransformersPolicy`), bound to one adapter."""

    def __init__(self, sampler: ServerSampler, name: str | None):
        self.sampler, self.name = sampler, name

    async def generate(self, ids: Sequence[int], params: dict[str, Any]) -> Generation:
        gen = await self.sampler.policy.generate(ids, params, adapter=self.name)
        if self.sampler.merged and gen.adapter != self.name:  # the server generated from weights it was not asked
            raise RuntimeError(f"the sampler server generated with adapter {gen.adapter!r}, not {self.name!r}")
        return gen

    async def score(self, ids: Sequence[int]) -> list[float]:
        return await self.sampler.prompt_logprobs(ids, self.name)
