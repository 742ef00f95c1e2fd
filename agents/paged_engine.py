"""`PagedEngine`: the GPU path of `TransformersPolicy`'s continuous batching — paged K/V, CUDA graphs, GPU sampling.

One thread runs steps. A step is either
- a **decode step**: every running sequence feeds its last sampled token — fixed shapes, replayed from a CUDA
  graph captured for that batch size; or
- a **mixed step** (eager): the running sequences' decode tokens plus the new tokens of sequences joining the
  batch, packed into one forward. Joining sequences first take what the block pool already holds for them
  (`slime_env.agents.kv_blocks`: the earlier turns of their episode, the prompt their GRPO group shares), so a resumed
  turn computes only its new tokens. A prompt longer than the step's token budget is prefilled over several steps.

Every step ends with one batched draw on the GPU (`slime_env.agents.sampler`) and one copy of (token, log-prob) per row
to the host. K/V blocks are allocated as sequences grow; when the pool runs out, the most recently admitted sequence
is preempted — its blocks released (its full ones stay cached and are usually matched again), its tokens kept —
and resumed later by recomputation. Requests, stop rules and results are `TransformersPolicy`'s (passed in as an
`EngineFront`; the thread is `slime_env.agents.worker.EngineWorker`'s): this class only replaces
`slime_env.agents.engine.ContinuousEngine` for Llama / Qwen2 / Qwen3 models on CUDA (`slime_env.agents.model_runner`).
"""

from __future__ import annotations

import bisect
import collections
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from slime_env.agents.kv_blocks import BlockPool, chain_digest
from slime_env.agents.model_runner import ModelRunner, Step, pool_blocks
from slime_env.agents.paged_attention import triton_usable
from slime_env.agents.sampler import SamplingBatch, sample
from slime_env.agents.worker import EngineFront, EngineWorker


@dataclass(eq=False)  # identity: `list.remove(seq)` must not compare token lists field by field
class _Seq:
    req: Any                 # its request (slime_env.agents.worker.Request)
    ids: list[int]           # prompt + generated tokens; the K/V of ids[:computed] is in `blocks`
    order: int               # admission order (the youngest is preempted first)
    blocks: list[int] = field(default_factory=list)
    digests: list[bytes] = field(default_factory=list)  # of the first len(digests) full blocks
    computed: int = 0
    row: int = -1            # its block-table row while it runs
    cached: int = 0          # tokens taken from the prefix cache when it was (last) admitted
    started: bool = False    # its request has been claimed (weight version set, counted)


