"""The continuous-batching loop of `TransformersPolicy`, with a per-session prefix cache.

One worker thread runs steps (`slime_env.agents.worker.EngineWorker`). Each step admits waiting requests into the
running batch and decodes one token for every live row; a request never waits for others to finish. For Llama / Qwen2 /
Qwen3 models that is one packed forward (`slime_env.agents.packed_forward`): the live rows' next tokens and the admitted
requests' new tokens (a prompt that extends a cached prefix of its session: only what is new) together. Other models
take two passes: a prefill of the admitted requests (fresh prompts together, left-padded; extensions of cached
prefixes together), then the decoding pass through the model's own forward.

The batch is one transformers `DynamicCache` whose rows are left-padded: each row's real tokens sit at
the right end, an attention mask hides the rest, and positions are per row. A finished row is marked
free and reused by the next admission (its KV written into the row); columns no live row needs are
trimmed. When a request ends, the KV of everything fed so far (prompt + generated tokens but the last)
is kept for its session (`session=`), so the next turn of that episode — whose prompt starts with those
tokens — encodes only what is new. The cache is bounded (`prefix_cache_tokens`, least recently used
evicted first) and cleared when the weights change. Exact: the cached KV is what recomputation gives
(up to float rounding), and every prefix is checked token for token before it is reused.

A prompt longer than `prefill_chunk` new tokens (packed path) is fed `prefill_chunk` tokens per step: between its
chunks its K/V waits outside the batch and the other rows go on decoding, so one long prompt holds each step for
one chunk's time, not the whole prompt's (an 8k-token prompt stalled every other session for a minute on CPU).
"""

from __future__ import annotations

import collections
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from slime_env.agents import packed_forward
from slime_env.agents.worker import EngineFront, EngineWorker, Request

GROW = 256  # columns of room the batch's K/V buffers get when they are (re)allocated


@dataclass
class _Row:
    req: Request        # its request (slime_env.agents.worker)
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


