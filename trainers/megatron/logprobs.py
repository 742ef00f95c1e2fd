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