class PagedEngine(EngineWorker):
    """See the module docstring. An `EngineWorker`: `submit(req)` from the event loop; requests are `resolve()`d from
    its thread.

    `block_size` tokens per K/V block; the pool takes `kv_memory_fraction` of the free device memory (or
    `max_kv_tokens`); `max_step_tokens` bounds the tokens of one mixed step; `max_model_len` bounds a sequence
    (default: the model's `max_position_embeddings`); `cuda_graphs` replays decode steps from CUDA graphs.
    """

    def __init__(self, front: EngineFront, *, max_batch_size: int, block_size: int = 16,
                 kv_memory_fraction: float = 0.4, max_kv_tokens: int | None = None, max_step_tokens: int = 8192,
                 max_model_len: int | None = None, cuda_graphs: bool = True, use_triton: bool | None = None):
        if not 0 < kv_memory_fraction < 1:
            raise ValueError(f"kv_memory_fraction must be in (0, 1), got {kv_memory_fraction}")
        super().__init__(front, name="slime_env-paged-engine")
        model = front.model
        self.max_batch_size = max_batch_size
        self.block_size = block_size
        self.max_step_tokens = max(max_step_tokens, max_batch_size + 1)
        self.max_model_len = int(max_model_len or getattr(model.config, "max_position_embeddings", 4096))
        device = front.device
        self.use_triton = triton_usable(device) if use_triton is None else use_triton
        # Without a bound the pool is a fraction of free memory, but never more than every row at full length
        # (millions of blocks of a small model would only cost host-side bookkeeping).
        cap = max_kv_tokens if max_kv_tokens is not None else max_batch_size * self.max_model_len
        self._pool_args = {"block_size": block_size, "dtype": next(model.parameters()).dtype, "device": device,
                           "memory_fraction": kv_memory_fraction, "max_tokens": cap, "min_tokens": self.max_model_len}
        num_blocks = pool_blocks(model, **self._pool_args)
        self.prefix = BlockPool(num_blocks, block_size)
        self.runner = ModelRunner(model, num_blocks=num_blocks, block_size=block_size, max_rows=max_batch_size,
                                  max_model_len=self.max_model_len, max_step_tokens=self.max_step_tokens,
                                  graphs=cuda_graphs, use_triton=self.use_triton)
        self._queue: collections.deque[_Seq] = collections.deque()  # waiting here: new and preempted sequences
        self._running: list[_Seq] = []
        self._free_rows = list(range(max_batch_size - 1, -1, -1))
        self._released = False
        self._order = 0
        self.steps = self.decode_steps = self.mixed_steps = self.preemptions = 0
        self.decode_rows = self.decode_ctx = 0  # decoding rows and their context lengths, summed over steps
        # The engine's kernels go to a stream of its own: a trainer in another thread of this process (asynchronous
        # training) then runs beside it on the GPU instead of queueing behind it on the shared default stream.
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.start()

    # --- from the event loop ------------------------------------------------------------------------------
    def submit(self, req: Any) -> None:
        limit = self.max_model_len
        if len(req.input_ids) + 1 > limit:
            req.error = ValueError(f"input_ids has {len(req.input_ids)} tokens; the engine's max_model_len is "
                                   f"{limit}")
            req.resolve()
            return
        super().submit(req)

    def release_memory(self, weights: bool = True) -> None:
        """Free the device memory: the K/V pool, the CUDA graphs and their pool, cuBLAS's workspaces and (`weights`)
        the weights, moved to host memory (call while idle and held, e.g. around a colocated training step). The next
        step, a weight load (`restore_weights`) or `resume_memory` brings it back."""
        with self.model_lock:
            self.prefix.clear()
            if self._stream is not None:
                self._stream.synchronize()  # nothing of the engine's may still read the pool it frees
            self.runner.release(weights)
            self._released = True

    def resume_memory(self) -> None:
        with self.model_lock:
            if self._released:
                self.runner.resume()
                self._released = False
                if self._stream is not None:  # made on the caller's stream: done before the engine's reads it
                    torch.cuda.synchronize(self._stream.device)

    def restore_weights(self) -> None:
        """The released weights back on the device, the pool still released (call holding `model_lock`: a weight
        update writes into them next)."""
        self.runner.restore_weights()

    @property
    def released(self) -> bool:
        return self._released

    def invalidate(self) -> None:
        """New weights: no cached K/V is valid (call while idle, holding `model_lock`)."""
        self.prefix.clear()

    # --- the worker's loop: what there is to do, one step ----------------------------------------------------
    @contextlib.contextmanager
    def _thread_context(self) -> Iterator[None]:
        if self._stream is None:
            yield
            return
        torch.cuda.synchronize(self._stream.device)  # the pool and weights were made on the default stream
        with torch.cuda.stream(self._stream):
            yield

    def _busy(self) -> bool:
        return bool(self._running)

    def _pending(self) -> bool:
        return bool(self._waiting or self._queue)

    def _take(self, hold: bool) -> bool:
        while self._waiting:
            self._queue.append(self._new_seq(self._waiting.popleft()))
        return not hold  # whether this step admits

    def _step(self, admit: bool) -> None:
        if self._released:
            self.runner.resume()
            self._released = False
        self._schedule_and_run(admit)

    def _fail(self, error: Exception, admit: bool) -> None:
        for seq in self._running:
            seq.req.error = error
            seq.req.resolve()
            self._drop(seq)
        self._running = []

    def _drain(self) -> list[Any]:
        left = [s.req for s in self._queue] + list(self._waiting) + [s.req for s in self._running]
        self._queue.clear()
        self._waiting.clear()
        return left

    def _new_seq(self, req: Any) -> _Seq:
        self._order += 1
        return _Seq(req, list(req.input_ids), self._order)

    def _schedule_and_run(self, admit: bool) -> None:
        bs = self.block_size
        pool = self.prefix
        # Aborted requests leave (running or waiting).
        for seq in [s for s in self._running if s.req.aborted]:
            self._finish(seq, "abort")
        for seq in [s for s in self._queue if s.req.aborted]:
            self._queue.remove(seq)
            self._abort_waiting(seq)
        # The running sequences, oldest first: each gets room for its next token (decoding) or its next chunk
        # (a prefill longer than one step), younger ones preempted when the pool is short -- so the oldest always
        # progresses and nothing already scheduled this step is taken back.
        n_dec = sum(1 for s in self._running if s.computed == len(s.ids) - 1)
        budget = self.max_step_tokens - n_dec
        decoding: list[_Seq] = []
        chunks: list[tuple[_Seq, int]] = []
        for s in list(self._running):  # kept in admission order
            if s.row < 0:
                continue  # preempted for an older one
            if s.computed == len(s.ids) - 1:
                if s.computed < len(s.blocks) * bs or self._room(s, 1):
                    decoding.append(s)
            elif budget > 0:
                n = min(len(s.ids) - s.computed, budget)
                if self._room(s, n):
                    chunks.append((s, n))
                    budget -= n
        # Then waiting sequences (new or preempted), first come first served, while budget, rows and blocks last.
        # A waiting sequence holds no block: it takes the cached ones it matches only when it is admitted.
        joined = False
        while admit and self._queue and budget > 0 and self._free_rows:
            s = self._queue[0]
            s.blocks, s.digests = pool.match(s.ids, limit=(len(s.ids) - 1) // bs)
            s.computed = s.cached = len(s.blocks) * bs
            n = min(len(s.ids) - s.computed, budget)
            if not self._reserve(s, n):
                self._release(s)
                if not self._running:
                    self._queue.popleft()
                    s.req.error = ValueError(f"a sequence of {len(s.ids)} tokens does not fit in the K/V pool "
                                             f"({pool.num_blocks - 1} blocks of {bs}); give the engine more "
                                             "memory (kv_memory_fraction / max_kv_tokens)")
                    s.req.resolve()
                break
            self._queue.popleft()
            s.row = self._free_rows.pop()
            self.runner.tables[s.row, :len(s.blocks)] = s.blocks
            bisect.insort(self._running, s, key=lambda o: o.order)  # a preempted one goes back to its place
            if not s.started:
                s.started = True
                s.req.weight_version = self.front.version()  # the weights its tokens come from
                joined = True
            chunks.append((s, n))
            budget -= n
        if not decoding and not chunks:
            return
        if joined:
            self.front.usage["batches"] += 1  # an admission wave: requests that joined the batch together
        self._sync_tables()
        step, sampled = self._build(decoding, chunks)
        logits = self.runner.run(step)
        if chunks:
            self.mixed_steps += 1
        else:
            self.decode_steps += 1
        self.steps += 1
        self.decode_rows += len(decoding)
        self.decode_ctx += sum(s.computed + 1 for s in decoding)
        picks = self._sample(sampled, logits) if sampled else []
        for s in decoding:
            s.computed += 1
            self._name_full_blocks(s)
        for s, n in chunks:
            s.computed += n
            self._name_full_blocks(s)
        for s, (token, logprob) in zip(sampled, picks):
            r = s.req
            if not r.out_ids:  # its prompt is done: this is its first generated token
                r.cached_tokens = s.cached
                self.front.usage["prompt_tokens"] += len(s.ids) - s.cached
                self.front.usage["cached_tokens"] += s.cached
            s.ids.append(token)
            r.out_ids.append(token)
            r.out_logprobs.append(logprob)
            finish = self.front.finished(r) or ("abort" if r.aborted else None)
            if finish is None and len(s.ids) >= self.max_model_len:
                finish = "length"  # no position left for another token
            if finish is not None:
                self._finish(s, finish)

    # --- steps ----------------------------------------------------------------------------------------------
    def _build(self, decoding: list[_Seq], chunks: list[tuple[_Seq, int]]) -> tuple[Step, list[_Seq]]:
        """The step's packed inputs (decoding tokens first) and the sequences whose next token it samples."""
        bs = self.block_size
        ids = [s.ids[-1] for s in decoding]
        positions = [s.computed for s in decoding]
        slots = [s.blocks[p // bs] * bs + p % bs for s, p in zip(decoding, positions)]
        step = Step(ids, positions, slots, [p + 1 for p in positions], [s.row for s in decoding], [], [], [], [],
                    list(range(len(decoding))))
        sampled = list(decoding)
        for s, n in chunks:
            a = s.computed
            pos = np.arange(a, a + n)
            step.q_start.append(len(step.ids))
            step.q_len.append(n)
            step.ctx_len.append(a + n)
            step.rows.append(s.row)
            ids.extend(s.ids[a:a + n])
            positions.extend(pos.tolist())
            slots.extend((np.asarray(s.blocks)[pos // bs] * bs + pos % bs).tolist())
            if a + n == len(s.ids):  # the prompt is complete: its last token's logits give the next token
                step.last.append(len(ids) - 1)
                sampled.append(s)
        return step, sampled

    def _sample(self, seqs: list[_Seq], logits: torch.Tensor) -> list[tuple[int, float]]:
        params = SamplingBatch.build([(s.req.temperature, s.req.top_p, s.req.top_k, s.req.seed, len(s.req.out_ids))
                                      for s in seqs], logits.device)
        tokens, logprobs = sample(logits, params)
        both = torch.stack([tokens.double(), logprobs.double()]).cpu()  # one copy to the host per step
        return list(zip(map(int, both[0].tolist()), both[1].tolist()))

    # --- blocks -----------------------------------------------------------------------------------------------
    def _grow(self, s: _Seq, n: int) -> None:
        new = self.prefix.allocate(n)
        if s.row >= 0:
            self.runner.tables[s.row, len(s.blocks):len(s.blocks) + n] = new
        s.blocks.extend(new)

    def _reserve(self, s: _Seq, tokens: int) -> bool:
        """Blocks for `tokens` more of `s`'s tokens, if the pool has them."""
        need = self.prefix.blocks_for(s.computed + tokens) - len(s.blocks)
        if need <= 0:
            return True
        if need > self.prefix.num_free():
            return False
        self._grow(s, need)
        return True

    def _room(self, s: _Seq, tokens: int) -> bool:
        """Blocks for `tokens` more of running `s`'s tokens, preempting younger running sequences if needed;
        False (and `s` preempted) when even that is not enough."""
        while not self._reserve(s, tokens):
            younger = [o for o in self._running if o.order > s.order]
            self._preempt(max(younger, key=lambda o: o.order) if younger else s)
            if not younger:
                return False
        return True

    def _name_full_blocks(self, s: _Seq) -> None:
        bs = self.block_size
        for j in range(len(s.digests), s.computed // bs):
            d = chain_digest(s.digests[-1] if s.digests else b"", s.ids[j * bs:(j + 1) * bs])
            self.prefix.register(s.blocks[j], d)
            s.digests.append(d)

    def _sync_tables(self) -> None:
        self.runner.upload_tables(max(s.row for s in self._running) + 1)

    def _release(self, s: _Seq) -> None:
        self.prefix.release(s.blocks)
        s.blocks, s.digests, s.computed = [], [], 0

    def _drop(self, s: _Seq) -> None:
        if s.row >= 0:
            self._free_rows.append(s.row)
            s.row = -1
        self._release(s)

    def _preempt(self, s: _Seq) -> None:
        """Give `s`'s blocks back and queue it first; it resumes by recomputing (its full blocks stay cached)."""
        self._running.remove(s)
        self._drop(s)
        self._queue.appendleft(s)
        self.preemptions += 1

    def _finish(self, s: _Seq, finish: str) -> None:
        s.req.finish = finish
        self._running.remove(s)
        self._drop(s)
        self.front.usage["completion_tokens"] += len(s.req.out_ids)
        s.req.resolve()

    def _abort_waiting(self, s: _Seq) -> None:
        s.req.finish = "abort"
        self._release(s)
        s.req.resolve()