class ContinuousEngine(EngineWorker):
    """The loop (see the module docstring) on an `EngineWorker` thread; requests are submitted from the event loop
    and `resolve()`d from this thread."""

    def __init__(self, front: EngineFront, *, max_batch_size: int, prefix_cache_tokens: int, trim_slack: int = 64,
                 packed: bool | None = None, prefill_chunk: int | None = 512):
        super().__init__(front, name="slime_env-engine")
        self.max_batch_size = max_batch_size
        self.prefill_chunk = prefill_chunk
        # requests part-way through a chunked prefill: (request, tokens fed, their K/V), in admission order
        self._prefilling: list[tuple[Any, int, list[tuple[torch.Tensor, torch.Tensor]]]] = []
        self.prefix = PrefixCache(prefix_cache_tokens)
        self.trim_slack = trim_slack
        self.kb: list[torch.Tensor] | None = None  # per layer: keys of the batch (rows, heads, capacity, dim)
        self.vb: list[torch.Tensor] | None = None
        self.width = 0  # columns in use (the same for every row: rows are left-padded)
        self.mask: torch.Tensor | None = None
        self.rows: list[_Row | None] = []
        self.steps = 0
        # Llama / Qwen2 / Qwen3 run as one packed forward per step (slime_env.agents.packed_forward); other models as a
        # prefill pass per admission wave plus a decoding pass through the model's own forward.
        self.packed = packed_forward.packable(front.model) if packed is None else packed
        if front.capture is not None:  # routing capture hooks the model's own MoE layers: the two-pass path
            self.packed = False
        # A two-pass prefill needs the logits of each row's last position only: the LM head over every prompt
        # token was a third of a resumed turn's prefill (models without the argument compute them all).
        keeps = "logits_to_keep" in inspect.signature(front.model.forward).parameters
        self._last_only = {"logits_to_keep": 1} if keeps else {}
        self.start()

    def invalidate(self) -> None:
        """New weights: the cached prefixes' K/V is stale (called while idle, holding `model_lock`)."""
        self.prefix.clear()

    # --- the worker's loop: what there is to do, one step --------------------------------------------------------
    def _busy(self) -> bool:
        return any(self.rows) or bool(self._prefilling)

    def _take(self, hold: bool) -> list[Any]:
        admit = []
        if not hold:
            free = self.max_batch_size - sum(r is not None for r in self.rows) - len(self._prefilling)
            while self._waiting and len(admit) < free:
                admit.append(self._waiting.popleft())
        return admit

    def _step(self, admit: list[Any]) -> None:
        if self.packed:
            self._packed_step(admit)
            return
        if admit:
            self._admit(admit)
        if any(self.rows):
            self._decode()

    def _fail(self, error: Exception, admit: list[Any]) -> None:
        parked = [r for r, _, _ in self._prefilling]
        self._prefilling = []
        for r in [row.req for row in self.rows if row is not None] + parked + admit:
            if not r.future.done():
                r.error = error
                r.resolve()
        self.kb = self.vb = self.mask = None
        self.rows, self.width = [], 0

    def _drain(self) -> list[Any]:
        left = list(self._waiting) + [row.req for row in self.rows if row is not None] + \
            [r for r, _, _ in self._prefilling]
        self._waiting.clear()
        self._prefilling = []
        return left

    def _claim(self, reqs: list[Any]) -> list[tuple[Any, int, list | None]]:
        """The admitted requests that still run, each with its session's cached prefix taken out of the cache:
        (request, cached length, cached K/V or None). Those aborted while waiting end here."""
        claimed = []
        for r in reqs:
            r.weight_version = self.front.version()  # the weights its tokens come from (no change mid-run)
            if r.aborted:
                r.finish = "abort"
                r.resolve()
                continue
            n, kv = self.prefix.take(r.session, r.input_ids)
            r.cached_tokens = n
            self.front.usage["cached_tokens"] += n
            claimed.append((r, n, kv))
        return claimed

    # --- the packed step: decoding rows and joining rows in one forward (Llama / Qwen2 / Qwen3) -----------
    def _packed_step(self, reqs: list[Any]) -> None:
        """One forward: every live row's next token and every admitted request's new tokens (its cached
        prefix written into its row first), then one token sampled for each."""
        parked, self._prefilling = self._prefilling, []
        for r, _, _ in parked:
            if r.aborted:
                r.finish = "abort"
                r.resolve()
        joining = [(r, n, kv) for r, n, kv in parked if not r.aborted] + self._claim(reqs)
        live = self._drop_finished()
        if not live and not joining:
            return
        if len(joining) > len(parked):
            self.front.usage["batches"] += 1  # an admission wave: requests that joined the batch together
        if live:
            self._trim()
        # how far each joining request is fed this step: at most one chunk of new tokens
        ends = [len(r.input_ids) if not self.prefill_chunk else min(len(r.input_ids), n + self.prefill_chunk)
                for r, n, _ in joining]
        grow = 1 if live else 0  # a decoding row adds one column; joining rows end where they do
        need = max(ends, default=0)
        if self.kb is None:
            self._allocate(need)
        elif need > self.width + grow:  # the batch grows to the left for a longer row
            self._relayout(left=need - self.width - grow)
        if self.width + grow > self.kb[0].shape[2]:
            self._relayout()
        width = self.width + grow
        slots = []
        for (r, _, _), end in zip(joining, ends):
            try:
                slot = self.rows.index(None)
            except ValueError:
                slot = len(self.rows)
                self.rows.append(None)
            self.rows[slot] = _Row(r, end, list(r.input_ids[:end]))
            slots.append(slot)
        self._ensure_rows(len(self.rows))
        mask = self.mask.new_zeros((len(self.rows), width))
        mask[:self.mask.shape[0], :self.width] = self.mask
        mask[live, width - 1] = 1
        for slot, (r, n, kv), end in zip(slots, joining, ends):
            first = width - end
            mask[slot, :first] = 0
            mask[slot, first:] = 1
            for kbuf, vbuf, (k, v) in zip(self.kb, self.vb, kv or ()):
                kbuf[slot, :, first:first + n] = k[0]
                vbuf[slot, :, first:first + n] = v[0]
        p = packed_forward.plan(device=mask.device, rows=len(self.rows), width=width, row_mask=mask,
                                decoding=[(i, self.rows[i].req.out_ids[-1], self.rows[i].length) for i in live],
                                joining=[(s, r.input_ids[n:end], n) for s, (r, n, _), end in zip(slots, joining, ends)])
        logits = packed_forward.forward(self.front.model, p, self.kb, self.vb)
        self.width, self.mask = width, mask
        self.steps += 1
        # a request whose prompt is not all fed yet samples nothing: its K/V waits for the next step
        done = [end == len(r.input_ids) for (r, _, _), end in zip(joining, ends)]
        for slot, (r, n, _), end, d in zip(slots, joining, ends, done):
            if not d:
                self.front.usage["prompt_tokens"] += end - n
                self._park(slot)
        keep = list(range(len(live))) + [len(live) + j for j, d in enumerate(done) if d]
        joining, slots = [j for j, d in zip(joining, done) if d], [s for s, d in zip(slots, done) if d]
        if not keep:
            return
        picks = self.front.sample([self.rows[i].req for i in live] + [r for r, _, _ in joining],
                                  logits if len(keep) == logits.shape[0] else logits[keep])
        for i, (token, logprob) in zip(live, picks):
            row = self.rows[i]
            row.fed.append(row.req.out_ids[-1])
            row.length += 1
            row.req.out_ids.append(token)
            row.req.out_logprobs.append(logprob)
            row.req.finish = self.front.finished(row.req)
        for (r, n, _), (token, logprob) in zip(joining, picks[len(live):]):
            self.front.usage["prompt_tokens"] += len(r.input_ids) - n
            r.out_ids.append(token)
            r.out_logprobs.append(logprob)
            r.finish = self.front.finished(r) or ("abort" if r.aborted else None)
        for i in live + slots:
            row = self.rows[i] if i < len(self.rows) else None
            if row is not None and row.req.finish is not None:
                self._free(i)

    def _park(self, i: int) -> None:
        """Take row `i` (a request part-way through its prefill) out of the batch; its K/V waits in `_prefilling`."""
        row, width = self.rows[i], self.width
        kv = [(kb[i:i + 1, :, width - row.length:width].clone(), vb[i:i + 1, :, width - row.length:width].clone())
              for kb, vb in zip(self.kb, self.vb)]
        self.rows[i] = None
        self.mask[i].zero_()
        self._prefilling.append((row.req, row.length, kv))
        if not any(self.rows):
            self.kb = self.vb = self.mask = None
            self.rows, self.width = [], 0

    def _allocate(self, width: int) -> None:
        """Empty K/V buffers: one row (`_ensure_rows` adds more), `width` columns in use, room to grow."""
        attn = self.front.model.model.layers[0].self_attn
        w = attn.k_proj.weight
        shape = (1, w.shape[0] // attn.head_dim, width + GROW, attn.head_dim)
        layers = len(self.front.model.model.layers)
        self.kb = [w.new_zeros(shape) for _ in range(layers)]
        self.vb = [w.new_zeros(shape) for _ in range(layers)]
        self.width, self.rows = width, []
        self.mask = torch.zeros((0, width), dtype=torch.long, device=w.device)

    # --- admission: prefill new requests and put them into rows ------------------------------------------
    def _admit(self, reqs: list[Any]) -> None:
        self.front.usage["batches"] += 1  # an admission wave: requests that joined the batch together
        fresh, extending = [], []
        for r, n, kv in self._claim(reqs):
            if kv is None:
                fresh.append(r)
            else:
                extending.append((r, n, kv))
        if fresh:
            self._prefill_fresh(fresh)
        if extending:
            self._prefill_extending(extending)

    def _prefill_fresh(self, reqs: list[Any]) -> None:
        model, device = self.front.model, self.front.device
        width = max(len(r.input_ids) for r in reqs)
        ids = torch.full((len(reqs), width), self.front.pad_id, dtype=torch.long)
        mask = torch.zeros((len(reqs), width), dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, width - len(r.input_ids):] = torch.tensor(r.input_ids)
            mask[i, width - len(r.input_ids):] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **self._last_only)
        kv = _layers(out.past_key_values)
        logits = out.logits[:, -1, :].float()
        routed = self._routed([i * width + width - 1 for i in range(len(reqs))])
        self.front.usage["prompt_tokens"] += sum(len(r.input_ids) for r in reqs)
        for i, r in enumerate(reqs):
            n = len(r.input_ids)
            row_kv = [(k[i:i + 1, :, width - n:], v[i:i + 1, :, width - n:]) for k, v in kv]
            self._start_row(r, list(r.input_ids), row_kv, logits[i:i + 1], routed[i] if routed is not None else None)

    def _prefill_extending(self, items: list[tuple[Any, int, list]]) -> None:
        """Requests whose session prefix is cached, in one forward: each row's cached KV (left-padded to the
        longest) as the past, its new tokens (left-padded to the longest) as the input; masks hide the pads."""
        model, device = self.front.model, self.front.device
        past_w = max(n for _, n, _ in items)
        new_w = max(len(r.input_ids) - n for r, n, _ in items)
        b = len(items)
        ref_k, ref_v = items[0][2][0]
        past = []
        for layer in range(len(items[0][2])):
            k = ref_k.new_zeros((b, ref_k.shape[1], past_w, ref_k.shape[3]))
            v = ref_v.new_zeros((b, ref_v.shape[1], past_w, ref_v.shape[3]))
            for i, (_, n, kv) in enumerate(items):
                k[i, :, past_w - n:] = kv[layer][0][0]
                v[i, :, past_w - n:] = kv[layer][1][0]
            past.append((k, v))
        ids = torch.full((b, new_w), self.front.pad_id, dtype=torch.long)
        mask = torch.zeros((b, past_w + new_w), dtype=torch.long)
        positions = torch.zeros((b, new_w), dtype=torch.long)
        for i, (r, n, _) in enumerate(items):
            new = r.input_ids[n:]
            ids[i, new_w - len(new):] = torch.tensor(new)
            mask[i, past_w - n:past_w] = 1
            mask[i, past_w + new_w - len(new):] = 1
            positions[i, new_w - len(new):] = torch.arange(n, n + len(new))
        out = model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device),
                    past_key_values=_cache_from(past), use_cache=True, **self._last_only)
        kv = _layers(out.past_key_values)
        logits = out.logits[:, -1, :].float()
        routed = self._routed([i * new_w + new_w - 1 for i in range(b)])
        for i, (r, n, _) in enumerate(items):
            s = len(r.input_ids) - n
            self.front.usage["prompt_tokens"] += s  # (the cached tokens were counted when it was claimed)
            row_kv = [(torch.cat([k[i:i + 1, :, past_w - n:past_w], k[i:i + 1, :, past_w + new_w - s:]], 2),
                       torch.cat([v[i:i + 1, :, past_w - n:past_w], v[i:i + 1, :, past_w + new_w - s:]], 2))
                      for k, v in kv]
            self._start_row(r, list(r.input_ids), row_kv, logits[i:i + 1], routed[i] if routed is not None else None)

    def _routed(self, flat_positions: list[int]) -> torch.Tensor | None:
        """MoE routing capture: the last forward's experts at these flattened positions (None without capture)."""
        cap = self.front.capture
        return cap.rows(flat_positions) if cap is not None else None

    def _start_row(self, r: Any, fed: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]],
                   logits: torch.Tensor, routed: torch.Tensor | None = None) -> None:
        """Sample the first token; if the request goes on, write its KV into a free row of the batch."""
        token, logprob = self.front.sample([r], logits)[0]
        r.out_ids.append(token)
        r.out_logprobs.append(logprob)
        if routed is not None:
            r.out_routed.append(routed)
        r.finish = self.front.finished(r) or ("abort" if r.aborted else None)
        if r.finish is not None:
            self._retire(r, fed, kv)
            return
        self._place(_Row(r, len(fed), fed), kv)

    # --- the batch: K/V buffers with room to grow, rows left-padded, one column per step -------------------
    def _place(self, row: _Row, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        n = row.length
        if self.kb is None:
            k0 = kv[0][0]
            shape = (1, k0.shape[1], n + GROW, k0.shape[3])
            self.kb = [k0.new_zeros(shape) for _ in kv]
            self.vb = [k0.new_zeros(shape) for _ in kv]
            self.width = 0
            self.mask = torch.zeros((0, 0), dtype=torch.long, device=k0.device)
        if n > self.width:  # the batch grows to the left for a longer row
            self._relayout(left=n - self.width)
        width = self.width
        try:
            slot = self.rows.index(None)
        except ValueError:
            slot = len(self.rows)
            self.rows.append(None)
            self.mask = torch.cat([self.mask, self.mask.new_zeros((1, width))], 0)
            self._ensure_rows(len(self.rows))
        for kb, vb, (k, v) in zip(self.kb, self.vb, kv):
            kb[slot, :, :width - n].zero_()
            vb[slot, :, :width - n].zero_()
            kb[slot, :, width - n:width] = k[0]
            vb[slot, :, width - n:width] = v[0]
        self.mask[slot].zero_()
        self.mask[slot, width - n:] = 1
        self.rows[slot] = row

    def _ensure_rows(self, n: int) -> None:
        """Buffers with room for `n` rows. They start with the rows first needed and double (up to
        `max_batch_size`): zero-filling all of them up front cost ~0.3 s before a lone 2,000-token request."""
        have = self.kb[0].shape[0]
        if n <= have:
            return
        cap = min(self.max_batch_size, max(n, 2 * have))
        for buffers in (self.kb, self.vb):
            for i, old in enumerate(buffers):
                new = old.new_zeros((cap, *old.shape[1:]))
                new[:have, :, :self.width] = old[:, :, :self.width]
                buffers[i] = new

    def _relayout(self, *, left: int = 0, drop: int = 0) -> None:
        """`left` empty columns added before the used ones, or the first `drop` columns dropped: in place when
        they fit, else in new buffers with room for at least `GROW` more steps. The only copy of the whole cache,
        and a rare one (a few times per batch of multi-turn episodes)."""
        width = self.width + left - drop
        ref = self.kb[0]
        if (left or drop) and width < ref.shape[2]:
            # It fits: shift the used columns within the buffers (through one scratch copy). Fresh buffers of this
            # size cost ~1 s on a CPU (first-touch page faults of ~0.7 GB for SmolLM2 at 32 rows), a shift ~20 ms.
            used = self.width - drop
            scratch = ref.new_empty((ref.shape[0], ref.shape[1], used, ref.shape[3]))
            for buf in (*self.kb, *self.vb):
                scratch.copy_(buf[:, :, drop:self.width])
                buf[:, :, left:left + used] = scratch
                buf[:, :, :left].zero_()  # masked, but attention multiplies them by 0: they must be finite
        else:
            self._reallocate(width, left, drop)
        if left:
            self.mask = torch.cat([self.mask.new_zeros((self.mask.shape[0], left)), self.mask], 1)
        if drop:
            self.mask = self.mask[:, drop:].contiguous()
        self.width = width

    def _reallocate(self, width: int, left: int, drop: int) -> None:
        cap = max(width + GROW, self.kb[0].shape[2] if not drop else 0)
        for buffers in (self.kb, self.vb):
            for i, old in enumerate(buffers):
                new = old.new_zeros((old.shape[0], old.shape[1], cap, old.shape[3]))
                new[:, :, left:width] = old[:, :, drop:self.width]
                buffers[i] = new

    # --- one decode step for every live row --------------------------------------------------------------
    def _decode(self) -> None:
        model, device = self.front.model, self.front.device
        live = self._drop_finished()
        if not live:
            return
        self._trim()
        if self.width + 1 > self.kb[0].shape[2]:
            self._relayout()
        batch = len(self.rows)
        tokens = torch.full((batch, 1), self.front.pad_id, dtype=torch.long)
        positions = torch.zeros((batch, 1), dtype=torch.long)
        for i in live:
            row = self.rows[i]
            tokens[i, 0] = row.req.out_ids[-1]
            positions[i, 0] = row.length
        mask = torch.cat([self.mask, self.mask.new_zeros((batch, 1))], 1)
        mask[live, -1] = 1
        cache = _buffer_cache(self.kb, self.vb, batch, self.width)
        out = model(input_ids=tokens.to(device), attention_mask=mask, position_ids=positions.to(device),
                    past_key_values=cache, use_cache=True)
        self.width += 1  # every layer wrote this step's column in place
        self.mask = mask
        self.steps += 1
        logits = out.logits[:, -1, :].float()
        routed = self._routed(live)
        picks = self.front.sample([self.rows[i].req for i in live], logits[live])
        for j, (i, (token, logprob)) in enumerate(zip(live, picks)):
            row = self.rows[i]
            row.fed.append(row.req.out_ids[-1])
            row.length += 1
            r = row.req
            r.out_ids.append(token)
            r.out_logprobs.append(logprob)
            if routed is not None:
                r.out_routed.append(routed[j])
            r.finish = self.front.finished(r)
            if r.finish is not None:
                self._free(i)

    def _drop_finished(self) -> list[int]:
        """Free the rows whose request ended or was aborted; the live rows' indices."""
        for row in self.rows:
            if row is not None and row.req.aborted:
                row.req.finish = "abort"
        for i, row in enumerate(self.rows):
            if row is not None and row.req.finish is not None:
                self._free(i)
        return [i for i, row in enumerate(self.rows) if row is not None]

    def _free(self, i: int) -> None:
        row = self.rows[i]
        width = self.width
        kv = [(kb[i:i + 1, :, width - row.length:width], vb[i:i + 1, :, width - row.length:width])
              for kb, vb in zip(self.kb, self.vb)]
        self.rows[i] = None
        self.mask[i].zero_()
        self._retire(row.req, row.fed, kv)
        if not any(self.rows):
            self.kb = self.vb = self.mask = None
            self.rows, self.width = [], 0

    def _retire(self, r: Any, fed: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if r.session is not None and r.finish != "abort":
            self.prefix.put(r.session, list(fed), [(k.clone(), v.clone()) for k, v in kv])
        self.front.usage["completion_tokens"] += len(r.out_ids)
        r.resolve()

    def _trim(self) -> None:
        """Forget trailing free rows; drop leading columns no live row uses (when they are many)."""
        while self.rows and self.rows[-1] is None:
            self.rows.pop()
            self.mask = self.mask[:-1]
        longest = max(row.length for row in self.rows if row is not None)
        if self.width - longest > self.trim_slack:
            self._relayout(drop=self.width - longest)


def _append_layer_class() -> type:
    """A transformers `DynamicLayer` whose update writes the step's new column into the batch's buffer in
    place (the stock one concatenates: a copy of the whole cache at every step)."""
    from transformers.cache_utils import DynamicLayer

    class AppendLayer(DynamicLayer):
        def __init__(self, kbuf: torch.Tensor, vbuf: torch.Tensor, rows: int, used: int):
            super().__init__()
            self.kbuf, self.vbuf, self.rows, self.used = kbuf, vbuf, rows, used
            self.keys, self.values = kbuf[:rows, :, :used], vbuf[:rows, :, :used]
            self.dtype, self.device, self.is_initialized = kbuf.dtype, kbuf.device, True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
            n = key_states.shape[-2]
            self.kbuf[:self.rows, :, self.used:self.used + n] = key_states
            self.vbuf[:self.rows, :, self.used:self.used + n] = value_states
            self.used += n
            self.keys, self.values = self.kbuf[:self.rows, :, :self.used], self.vbuf[:self.rows, :, :self.used]
            return self.keys, self.values

    return AppendLayer


_APPEND_LAYER: type | None = None


def _buffer_cache(kb: list[torch.Tensor], vb: list[torch.Tensor], rows: int, used: int) -> Any:
    from transformers import DynamicCache

    global _APPEND_LAYER
    if _APPEND_LAYER is None:
        _APPEND_LAYER = _append_layer_class()
    cache = DynamicCache()
    cache.layers.extend(_APPEND_LAYER(k, v, rows, used) for k, v in zip(kb, vb))
    return cache


def _cache_from(kv: list) -> Any:
    """A transformers `DynamicCache` holding these (keys, values) per layer, without copying them (its
    `update` would: it concatenates onto an empty tensor)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache()
    for k, v in kv:
        layer = DynamicLayer()
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
        cache.layers.append(layer)
    return cache


def _layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer of a transformers cache (5.x `layers`, or the legacy tuple form)."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return [(k, v) for k, v in cache]
