"""`TransformersPolicy`: a local engine on a Hugging Face causal LM, batching concurrent requests.

By default (`batching="continuous"`, `slime_env.agents.engine`) requests join the running batch at the next
decoding step — none waits for another to finish — and each episode session keeps the KV cache of what
it has fed so far, so its next turn encodes only the new tokens. `batching="static"` is the older loop:
requests that arrive within `batch_window_s` of each other are generated as one left-padded batch (at most
`max_batch_size`) run to completion. Either way one worker thread runs torch: the event loop never does. Each request
keeps its own sampling params (SGLang names: temperature, top_p, top_k, max_new_tokens, stop, stop_token_ids,
ignore_eos, sampling_seed) and gets back the log-prob of every sampled token under the distribution it was sampled from
(temperature, top-k and top-p applied and renormalised; for greedy decoding, temperature 0, the model's own
log-softmax).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from slime_env import Generation
from slime_env.agents.worker import EngineFront, Request
from slime_env.clients.session import EpisodeSession
from slime_env.errors import InvalidInput
from slime_env.policy import check_sampling_seed
from slime_env.routing import RoutedExperts


def _check_ids(input_ids: Any, vocab_size: int) -> list[int]:
    """`input_ids` as a list of token ids, or an `InvalidInput` naming the argument and what is wrong with it."""
    if isinstance(input_ids, (str, bytes)):
        raise InvalidInput("input_ids must be a sequence of token ids, got a string: tokenize it first "
                           "(renderer.render_prompt(messages) gives the ids of a chat prompt)")
    try:
        ids = [int(t) for t in input_ids]
    except (TypeError, ValueError):
        raise InvalidInput("input_ids must be a sequence of integer token ids, "
                           f"got {type(input_ids).__name__}") from None
    if not ids:
        raise InvalidInput("input_ids is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidInput(f"input_ids holds {len(bad)} id(s) outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return ids


class TransformersPolicy:
    """A `slime_env.Policy` on a local transformers model (CPU or one GPU). See the module docstring.

    `update_weights(state_dict_or_path, weight_version)` loads new weights in place between batches.
    `usage` accumulates prompt / completion tokens, batches and generation seconds. `prefill_chunk_tokens`: a prompt
    is fed at most that many new tokens per engine step (continuous batching, Llama / Qwen models), so a long one
    never holds the other requests for its whole prefill; None feeds each prompt whole.
    """

    def __init__(self, model: Any, tokenizer: Any, *, max_batch_size: int = 16, batch_window_s: float = 0.005,
                 weight_version: str = "0", seed: int | None = None, batching: str = "continuous",
                 prefix_cache_tokens: int = 32768, paged: bool | None = None,
                 paged_options: Mapping[str, Any] | None = None, return_routed_experts: bool | None = None,
                 prefill_chunk_tokens: int | None = 512):
        if max_batch_size < 1:
            raise InvalidInput(f"max_batch_size must be >= 1, got {max_batch_size}")
        if prefill_chunk_tokens is not None and prefill_chunk_tokens < 1:
            raise InvalidInput(f"prefill_chunk_tokens must be >= 1 (or None: whole prompts), "
                               f"got {prefill_chunk_tokens}")
        if batching not in ("continuous", "static"):
            raise InvalidInput(f"batching must be 'continuous' or 'static', got {batching!r}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.max_batch_size = max_batch_size
        self.batch_window_s = batch_window_s
        self.weight_version = weight_version
        # The model's context (its config's max_position_embeddings): what the gateway refuses prompts past, so one
        # session's oversized prompt cannot hold the engine for minutes
        limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        self.context_length: int | None = int(limit) if isinstance(limit, int) and limit > 0 else None
        # LoRA: the adapter ("name@version") of each weight version an adapter made, and the base copy it merges into
        self.adapters: dict[str, str] = {}
        self._merged = None
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_id = tokenizer.eos_token_id
        self._rng = random.Random(seed)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slime_env-engine")
        self._queue: asyncio.Queue[Request] | None = None
        self._worker: asyncio.Task | None = None
        self._running = asyncio.Event()  # cleared while paused (asyncio binds it to a loop on first use)
        self._running.set()
        self._live: dict[str, Request] = {}
        self._ids = itertools.count()
        self._decode_lock = threading.Lock()
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0, "batches": 0, "requests": 0, "aborted": 0,
                      "generate_s": 0.0, "cached_tokens": 0}
        self.batching = batching
        self._engine = None
        self._until_resumed = False  # memory released until `resume_memory()` (SGLang's contract): admit nothing
        # MoE models: each generated token's routed experts (routing replay), by default
        from slime_env.agents.routing_capture import RoutingCapture, moe_routers

        if return_routed_experts is None:
            return_routed_experts = bool(moe_routers(model))
        self.capture = RoutingCapture(model) if return_routed_experts else None
        self.paged = batching == "continuous" and self.capture is None and \
            (paged_usable(model) if paged is None else paged)
        if batching == "continuous":  # the engine behind this front gets what it needs, passed in
            front = EngineFront(model=self.model, device=self.device, pad_id=self.pad_id, usage=self.usage,
                                version=lambda: self.weight_version, finished=self._finished, sample=sample_rows,
                                capture=self.capture)
        if self.paged:
            from slime_env.agents.paged_engine import PagedEngine

            self._engine = PagedEngine(front, max_batch_size=max_batch_size, **dict(paged_options or {}))
        elif batching == "continuous":
            from slime_env.agents.engine import ContinuousEngine

            self._engine = ContinuousEngine(front, max_batch_size=max_batch_size,
                                            prefix_cache_tokens=prefix_cache_tokens,
                                            prefill_chunk=prefill_chunk_tokens)

    # --- public API ------------------------------------------------------------------------------
    async def generate(self, input_ids: Sequence[int], sampling_params: Mapping[str, Any], *,
                       rid: str | None = None, session: str | None = None) -> Generation:
        """Generate a continuation; `rid` names the request so `abort(rid)` can stop it; `session` (an
        episode's id) lets its next turn reuse the KV of this one's tokens (continuous batching only)."""
        input_ids = _check_ids(input_ids, self.model.config.vocab_size)
        loop = asyncio.get_running_loop()
        if self._engine is not None:
            return await self._generate_continuous(input_ids, sampling_params, rid, session, loop)
        if self._queue is None or self._worker is None or self._worker.done():
            self._queue = asyncio.Queue()
            self._worker = loop.create_task(self._batcher())
        req = self._request(list(input_ids), sampling_params, loop.create_future())
        req.rid = rid or f"req-{next(self._ids)}"
        self._live[req.rid] = req
        t0 = time.perf_counter()
        try:
            await self._queue.put(req)
            await req.future
        finally:
            self._live.pop(req.rid, None)
            if req.future.cancelled():  # the caller went away: stop spending compute on it
                req.aborted = True
        text = self._decode(req.out_ids)
        return Generation(token_ids=tuple(req.out_ids), logprobs=tuple(req.out_logprobs),
                          finish_reason=req.finish or "length", text=text, weight_version=self.weight_version,
                          prompt_tokens=len(req.input_ids), latency_s=time.perf_counter() - t0,
                          adapter=self.adapters.get(self.weight_version), routed_experts=_routed(req))

    async def _generate_continuous(self, input_ids: list[int], sampling_params: Mapping[str, Any], rid: str | None,
                                   session: str | None, loop: asyncio.AbstractEventLoop) -> Generation:
        req = self._request(input_ids, sampling_params, loop.create_future())
        req.rid, req.session, req.loop = rid or f"req-{next(self._ids)}", session, loop
        self._live[req.rid] = req
        self.usage["requests"] += 1
        t0 = time.perf_counter()
        self._engine.submit(req)
        try:
            await req.future
        finally:
            self._live.pop(req.rid, None)
            if req.future.cancelled():  # the caller went away: stop spending compute on it
                req.aborted = True
        self.usage["aborted"] += req.finish == "abort"
        return Generation(token_ids=tuple(req.out_ids), logprobs=tuple(req.out_logprobs),
                          finish_reason=req.finish or "length", text=self._decode(req.out_ids),
                          weight_version=req.weight_version or self.weight_version, prompt_tokens=len(req.input_ids),
                          cached_tokens=req.cached_tokens, latency_s=time.perf_counter() - t0,
                          adapter=self.adapters.get(req.weight_version or self.weight_version),
                          routed_experts=_routed(req))

    def for_episode(self, session_id: str) -> EpisodeSession:
        """A per-episode view: one rid per call, `abort()` stops the live one; with continuous batching the
        session's turns share a prefix cache."""
        if self._engine is not None:
            return EpisodeSession(self, session_id, session=session_id)
        return EpisodeSession(self, session_id)

    def abort(self, rid: str) -> bool:
        """Stop request `rid`: it returns what it generated so far with finish_reason "abort"."""
        req = self._live.get(rid)
        if req is None:
            return False
        req.aborted = True
        return True

    def abort_all(self) -> int:
        for req in list(self._live.values()):
            req.aborted = True
        return len(self._live)

    def pause(self) -> None:
        """Start no new batch (admit no new request) until `resume()`; what runs finishes."""
        self._running.clear()
        if self._engine is not None:
            self._engine.hold(True)

    def resume(self) -> None:
        self._running.set()
        if self._engine is not None:
            self._engine.hold(self._until_resumed)

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    async def update_weights(self, weights: Mapping[str, torch.Tensor] | str | Callable[[], Mapping[str, Any]]
                             | Callable[[], Iterator[Mapping[str, Any]]], weight_version: str, *,
                             partial: bool = False) -> None:
        """Load a state dict (or a saved model folder / safetensors file, or a function returning a state dict or an
        iterator of them, called when the engine is idle: e.g. one receiving tensors over a group) in place, between
        batches. With continuous batching no request is admitted meanwhile, the running ones finish first, and the
        prefix cache (KV of the old weights) is cleared. `partial`: a subset of the parameters (one bucket of an
        update)."""
        loop = asyncio.get_running_loop()

        def load_all() -> None:
            got = weights() if callable(weights) else weights
            for part in got if isinstance(got, Iterator) else [got]:  # parts loaded as they come
                self._load(part, partial)

        if self._engine is None:
            await loop.run_in_executor(self._executor, load_all)
            self.weight_version = str(weight_version)
            return
        engine = self._engine
        engine.hold(True)
        try:
            while not engine.idle():
                await asyncio.sleep(0.005)

            def load() -> None:
                with engine.model_lock:
                    if self.paged:  # weights released (a colocated trainer ran): back first, then written
                        engine.restore_weights()
                    load_all()
                    if self.device.type == "cuda":  # copied on this thread's stream; the engine reads on its own
                        torch.cuda.synchronize(self.device)
                    engine.invalidate()

            await loop.run_in_executor(self._executor, load)
            self.weight_version = str(weight_version)
        finally:
            engine.hold(self.paused or self._until_resumed)

    async def load_adapter(self, adapter: Any, weight_version: str) -> None:
        """Apply a LoRA adapter (`slime_env.agents.lora_adapter.LoRAAdapter`) merged into the weights, as a partial
        weight update between batches (`update_weights`); the tokens generated from then on record weight version
        `weight_version` and adapter "name@weight_version"."""
        from slime_env.agents.lora_adapter import MergedAdapter

        if self._merged is None:
            self._merged = MergedAdapter(self.model)
        merged = self._merged
        self.adapters[str(weight_version)] = f"{adapter.name}@{weight_version}"  # before any request can see it
        await self.update_weights(lambda: merged.merged(adapter), weight_version, partial=True)

    async def score(self, input_ids: Sequence[int]) -> list[float]:
        """log p(input_ids[t] | input_ids[:t]) for t = 1 .. n-1 under the current weights (one prefill, no sampling):
        what SGLang returns as `input_token_logprobs` for `max_new_tokens: 0` — how a teacher scores a student's
        tokens in on-policy distillation."""
        ids = _check_ids(input_ids, self.model.config.vocab_size)
        if self._engine is None:  # the static loop's worker thread is the one that runs torch
            return await asyncio.get_running_loop().run_in_executor(self._executor, sequence_logprobs, self.model, ids)

        def locked() -> list[float]:
            with self._engine.model_lock:
                return sequence_logprobs(self.model, ids)

        return await asyncio.to_thread(locked)

    def flush_cache(self) -> None:
        """Forget every cached prefix (SGLang's `/flush_cache`); running requests are not disturbed."""
        if self._engine is not None:
            with self._engine.model_lock:
                self._engine.prefix.clear()

    def release_memory(self, *, until_resumed: bool = False, weights: bool = True) -> None:
        """Give the paged engine's device memory back (a colocated trainer is about to run): the K/V pool, the CUDA
        graphs and their memory pool, cuBLAS's workspaces and (`weights`) the weights, copied to pinned host memory.
        No request is admitted meanwhile; the running ones finish first. A weight update brings the weights back
        (and writes them); `resume_memory()` brings everything back, the weights with the values they had. Without
        `until_resumed` the next generation resumes by itself (the embedded engine); with it (SGLang's contract,
        serve-engine's) requests wait for `resume_memory()`. Only the paged engine holds such memory; elsewhere a
        no-op."""
        if not self.paged:
            return
        engine = self._engine
        engine.hold(True)
        while not engine.idle():
            time.sleep(0.005)
        engine.release_memory(weights)
        self._until_resumed = until_resumed
        engine.hold(self.paused or until_resumed)

    def resume_memory(self) -> None:
        if self.paged:
            self._engine.resume_memory()
            self._until_resumed = False
            self._engine.hold(self.paused)

    @property
    def memory_released(self) -> bool:
        """The paged engine's memory is released (`release_memory`) and not yet taken back."""
        return self.paged and self._engine.released

    def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
        if self._engine is not None:
            self._engine.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # --- batching --------------------------------------------------------------------------------
    async def _batcher(self) -> None:
        loop = asyncio.get_running_loop()
        queue = self._queue
        assert queue is not None
        while True:
            batch = [await queue.get()]
            await self._running.wait()
            deadline = loop.time() + self.batch_window_s
            while len(batch) < self.max_batch_size:
                timeout = deadline - loop.time()
                if timeout <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(queue.get(), timeout))
                except TimeoutError:
                    break
            for r in batch:
                if r.aborted and not r.future.done():
                    r.finish = "abort"
                    r.future.set_result(None)
            batch = [r for r in batch if not r.future.done()]  # cancelled or aborted before starting
            if not batch:
                continue
            try:
                await loop.run_in_executor(self._executor, self._generate_batch, batch)
            except Exception as e:  # noqa: BLE001 - fail these requests, keep serving others
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(e)
                continue
            for r in batch:
                if not r.future.done():
                    r.future.set_result(None)

    def _request(self, ids: list[int], p: Mapping[str, Any], future: asyncio.Future) -> Request:
        try:
            max_new = int(p.get("max_new_tokens", 128))
            temperature = float(p.get("temperature", 1.0))
            top_p = float(p.get("top_p", 1.0))
            top_k = int(p.get("top_k", -1) or -1)
        except (TypeError, ValueError) as e:
            raise InvalidInput(f"bad sampling_params {dict(p)!r}: {e}") from None
        if max_new < 1 or temperature < 0 or not 0 < top_p <= 1:
            raise InvalidInput(f"sampling_params out of range: max_new_tokens={max_new}, "
                               f"temperature={temperature}, top_p={top_p}")
        stop = p.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        stop_ids = frozenset(p.get("stop_token_ids") or ())
        if self.eos_id is not None and not p.get("ignore_eos"):
            stop_ids |= {self.eos_id}
        seed = p.get("sampling_seed")
        # Drawn from the policy's generator only for sampled requests, as before: greedy ones leave its sequence be.
        seed = check_sampling_seed(seed) if seed is not None else self._rng.getrandbits(63) if temperature > 0 else 0
        gen = None
        if temperature > 0 and not self.paged:  # the paged engine samples from the seed on the device
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
        return Request(ids, max_new, temperature, top_p, top_k, stop, stop_ids, gen, future, seed=seed)

    # --- generation (worker thread) --------------------------------------------------------------
    @torch.inference_mode()
    def _generate_batch(self, batch: list[Request]) -> None:
        t0 = time.perf_counter()
        n = len(batch)
        width = max(len(r.input_ids) for r in batch)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, r in enumerate(batch):  # left padding: every row's next token is at the same column
            ids[i, width - len(r.input_ids):] = torch.tensor(r.input_ids)
            mask[i, width - len(r.input_ids):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1, :].float()
        flat = [i * width + width - 1 for i in range(n)]  # where each row's next token is sampled from
        next_pos = positions[:, -1:] + 1
        steps = max(r.max_new_tokens for r in batch)
        for _ in range(steps):
            tokens = torch.full((n, 1), self.pad_id, dtype=torch.long, device=self.device)
            for r in batch:
                if r.finish is None and r.aborted:
                    r.finish = "abort"
            active = [i for i, r in enumerate(batch) if r.finish is None]
            routed = self.capture.rows([flat[i] for i in active]) if self.capture is not None else None
            for j, (i, (token, logprob)) in enumerate(zip(active, sample_rows([batch[i] for i in active],
                                                                               logits[active]))):
                r = batch[i]
                r.out_ids.append(token)
                r.out_logprobs.append(logprob)
                if routed is not None:
                    r.out_routed.append(routed[j])
                r.finish = self._finished(r)
                tokens[i, 0] = token
            if all(r.finish is not None for r in batch):
                break
            mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=self.device)], dim=1)
            out = self.model(input_ids=tokens, attention_mask=mask, position_ids=next_pos, past_key_values=cache,
                             use_cache=True)
            cache, logits = out.past_key_values, out.logits[:, -1, :].float()
            flat = list(range(n))
            next_pos = next_pos + 1
        self.usage["batches"] += 1
        self.usage["requests"] += n
        self.usage["prompt_tokens"] += sum(len(r.input_ids) for r in batch)
        self.usage["completion_tokens"] += sum(len(r.out_ids) for r in batch)
        self.usage["aborted"] += sum(r.finish == "abort" for r in batch)
        self.usage["generate_s"] += time.perf_counter() - t0

    def _finished(self, r: Request) -> str | None:
        if r.out_ids[-1] in r.stop_token_ids:
            return "stop"
        if r.stop:
            tail = self._decode(r.out_ids[-16:])  # a stop string ends within the last few tokens
            if any(s in tail for s in r.stop):
                return "stop"
        if len(r.out_ids) >= r.max_new_tokens:
            return "length"
        return None

    def _decode(self, ids: Sequence[int]) -> str:
        with self._decode_lock:  # tokenizers' decode is not re-entrant across threads for one object
            return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def _load(self, weights: Mapping[str, torch.Tensor] | str, partial: bool = False) -> None:
        if isinstance(weights, str):
            from pathlib import Path

            from safetensors.torch import load_file

            path = Path(weights)
            files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
            if not files:
                raise InvalidInput(f"no .safetensors weights at {weights}")
            state: dict[str, torch.Tensor] = {}
            for f in files:
                state.update(load_file(str(f)))
            weights = state
        from slime_env.agents.weight_layout import load_state

        try:  # either layout: the model's own, or the engine-bound one (MoE experts one matrix each)
            missing, unexpected = load_state(self.model, weights, partial=partial)
        except RuntimeError as e:  # a shape that differs: another model's weights
            raise InvalidInput(f"weights do not match the model: {e}") from None
        # Tied embeddings are saved once; every other parameter must be present (unless only a part is sent).
        missing = [] if partial else [k for k in missing if k != "lm_head.weight"]
        if missing or unexpected:
            raise InvalidInput(f"weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")


