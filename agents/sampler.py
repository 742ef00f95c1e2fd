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

import numpy as np
import torch

_M32 = np.uint64(0xFFFFFFFF)


def _mix32(x: np.ndarray) -> np.ndarray:
    """A 32-bit integer hash with good avalanche (Wellons' "lowbias32"), on uint64 arrays holding 32-bit values."""
    x = x & _M32
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & _M32
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x846CA68B)) & _M32
    return x ^ (x >> np.uint64(16))


def uniforms(seeds, counters) -> np.ndarray:
    """One float64 in [0, 1) per row, a function of (seed, counter) alone (ints; seeds may be negative). Computed
    on the host: a handful of numpy operations instead of some thirty tiny kernels on the device."""
    s = np.asarray(seeds, dtype=np.int64).view(np.uint64)
    c = np.asarray(counters, dtype=np.int64).view(np.uint64) & _M32
    lo, hi = s & _M32, s >> np.uint64(32)
    h1 = _mix32(lo ^ _mix32(hi ^ _mix32(c)))
    h2 = _mix32(h1 ^ np.uint64(0x9E3779B9) ^ _mix32(c ^ np.uint64(0x85EBCA6B)))
    # 53 random bits: exact in float64.
    return ((h1 << np.uint64(21)) | (h2 >> np.uint64(11))).astype(np.float64) / float(1 << 53)


@dataclass
class SamplingBatch:
    """Per-row parameters on the logits' device. `temperature` 0 means greedy; `top_k` <= 0 means off."""
    temperature: torch.Tensor  # (B,) float32
    top_p: torch.Tensor        # (B,) float32
    top_k: torch.Tensor        # (B,) int64
    u: torch.Tensor            # (B,) float64: each row's uniform, from its seed and its request's token count
    filtered: bool             # any row with top-k or top-p (host flags: no device sync to learn them)
    any_greedy: bool

    @classmethod
    def build(cls, rows: list[tuple[float, float, int, int, int]], device: torch.device) -> SamplingBatch:
        """From (temperature, top_p, top_k, seed, counter) per row."""
        temps, top_ps, top_ks, seeds, counters = zip(*rows)
        greedy = [t == 0 or k == 1 for t, k in zip(temps, top_ks)]
        filtered = any(not g and (0 < k or p < 1.0) for g, p, k in zip(greedy, top_ps, top_ks))
        n = len(rows)
        f = np.empty(3 * n, dtype=np.float64)
        f[:n] = [0.0 if g else t for g, t in zip(greedy, temps)]
        f[n:2 * n] = top_ps
        f[2 * n:] = uniforms(seeds, counters)
        f = torch.from_numpy(f).to(device, non_blocking=True)
        k = torch.tensor(top_ks, dtype=torch.int64).to(device, non_blocking=True)
        return cls(f[:n].float(), f[n:2 * n].float(), k, f[2 * n:], filtered, any(greedy))


def _cumsum_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.cumsum(-1)`. On CUDA, a few rows are scanned one by one: torch scans a few long rows together with a slow
    kernel (0.2 ms for 4 rows of 151,936 on an H200, 4% of an 8B model's decode step) and a single row with its
    device-wide scan; row by row, a row's sums are also the same whatever the batch."""
    if not x.is_cuda or not 1 < x.shape[0] <= 16:
        return x.cumsum(-1)
    out = torch.empty_like(x)
    for i in range(x.shape[0]):
        torch.cumsum(x[i], -1, out=out[i])
    return out


def sample(logits: torch.Tensor, p: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens int64 (B,), log-probs float32 (B,)) for float32 `logits` (B, V); see the module docstring."""
    b, vocab = logits.shape
    greedy = p.temperature == 0
    u = p.u
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
    cdf = _cumsum_rows(logp.exp())
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
