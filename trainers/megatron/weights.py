"""The megatron backend's weights in megatron and Hugging Face names: this rank's shard from a full HF state dict
(`from_hf`), the full HF state gathered over TP, EP and PP (`hf_state_dict`), the LoRA adapter in PEFT's names
(`adapter`), the reference policy kept on the CPU (`RefWeights`). The functions take the backend (`b`: a
`MegatronBackend`) for its config, ranks and model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from slime_env.trainers.megatron.optimizer import copy_params, gather


class RefWeights:
    """The reference policy as CPU tensors in megatron names, swapped into the model when needed."""

    def __init__(self, state: Mapping[str, torch.Tensor]):
        self.state = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def from_hf(b: Any, hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's megatron weights (its TP shard, its EP share of the experts, stacked for `GroupedExperts`)
    from a full HF state dict."""
    from slime_env.trainers.megatron import hf_to_mcore, moe
    from slime_env.trainers.megatron.convert import stage_weights

    state = hf_to_mcore(hf, b.hf_config, tp_rank=b.tp_rank, tp_size=b.config.tp)
    if b.pp > 1:
        state = stage_weights(state, **b.stage)
    if b.moe:
        state = moe.local_experts(state, b.hf_config.num_experts, b.ep_rank, b.config.ep)
    return moe.to_grouped(state) if b.grouped else state

def mcore_state(b: Any) -> dict[str, torch.Tensor]:
    """The base model's weights (this rank's, megatron names; no adapter)."""
    from slime_env.trainers.megatron.lora import is_lora_param

    return {k: v for k, v in b.model.state_dict().items()
            if not k.endswith("_extra_state") and not is_lora_param(k)}

def load_mcore(b: Any, state: Mapping[str, torch.Tensor]) -> None:
    from slime_env.trainers.megatron.lora import is_lora_param

    copy_params(b.model, state, lambda name: not is_lora_param(name))

def load_adapter_tensors(b: Any, tensors: Mapping[str, torch.Tensor]) -> None:
    """A PEFT adapter's tensors (HF names) into this rank's adapter parameters."""
    from slime_env.trainers.megatron import lora
    from slime_env.trainers.megatron.convert import stage_weights

    state = lora.from_peft(tensors, b.lora, b.hf_config, tp_rank=b.tp_rank, tp_size=b.config.tp,
                           ep_rank=b.ep_rank, ep_size=b.config.ep)
    if b.pp > 1:
        state = stage_weights(state, **(b.stage | {"tied": False}))
    copy_params(b.model, state, lora.is_lora_param)

@torch.no_grad()
def hf_state_dict(b: Any) -> dict[str, torch.Tensor]:
    """Current weights with Hugging Face names, gathered across TP ranks and, for experts, EP ranks (a
    collective under TP or EP). MoE experts come in transformers' fused in-memory layout."""
    from megatron.core import parallel_state as ps

    from slime_env.trainers.megatron import mcore_to_hf, moe

    local = moe.from_grouped(mcore_state(b)) if b.grouped else mcore_state(b)
    experts = {k: v for k, v in local.items() if moe.is_expert_param(k)}
    dense = {k: v for k, v in local.items() if k not in experts}
    shards = gather(dense, b.config.tp, ps.get_tensor_model_parallel_group() if b.config.tp > 1 else None)
    if experts:
        group = ps.get_expert_model_parallel_group() if b.config.ep > 1 else None
        shards[0] = shards[0] | moe.global_experts(gather(experts, b.config.ep, group))
    return mcore_to_hf(all_stages(b, shards), b.hf_config)

def all_stages(b: Any, shards: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Per-TP-rank megatron tensors of this pipeline stage -> of every stage, layers numbered over the whole model
    (a collective under PP)."""
    if b.pp == 1:
        return shards
    from megatron.core import parallel_state as ps

    from slime_env.trainers.megatron.convert import renumber_layers

    group = ps.get_pipeline_model_parallel_group()
    mine = [renumber_layers(sh, b.stage["offset"]) for sh in shards]
    # names, shapes and dtypes go as objects; the tensors one at a time from their stage, straight into place:
    # all_gather_object pickled every stage whole and held the bytes, the gathered buffer and the copies at once,
    # the Ray placement test's memory peak (~3.2 GB per rank of SmolLM2 under PP=2, ~2.2 GB now)
    metas: list[Any] = [None] * b.pp
    dist.all_gather_object(metas, [{k: (tuple(v.shape), v.dtype) for k, v in sh.items()} for sh in mine],
                           group=group)
    ranks, me = dist.get_process_group_ranks(group), ps.get_pipeline_model_parallel_rank()
    device = next(iter(mine[0].values())).device
    out: list[dict[str, torch.Tensor]] = [{} for _ in shards]
    for stage in reversed(range(b.pp)):  # a name on two stages (a tied embedding): the last stage's, as before
        for t, names in enumerate(metas[stage]):
            for name, (shape, dtype) in names.items():
                if name in out[t]:
                    continue
                x = mine[t][name].detach().contiguous() if stage == me else torch.empty(shape, dtype=dtype,
                                                                                       device=device)
                dist.broadcast(x, src=ranks[stage], group=group)
                out[t][name] = x.cpu()
    return [{k: sh[k] for stage in metas for k in stage[t]} for t, sh in enumerate(out)]

@torch.no_grad()
def adapter(b: Any) -> Any:
    """The current LoRA adapter (`slime_env.agents.lora_adapter.LoRAAdapter`: PEFT's names and config, copies, the
    fused layers' adapters split per projection), gathered across TP and PP: every rank calls it."""
    if b.lora is None:
        raise ValueError("adapter(): this trainer has no trainer.lora section")
    from megatron.core import parallel_state as ps

    from slime_env.agents.lora_adapter import LoRAAdapter
    from slime_env.trainers.megatron import lora, moe

    local = {k: v.detach() for k, v in lora.lora_state(b.model).items()}
    experts = {k: v for k, v in local.items() if moe.is_expert_param(k)}  # [local experts, ...]: joined over EP
    shards = gather({k: v for k, v in local.items() if k not in experts}, b.config.tp,
                     ps.get_tensor_model_parallel_group() if b.config.tp > 1 else None)
    if experts:
        group = ps.get_expert_model_parallel_group() if b.config.ep > 1 else None
        parts = gather(experts, b.config.ep, group)
        shards[0] = shards[0] | {k: torch.cat([p[k] for p in parts]) for k in experts}
    tensors = lora.to_peft(all_stages(b, shards), b.lora, b.hf_config)
    return LoRAAdapter(b.config.lora.name, {k: v.cpu() for k, v in tensors.items()},
                       lora.peft_config(b.config.lora, b.lora, b.hf_config))
