"""Packed (THD) micro-batches as a megatron rank feeds them to its model: `Packer` concatenates a batch's rows
without padding, pads the packed length where the parallel layout needs it (sequence parallel, context parallel's
2·CP chunks, the all-gather token dispatcher's equal counts, a pipeline's fixed shape), keeps this CP rank's
chunks, and maps the logits that score each loss-masked token back into the batch's [B, L] layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from slime_env.trainers.batch import TrainBatch


@dataclass
class Packed:
    """A micro-batch as this rank feeds it to the model: its (CP share of the) packed `ids` [1, T'], the THD
    `params`, the batch's loss-masked tokens (`need`, indices into the unpadded packed rows), and for each of them
    the local row of the logit that scores it (`src`, -1 where another CP rank holds it) and its token id."""

    ids: torch.Tensor
    params: Any
    need: torch.Tensor
    src: torch.Tensor
    targets: torch.Tensor


class Packer:
    """How this rank packs: `pad_id`, the CP size and rank, TP and sequence parallel, its device; `min_tokens`
    (every packed micro-batch is padded to at least this many tokens) is set per step by the backend."""

    def __init__(self, *, pad_id: int, cp: int, cp_rank: int, tp: int, sequence_parallel: bool,
                 device: torch.device):
        self.pad_id, self.cp, self.cp_rank, self.tp = pad_id, cp, cp_rank, tp
        self.sequence_parallel, self.device = sequence_parallel, device
        self.min_tokens = 0

    def at_scored(self, p: Packed, local: torch.Tensor, fn: Callable[..., Sequence[torch.Tensor]]
                   ) -> list[torch.Tensor]:
        """`fn(rows of local that score a loss token, their target ids)` -> per-token tensors, as [len(p.need)]
        each. Under CP every rank computes the tokens whose scoring row it holds and the sums over the CP group
        complete them (backward: each rank's own share)."""
        if self.cp == 1:
            return list(fn(local[p.src], p.targets))
        from slime_env.trainers.megatron.context_parallel import sum_over_cp
        from megatron.core import parallel_state as ps

        mine = (p.src >= 0).nonzero().squeeze(-1)
        parts = fn(local[p.src[mine]], p.targets[mine])
        group = ps.get_context_parallel_group()
        # A rank that scores nothing here still joins the backward: its K/V fed the other ranks' queries, and the
        # all-gather's backward is a collective.
        tie = local.reshape(-1)[0].float() * 0.0 if mine.numel() == 0 else 0.0
        return [sum_over_cp(torch.zeros(p.need.numel(), dtype=torch.float32, device=self.device)
                            .index_put((mine,), part.float()) + tie, group) for part in parts]

    def packed(self, batch: TrainBatch) -> Packed | None:
        """`batch`'s rows concatenated as this rank feeds them to the model; None if no token is loss-masked. A
        loss-masked token is never a sequence start (prompts are masked)."""
        u = batch.unpadded()
        need = (u["loss_mask"] > 0).nonzero().squeeze(-1)
        if need.numel() == 0:
            return None
        ids, params, index = self.layout(u["input_ids"], u["cu_seqlens"])
        at = index[0][need]  # where each loss token sits in the padded global layout
        src = at - 1 if index[1] is None else index[1][at - 1]
        return Packed(ids, params, need.to(self.device), src.to(self.device), index[2][at].to(self.device))

    def layout(self, ids: torch.Tensor, cu: torch.Tensor):
        """(this rank's ids [1, T'], THD params, (padded index of each input token, local row of each padded
        token or None without CP, the padded ids)). Under CP each sequence is padded to a multiple of 2·CP and
        the rank keeps its two chunks of each; `padded` then appends the dummy sequence the layout needs."""
        from megatron.core.packed_seq_params import PackedSeqParams

        where = torch.arange(ids.numel())
        if self.cp > 1:
            from slime_env.trainers.megatron import context_parallel as ctx

            ids, cu, where = ctx.pad_sequences(ids, cu, self.cp, self.pad_id)
        ids, cu = self.padded(ids, cu)
        local_row = None
        full = ids
        if self.cp > 1:
            shard = ctx.shard_index(cu, self.cp_rank, self.cp)
            local_row = torch.full((ids.numel(),), -1, dtype=torch.long)
            local_row[shard] = torch.arange(shard.numel())
            ids = ids[shard]
        longest = int((cu[1:] - cu[:-1]).max())
        cu = cu.to(self.device)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                                 max_seqlen_kv=longest)
        return ids.to(self.device).unsqueeze(0), params, (where, local_row, full)

    def padded(self, ids: torch.Tensor, cu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`ids` with a dummy sequence of pad ids appended where the layout needs it: sequence parallel splits
        (each CP rank's share of) the tokens over TP, so their count must divide; CP splits every sequence into 2·CP
        chunks; megatron's all-gather token dispatcher under EP gathers equal token counts from every EP rank (each
        micro-batch is padded to `min_tokens`; so is every micro-batch of a pipeline schedule whose stages exchange
        activations of one fixed shape). The dummy sequence attends only to itself and no log-prob is read
        from it."""
        pad = self.padded_total(ids.numel()) - ids.numel()
        if pad:
            ids = torch.cat([ids, ids.new_full((pad,), self.pad_id)])
            cu = torch.cat([cu, cu[-1:] + pad])
        return ids, cu

    def padded_total(self, n: int) -> int:
        """The packed token count the model is given for `n` tokens (see `padded`)."""
        target = max(n, self.min_tokens)
        multiple = math.lcm(2 * self.cp if self.cp > 1 else 1,
                            self.cp * self.tp if self.sequence_parallel else 1)
        return target + -target % multiple

    def model_lengths(self, lengths: list[int]) -> list[int]:
        """Sequence lengths as the model sees them: under CP each padded for the 2·CP split."""
        if self.cp == 1:
            return lengths
        from slime_env.trainers.megatron.context_parallel import padded_lengths

        return padded_lengths(lengths, self.cp)

    def scatter(self, batch: TrainBatch, need: torch.Tensor | None, values: torch.Tensor | None) -> torch.Tensor:
        """Per-token `values` at packed indices `need` -> [B, L] in the batch's layout (zeros elsewhere)."""
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=self.device)
        if need is None:
            return out
        keep = batch.attention_mask.to(self.device).bool()
        flat = torch.zeros(int(keep.sum()), dtype=torch.float32, device=self.device).index_put((need,), values)
        return out.masked_scatter(keep, flat)
