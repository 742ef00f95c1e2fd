"""Sampling for a whole batch on the model's device: per-row temperature, top-k, top-p and seed, one kernel chain.

Each row draws one token by inverse CDF with one uniform number. The uniform comes from a counter-based hash of
(the row's seed, how many tokens its request has generated): a request's draws depend on its seed and its own
progress only, never on which other requests share the batch or on the device, and no per-row generator object
has to exist. The log-prob returned for each token is under the distribution it was drawn from (temperature,
top-k and top-p applied and renormalised); greedy rows (temperature 0 or top-k 1) take the argmax and the model's
own log-softmax — the same contract as `TransformersPolicy`'s CPU sampler.

`sample(logits, params)` returns (tokens, logprobs) as device tensors; the caller moves them to the host in one copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for 0 <= x < 2**32 in int64 without overflow (16-bit halves)."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with good avalanche (Wellons' "lowbias32")."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniforms(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One float64 in [0, 1) per row, a function of (seed, counter) alone (int64 tensors, seeds may be negative)."""
    s = seeds.to(torch.int64)
    lo, hi = s & _M32, (s >> 32) & _M32
    c = counters.to(torch.int64) & _M32
    h1 = _mix32(lo ^ _mix32(hi ^ _mix32(c)))
    h2 = _mix32(h1 ^ 0x9E3779B9 ^ _mix32(c ^ 0x85EBCA6B))
    # 53 random bits: exact in float64.
    return ((h1 << 21) | (h2 >> 11)).to(torch.float64) / float(1 << 53)


@dataclass
class SamplingBatch:
    """Per-row parameters on the logits' device. `temperature` 0 means greedy; `top_k` <= 0 means off."""
    temperature: torch.Tensor  # (B,) float32
    top_p: torch.Tensor        # (B,) float32
    top_k: torch.Tensor        # (B,) int64
    seeds: torch.Tensor        # (B,) int64
    counters: torch.Tensor     # (B,) int64: tokens generated so far by each row's request
    filtered: bool             # any row with top-k or top-p (host flags: no device sync to learn them)
    any_greedy: bool

    @classmethod
    def build(cls, rows: list[tuple[float, float, int, int, int]], device: torch.device) -> SamplingBatch:
        """From (temperature, top_p, top_k, seed, counter) per row."""
        temps, top_ps, top_ks, seeds, counters = zip(*rows)
        greedy = [t == 0 or k == 1 for t, k in zip(temps, top_ks)]
        filtered = any(not g and (0 < k or p < 1.0) for g, p, k in zip(greedy, top_ps, top_ks))
        f = torch.tensor([0.0 if g else t for g, t in zip(greedy, temps)] + list(top_ps), dtype=torch.float32)
        i = torch.tensor(list(top_ks) + list(seeds) + list(counters), dtype=torch.int64)
        f, i = f.to(device, non_blocking=True), i.to(device, non_blocking=True)
        n = len(rows)
        return cls(f[:n], f[n:], i[:n], i[n:2 * n], i[2 * n:], filtered, any(greedy))


def sample(logits: torch.Tensor, p: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens int64 (B,), log-probs float32 (B,)) for float32 `logits` (B, V); see the module docstring."""
    b, vocab = logits.shape
    greedy = p.temperature == 0
    u = uniforms(p.seeds, p.counters)
    x = logits / torch.where(greedy, torch.ones_like(p.temperature), p.temperature)[:, None]
    if p.filtered:
        x, order = torch.sort(x, dim=-1, descending=True)
        k = torch.where(p.top_k > 0, p.top_k.clamp(max=vocab), torch.full_like(p.top_k, vocab))
        kth = x.gather(1, (k - 1)[:, None])
        keep = x >= kth  # ties with the k-th value are kept, as torch.topk + masked_fill does
        probs = torch.softmax(x.masked_fill(~keep, float("-inf")), -1)
        keep &= probs.cumsum(-1) - probs <= p.top_p[:, None]  # keep the token that crosses top_p
        x = x.masked_fill(~keep, float("-inf"))
    logp = torch.log_softmax(x, -1)
    cdf = logp.exp().cumsum(-1)
    target = (u * cdf[:, -1].double()).float()[:, None]
    # right=True: the first index whose cdf exceeds the target, so a zero-probability token (a flat stretch of
    # the cdf) is never picked; a target rounded up to the total picks the last token that can be drawn.
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    last = (cdf < cdf[:, -1:]).sum(-1)  # index of the last token with nonzero probability
    idx = torch.minimum(idx, last)
    picked_logp = logp.gather(1, idx[:, None]).squeeze(1)
    token = order.gather(1, idx[:, None]).squeeze(1) if p.filtered else idx
    if p.any_greedy:
        g_tok = logits.argmax(-1)
        g_logp = torch.log_softmax(logits, -1).gather(1, g_tok[:, None]).squeeze(1)
        token = torch.where(greedy, g_tok, token)
        picked_logp = torch.where(greedy, g_logp, picked_logp)
    return token, picked_logp