def sample_rows(reqs: list[Request], logits: torch.Tensor) -> list[tuple[int, float]]:
    """Next token and its log-prob for each row: the host-side sampler of the static loop and `ContinuousEngine`.
    Rows sharing sampling params are processed as one tensor; only the draw itself is per row (each request has its
    own seeded generator)."""
    out: list[tuple[int, float] | None] = [None] * len(reqs)
    groups: dict[tuple, list[int]] = {}
    for j, r in enumerate(reqs):
        greedy = r.temperature == 0 or r.top_k == 1
        groups.setdefault((greedy, r.temperature, r.top_p, r.top_k), []).append(j)
    for (greedy, temperature, top_p, top_k), rows in groups.items():
        x = logits[rows]
        if greedy:
            logp = torch.log_softmax(x, dim=-1)
            picks = torch.argmax(x, dim=-1).tolist()
        else:
            x = x / temperature
            if 0 < top_k < x.shape[-1]:
                kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
                x = x.masked_fill(x < kth, float("-inf"))
            if top_p < 1.0:
                sorted_x, order = torch.sort(x, dim=-1, descending=True)
                probs = torch.softmax(sorted_x, dim=-1)
                drop = probs.cumsum(-1) - probs > top_p  # keep the token that crosses top_p
                x = x.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
            logp = torch.log_softmax(x, dim=-1)
            picks = _draw(logp.exp(), [reqs[j].generator for j in rows])
        chosen = logp.gather(-1, torch.tensor(picks, device=logp.device).unsqueeze(-1)).squeeze(-1).tolist()
        for k, j in enumerate(rows):
            out[j] = (picks[k], chosen[k])
    return out  # type: ignore[return-value]


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of `probs` (rows sum to 1, zeros never drawn), each from its own generator's single
    uniform: the row's inverse CDF, all rows in one cumsum and one search. Exact sampling like
    `torch.multinomial`, which costs a pass over the vocabulary per row (~0.8 ms each at 49k tokens on a CPU
    core: a fifth of a 32-row decoding step)."""
    u = torch.cat([torch.rand(1, generator=g, device=probs.device) for g in generators])
    cdf = probs.cumsum(-1)
    # right=True: the first index whose cdf exceeds u*total, so a token of probability 0 (a flat stretch of the
    # cdf) is never the answer, even for u = 0.
    picks = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1).tolist()
    last = probs.shape[-1] - 1
    for k, p in enumerate(picks):
        if p > last:  # u*total rounded up to the total: the last token that can be drawn
            picks[k] = int(torch.nonzero(probs[k])[-1])
    return picks


@torch.inference_mode()
def sequence_logprobs(model: Any, ids: Sequence[int]) -> list[float]:
    """The log-prob of each token of `ids` after the first, given the ones before it, under `model` (one forward)."""
    device = next(model.parameters()).device
    x = torch.tensor([list(ids)], dtype=torch.long, device=device)
    logits = model(input_ids=x, use_cache=False).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None]).squeeze(-1).tolist()


def _routed(req: Request) -> RoutedExperts | None:
    """The request's routed experts (one row per generated token), or None when not captured for all of them."""
    if not req.out_routed or len(req.out_routed) != len(req.out_ids):
        return None
    return RoutedExperts.from_array(torch.stack(req.out_routed))


def paged_usable(model: Any) -> bool:
    """Whether the paged GPU engine (`slime_env.agents.paged_engine`) runs `model`: a Llama / Qwen2 / Qwen3 model on
    CUDA with Triton importable and a power-of-two head dim. Elsewhere continuous batching uses
    `slime_env.agents.engine`."""
    from slime_env.agents import paged_attention
    from slime_env.agents.packed_forward import packable

    device = next(model.parameters()).device
    if not packable(model) or not paged_attention.triton_usable(device) or device.type != "cuda":
        return False
    d = model.model.layers[0].self_attn.head_dim
    return d >= 16 and d & (d - 1) == 0
