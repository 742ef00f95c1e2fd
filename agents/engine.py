"""The continuous-batching loop of `TransformersPolicy`, with a per-session prefix cache.

One worker thread runs steps. Each step admits waiting requests into the running batch (prefilling them:
fresh prompts together, left-padded; a prompt that extends a cached prefix of its session only for the
new tokens), then decodes one token for every live row. A request never waits for others to finish.

The batch is one transformers `DynamicCache` whose rows are left-padded: each row's real tokens sit at
the right end, an attention mask hides the rest, and positions are per row. A finished row is marked
free and reused by the next admission (its KV written into the row); columns no live row needs are
trimmed. When a request ends, the KV of everything fed so far (prompt + generated tokens but the last)
is kept for its session (`session=`), so the next turn of that episode — whose prompt starts with those
tokens — encodes only what is new. The cache is bounded (`prefix_cache_tokens`, least recently used
evicted first) and cleared when the weights change. Exact: the cached KV is what recomputation gives
(up to float rounding), and every prefix is checked token for token before it is reused.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class _Row:
    req: Any            # agents.transformers_policy._Request
    length: int         # tokens of this row in the cache (all fed tokens)
    fed: list[int]      # the ids those tokens are


class PrefixCache:
    """Per-session KV of a finished request's fed tokens, LRU-bounded by total tokens."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self._items: collections.OrderedDict[str, tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]]] = \
            collections.OrderedDict()
        self.tokens = 0
        self.hits = self.misses = self.reused_tokens = 0

    def put(self, session: str, ids: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.drop(session)
        if not ids or len(ids) > self.max_tokens:
            return
        self._items[session] = (ids, kv)
        self.tokens += len(ids)
        while self.tokens > self.max_tokens:
            _, (old, _) = self._items.popitem(last=False)
            self.tokens -= len(old)

    def take(self, session: str | None, ids: list[int]) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]] | None]:
        """The cached KV of the longest stored prefix of `ids` for `session` (it leaves the cache: the request
        now owns it), as (length, kv); (0, None) when there is none."""
        entry = self._items.get(session) if session is not None else None
        if entry is None:
            self.misses += 1
            return 0, None
        cached, kv = entry
        n = len(cached)
        # At least one new token must remain to be fed (it gives the logits of the next one).
        if n >= len(ids) or ids[:n] != cached:
            self.misses += 1
            return 0, None
        self.drop(session)
        self.hits += 1
        self.reused_tokens += n
        return n, kv

    def drop(self, session: str) -> None:
        entry = self._items.pop(session, None)
        if entry is not None:
            self.tokens -= len(entry[0])

    def clear(self) -> None:
        self._items.clear()
        self.tokens = 0


