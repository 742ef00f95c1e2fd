"""Per-token log-probs and entropy from vocabulary-parallel logits (each TP rank holds V / tp columns).

log p(y) = z_y - logsumexp(z) with the max, the sum of exponentials and the target logit combined across
the TP group; entropy H = logsumexp(z) - sum_v p_v z_v. Sums go through megatron's
`reduce_from_tensor_model_parallel_region` (all-reduce forward, identity backward), so gradients are
exact on every rank. With TP = 1 the reductions are no-ops and this is a plain fp32 log-softmax.
"""

from __future__ import annotations

import torch
from slime_env.trainers.megatron.compiled import lazily_compiled


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, with_entropy: bool = False):
    """`logits` [N, V / tp] (any float dtype), `targets` [N] (global ids) -> log-probs [N] in fp32, and the
    entropy [N] when `with_entropy`."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as all_sum

    tp = ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    if tp == 1 and logits.is_cuda:  # one fused kernel per direction instead of ~10 passes over [N, V] in fp32
        logp, ent = _fused_logprobs_entropy(logits, targets)
        return (logp, ent) if with_entropy else logp
    z = logits.float()
    zmax = z.detach().max(dim=-1).values
    if tp > 1:
        torch.distributed.all_reduce(zmax, op=torch.distributed.ReduceOp.MAX,
                                     group=ps.get_tensor_model_parallel_group())
    z = z - zmax.unsqueeze(-1)
    exp = z.exp()
    sum_exp = exp.sum(-1)
    vp = z.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * vp if tp > 1 else 0
    local = targets - start
    inside = (local >= 0) & (local < vp)
    target = z.gather(-1, local.clamp(0, vp - 1).unsqueeze(-1)).squeeze(-1) * inside
    if tp > 1:
        sum_exp, target = all_sum(sum_exp), all_sum(target)
    lse = sum_exp.log()
    logp = target - lse
    if not with_entropy:
        return logp
    pz = (exp * z).sum(-1)
    if tp > 1:
        pz = all_sum(pz)
    return logp, lse - pz / sum_exp


def _logprobs_entropy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    z = logits.float()
    lse = torch.logsumexp(z, dim=-1)
    target = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
    return target - lse, entropy


_fused_logprobs_entropy = lazily_compiled(_logprobs_entropy)


# --- the LM head in token chunks ---------------------------------------------------------------------------------
# Auto mode: chunk once a micro-batch's fp32 logits would pass 16 GiB (Qwen3's vocabulary: past ~28k tokens), in
# chunks of 1 GiB. Below that the whole head's fused kernel is faster (4 x H200, Qwen3-4B shape, 16k-token
# micro-batches: 7,805 tokens/s/GPU whole beside 7,532 chunked) and its memory fits; at 64k it is 101 GB beside 56.
AUTO_CHUNK_ABOVE_BYTES = 16 << 30
CHUNK_BYTES = 1 << 30


def head_chunk_tokens(setting: int | None, rows: int, vocab: int) -> int:
    """Tokens per chunk of the LM head for `rows` scored rows: `setting` None = auto (chunks of 1 GiB of fp32 logits
    once the whole would pass 16 GiB, else 0), 0 = never (the model's own full logits), N = chunks of N."""
    if setting is not None:
        return setting
    if rows * vocab * 4 <= AUTO_CHUNK_ABOVE_BYTES:
        return 0
    return max(1, CHUNK_BYTES // (vocab * 4))


def chunked_head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, chunk_tokens: int,
                          with_entropy: bool = False):
    """Log-probs (and entropies) of `targets` [N] under the LM head `weight` [V, H] applied to `hidden` [N, H],
    `chunk_tokens` rows at a time: never the [N, V] logits at once, forward or backward (the backward recomputes
    each chunk's logits). Exact: the same fp32 log-softmax as `vocab_parallel_logprobs` with TP = 1."""
    logp, entropy = _ChunkedHead.apply(hidden, weight, targets, int(chunk_tokens), bool(with_entropy))
    return (logp, entropy) if with_entropy else logp


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, with_entropy):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logp)
        entropy = torch.zeros_like(logp)
        for s in range(0, n, chunk):
            z = (hidden[s:s + chunk] @ weight.t()).float()
            lse[s:s + chunk] = torch.logsumexp(z, dim=-1)
            logp[s:s + chunk] = z.gather(-1, targets[s:s + chunk].unsqueeze(-1)).squeeze(-1) - lse[s:s + chunk]
            if with_entropy:
                q = (z - lse[s:s + chunk].unsqueeze(-1)).exp_()
                entropy[s:s + chunk] = lse[s:s + chunk] - (q * z).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.chunk, ctx.with_entropy = chunk, with_entropy
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        chunk = ctx.chunk
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1]
                  else None)
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s:s + chunk]
            logq = (h @ weight.t()).float() - lse[s:s + chunk].unsqueeze(-1)
            q = logq.exp()
            # d logp_y / dz = onehot(y) - q;  d H / dz = -q (log q + H)
            gl = g_logp[s:s + chunk].unsqueeze(-1) if g_logp is not None else None
            gz = -q * gl if gl is not None else torch.zeros_like(q)
            if gl is not None:
                gz.scatter_add_(-1, targets[s:s + chunk].unsqueeze(-1), gl)
            if ctx.with_entropy and g_entropy is not None:
                gz -= g_entropy[s:s + chunk].unsqueeze(-1) * q * (logq + entropy[s:s + chunk].unsqueeze(-1))
            gz = gz.to(hidden.dtype)
            if grad_h is not None:
                grad_h[s:s + chunk] = gz @ weight
            if grad_w is not None:
                grad_w += (gz.t() @ h).float()
        return grad_h, (grad_w.to(weight.dtype) if grad_w is not None else None), None, None, None
