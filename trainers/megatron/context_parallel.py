"""Context parallelism for packed (THD) sequences: megatron's load-balanced layout over our own attention.

Every sequence of a packed micro-batch is padded to a multiple of 2·CP and cut into 2·CP equal chunks; CP rank r
holds chunks r and 2·CP−1−r of each (megatron's layout: a causal sequence's early chunks attend to little and its
late ones to much, so one of each balances the work). The model runs on a rank's share only. Attention needs
every earlier key: each layer all-gathers K and V over the CP group (backward: their gradients reduce-scattered
back, summed over the ranks whose queries used them), builds each query chunk's causal prefix and attends to it
(`SDPAttention`). RoPE rotates every token by its position in its whole sequence (`positions`). Per-token
log-probs are computed where a rank holds the scoring logit and summed over the group with an identity backward
(`sum_over_cp`): every rank then holds the whole micro-batch's values, the loss is the CP=1 loss, and parameter
gradients summed over DP×CP are the CP=1 gradients.

The layout is megatron's own (`cu_seqlens_q_padded` of global padded lengths), so its THD RoPE and any TE
attention would read the same batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def padded_lengths(lengths: list[int], cp: int) -> list[int]:
    """Each length rounded up to a multiple of 2·CP (the padded sequence splits into 2·CP equal chunks)."""
    m = 2 * cp
    return [n + (-n % m) for n in lengths]


def pad_sequences(ids: torch.Tensor, cu: torch.Tensor, cp: int, pad_id: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed `ids` [T] with `cu` [B + 1] -> (ids with each sequence padded at its end to a multiple of 2·CP,
    the padded `cu`, and for every original token its padded index [T]). Padding follows the real tokens, so no
    real token attends to it."""
    lengths = (cu[1:] - cu[:-1]).to(torch.long)
    padded = torch.tensor(padded_lengths(lengths.tolist(), cp), dtype=torch.long)
    cu_p = torch.zeros(len(padded) + 1, dtype=torch.long)
    cu_p[1:] = padded.cumsum(0)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    where = torch.arange(ids.numel()) - cu.to(torch.long)[seq] + cu_p[seq]
    out = ids.new_full((int(cu_p[-1]),), pad_id)
    out[where] = ids
    return out, cu_p.to(cu.dtype), where


def positions(cu: torch.Tensor, total: int, rank: int, cp: int) -> torch.Tensor:
    """For CP rank `rank`'s `total` tokens of the packed batch with global padded `cu` [B + 1]: each token's
    position inside its whole sequence [total] (long). No host sync (the output sizes are given)."""
    cu = cu.to(torch.long)
    length = cu[1:] - cu[:-1]
    local = length // cp
    local_cu = torch.zeros_like(cu)
    local_cu[1:] = local.cumsum(0)
    seq = torch.repeat_interleave(torch.arange(len(length), device=cu.device), local, output_size=total)
    j = torch.arange(total, device=cu.device) - local_cu[seq]  # index inside this rank's share of the sequence
    half = (length // (2 * cp))[seq]
    return torch.where(j < half, rank * half + j, length[seq] - (rank + 1) * half + (j - half))


def shard_index(cu: torch.Tensor, rank: int, cp: int) -> torch.Tensor:
    """The global padded index of each of CP rank `rank`'s tokens, in its local order [T / cp] (long)."""
    cu = cu.to(torch.long)
    total = int(cu[-1]) // cp
    length = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(len(length), device=cu.device), length // cp, output_size=total)
    return cu[seq] + positions(cu, total, rank, cp)


@dataclass(frozen=True)
class PrefixLayout:
    """One CP rank's attention layout: its query chunks (two per sequence, `cu_q`) and each chunk's causal prefix
    of keys (`cu_k`), gathered from the rank-major all-gathered K/V by `kv_index`."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    kv_index: torch.Tensor
    max_q: int
    max_k: int


def prefix_layout(cu: torch.Tensor, rank: int, cp: int) -> PrefixLayout:
    """The layout of `PrefixLayout` for global padded `cu` (one host copy of `cu`; the rest on its device)."""
    host = cu.detach().to("cpu", torch.long)
    length = host[1:] - host[:-1]
    half = length // (2 * cp)
    total = int(host[-1])
    # Where each global token landed in the rank-major all-gather of every rank's share.
    gathered = torch.cat([shard_index(host, r, cp) for r in range(cp)])
    inv = torch.empty(total, dtype=torch.long)
    inv[gathered] = torch.arange(total)
    q_len = torch.stack([half, half], 1).reshape(-1)
    k_len = torch.stack([(rank + 1) * half, length - rank * half], 1).reshape(-1)  # chunk r, chunk 2cp-1-r
    cu_q = torch.zeros(len(q_len) + 1, dtype=torch.long)
    cu_q[1:] = q_len.cumsum(0)
    cu_k = torch.zeros(len(k_len) + 1, dtype=torch.long)
    cu_k[1:] = k_len.cumsum(0)
    start = torch.repeat_interleave(host[:-1], 2)
    seg = torch.repeat_interleave(torch.arange(len(k_len)), k_len)
    kv_global = torch.arange(int(cu_k[-1])) - cu_k[seg] + start[seg]
    dev = cu.device
    return PrefixLayout(cu_q=cu_q.to(dev, torch.int32), cu_k=cu_k.to(dev, torch.int32),
                        kv_index=inv[kv_global].to(dev), max_q=int(q_len.max()) if len(q_len) else 0,
                        max_k=int(k_len.max()) if len(k_len) else 0)


def gather_kv(x: torch.Tensor, group) -> torch.Tensor:
    """Every CP rank's `x` [t, heads, d] concatenated in rank order; backward: gradients summed and scattered."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(x, True, group=group)


def sum_over_cp(x: torch.Tensor, group) -> torch.Tensor:
    """`x` summed over the CP group; backward: identity (each rank's share of the sum keeps its own gradient)."""
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x, group=group)