class ContinuousEngine:
    """The loop (see the module docstring). `submit(req)` is called from the event loop; results are
    delivered through `finish(req)` (called on this engine's thread)."""

    def __init__(self, policy: Any, *, max_batch_size: int, prefix_cache_tokens: int, trim_slack: int = 64):
        self.policy = policy
        self.max_batch_size = max_batch_size
        self.prefix = PrefixCache(prefix_cache_tokens)
        self.trim_slack = trim_slack
        self._waiting: collections.deque = collections.deque()
        self._wake = threading.Condition()
        self._closed = False
        self._hold = False  # set while the weights change: no admissions, the running rows finish first
        self.model_lock = threading.Lock()
        self.cache: Any = None
        self.mask: torch.Tensor | None = None
        self.rows: list[_Row | None] = []
        self.steps = 0
        self._thread = threading.Thread(target=self._run, name="slime_env-engine", daemon=True)
        self._thread.start()

    # --- from the event loop ------------------------------------------------------------------------
    def submit(self, req: Any) -> None:
        with self._wake:
            self._waiting.append(req)
            self._wake.notify()

    def hold(self, on: bool) -> None:
        with self._wake:
            self._hold = on
            self._wake.notify()

    def idle(self) -> bool:
        return not any(self.rows)

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()

    # --- the loop -------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._closed and (self._hold or not self._waiting) and not any(self.rows):
                    self._wake.wait()
                if self._closed:
                    pending = list(self._waiting)
                    self._waiting.clear()
                    break
                admit = []
                if not self._hold:
                    free = self.max_batch_size - sum(r is not None for r in self.rows)
                    while self._waiting and len(admit) < free:
                        admit.append(self._waiting.popleft())
            try:
                with self.model_lock, torch.inference_mode():
                    t0 = time.perf_counter()
                    if admit:
                        self._admit(admit)
                    if any(self.rows):
                        self._decode()
                    self.policy.usage["generate_s"] += time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001 - fail what is running, keep serving
                for r in [row.req for row in self.rows if row is not None] + admit:
                    if r.finish is None:
                        r.error = e
                        self.policy._complete(r)
                self.cache, self.mask, self.rows = None, None, []
        for r in pending + [row.req for row in self.rows if row is not None]:
            r.finish = "abort"
            self.policy._complete(r)

    # --- admission: prefill new requests and put them into rows ------------------------------------------
    def _admit(self, reqs: list[Any]) -> None:
        self.policy.usage["batches"] += 1  # an admission wave: requests that joined the batch together
        fresh, extending = [], []
        for r in reqs:
            r.weight_version = self.policy.weight_version  # the weights its tokens come from (no change mid-run)
            if r.aborted:
                r.finish = "abort"
                self.policy._complete(r)
                continue
            n, kv = self.prefix.take(r.session, r.input_ids)
            (extending if kv is not None else fresh).append((r, n, kv))
        if fresh:
            self._prefill_fresh([r for r, _, _ in fresh])
        for r, n, kv in extending:
            self._prefill_extending(r, n, kv)

    def _prefill_fresh(self, reqs: list[Any]) -> None:
        model, device = self.policy.model, self.policy.device
        width = max(len(r.input_ids) for r in reqs)
        ids = torch.full((len(reqs), width), self.policy.pad_id, dtype=torch.long)
        mask = torch.zeros((len(reqs), width), dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, width - len(r.input_ids):] = torch.tensor(r.input_ids)
            mask[i, width - len(r.input_ids):] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        kv = _layers(out.past_key_values)
        logits = out.logits[:, -1, :].float()
        self.policy.usage["prompt_tokens"] += sum(len(r.input_ids) for r in reqs)
        for i, r in enumerate(reqs):
            n = len(r.input_ids)
            row_kv = [(k[i:i + 1, :, width - n:], v[i:i + 1, :, width - n:]) for k, v in kv]
            self._start_row(r, list(r.input_ids), row_kv, logits[i:i + 1])

    def _prefill_extending(self, r: Any, cached: int, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        from transformers import DynamicCache

        model, device = self.policy.model, self.policy.device
        new = r.input_ids[cached:]
        cache = DynamicCache()
        for layer, (k, v) in enumerate(kv):
            cache.update(k, v, layer)
        ids = torch.tensor([new], dtype=torch.long, device=device)
        mask = torch.ones((1, cached + len(new)), dtype=torch.long, device=device)
        positions = torch.arange(cached, cached + len(new), device=device).unsqueeze(0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
        r.cached_tokens = cached
        self.policy.usage["prompt_tokens"] += len(new)
        self.policy.usage["cached_tokens"] += cached
        self._start_row(r, list(r.input_ids), _layers(out.past_key_values), out.logits[:, -1, :].float())

    def _start_row(self, r: Any, fed: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]],
                   logits: torch.Tensor) -> None:
        """Sample the first token; if the request goes on, write its KV into a free row of the batch."""
        token, logprob = self.policy._sample([r], logits)[0]
        r.out_ids.append(token)
        r.out_logprobs.append(logprob)
        r.finish = self.policy._finished(r) or ("abort" if r.aborted else None)
        if r.finish is not None:
            self._retire(r, fed, kv)
            return
        self._place(_Row(r, len(fed), fed), kv)

    def _place(self, row: _Row, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        n = row.length
        if self.cache is None:
            self.cache = [[k.clone(), v.clone()] for k, v in kv]
            self.mask = torch.ones((1, n), dtype=torch.long, device=kv[0][0].device)
            self.rows = [row]
            return
        width = self.mask.shape[1]
        if n > width:  # the batch grows to the left for a longer row
            self._pad_left(n - width)
            width = n
        try:
            slot = self.rows.index(None)
        except ValueError:
            slot = len(self.rows)
            self.rows.append(None)
            self.mask = torch.cat([self.mask, self.mask.new_zeros((1, width))], 0)
            for layer in self.cache:
                for j in (0, 1):
                    t = layer[j]
                    layer[j] = torch.cat([t, t.new_zeros((1, *t.shape[1:]))], 0)
        for layer, (k, v) in zip(self.cache, kv):
            layer[0][slot].zero_()
            layer[1][slot].zero_()
            layer[0][slot, :, width - n:] = k[0]
            layer[1][slot, :, width - n:] = v[0]
        self.mask[slot].zero_()
        self.mask[slot, width - n:] = 1
        self.rows[slot] = row

    def _pad_left(self, cols: int) -> None:
        self.mask = torch.cat([self.mask.new_zeros((self.mask.shape[0], cols)), self.mask], 1)
        for layer in self.cache:
            for j in (0, 1):
                t = layer[j]
                layer[j] = torch.cat([t.new_zeros((t.shape[0], t.shape[1], cols, t.shape[3])), t], 2)

    # --- one decode step for every live row --------------------------------------------------------------
    def _decode(self) -> None:
        from transformers import DynamicCache

        model, device = self.policy.model, self.policy.device
        live = [i for i, row in enumerate(self.rows) if row is not None]
        for i in live:
            if self.rows[i].req.aborted:
                self.rows[i].req.finish = "abort"
        for i in live:
            if self.rows[i].req.finish is not None:
                self._free(i)
        live = [i for i, row in enumerate(self.rows) if row is not None]
        if not live:
            return
        self._trim()
        batch = len(self.rows)
        tokens = torch.full((batch, 1), self.policy.pad_id, dtype=torch.long)
        positions = torch.zeros((batch, 1), dtype=torch.long)
        for i in live:
            row = self.rows[i]
            tokens[i, 0] = row.req.out_ids[-1]
            positions[i, 0] = row.length
        mask = torch.cat([self.mask, self.mask.new_zeros((batch, 1))], 1)
        mask[live, -1] = 1
        cache = DynamicCache()
        for layer, (k, v) in enumerate(self.cache):
            cache.update(k, v, layer)
        out = model(input_ids=tokens.to(device), attention_mask=mask, position_ids=positions.to(device),
                    past_key_values=cache, use_cache=True)
        self.cache = [list(kv) for kv in _layers(out.past_key_values)]
        self.mask = mask
        self.steps += 1
        logits = out.logits[:, -1, :].float()
        picks = self.policy._sample([self.rows[i].req for i in live], logits[live])
        for i, (token, logprob) in zip(live, picks):
            row = self.rows[i]
            row.fed.append(row.req.out_ids[-1])
            row.length += 1
            r = row.req
            r.out_ids.append(token)
            r.out_logprobs.append(logprob)
            r.finish = self.policy._finished(r)
            if r.finish is not None:
                self._free(i)

    def _free(self, i: int) -> None:
        row = self.rows[i]
        width = self.mask.shape[1]
        kv = [(k[i:i + 1, :, width - row.length:], v[i:i + 1, :, width - row.length:]) for k, v in self.cache]
        self.rows[i] = None
        self.mask[i].zero_()
        self._retire(row.req, row.fed, kv)
        if not any(self.rows):
            self.cache, self.mask, self.rows = None, None, []

    def _retire(self, r: Any, fed: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if r.session is not None and r.finish != "abort":
            self.prefix.put(r.session, list(fed), [(k.clone(), v.clone()) for k, v in kv])
        self.policy.usage["completion_tokens"] += len(r.out_ids)
        self.policy._complete(r)

    def _trim(self) -> None:
        """Drop leading columns no live row uses, and trailing free rows."""
        while self.rows and self.rows[-1] is None:
            self.rows.pop()
            self.mask = self.mask[:-1]
            for layer in self.cache:
                layer[0], layer[1] = layer[0][:-1], layer[1][:-1]
        longest = max(row.length for row in self.rows if row is not None)
        extra = self.mask.shape[1] - longest
        if extra > self.trim_slack:
            self.mask = self.mask[:, extra:].contiguous()
            for layer in self.cache:
                layer[0], layer[1] = layer[0][:, :, extra:].contiguous(), layer[1][:, :, extra:].contiguous()


def _layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer of a transformers cache (5.x `layers`, or the legacy tuple form)."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return [(k, v) for k, v in cache]
