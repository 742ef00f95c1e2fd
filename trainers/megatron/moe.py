"""Qwen3-MoE on megatron-core: the MoE part of the `TransformerConfig`, and the expert weights both ways.

Qwen3-MoE (Qwen3-30B-A3B, -235B-A22B) is Qwen3's attention (q/k RMSNorm, GQA, no bias) with a sparse MLP in
every layer (`mlp_only_layers` / `decoder_sparse_step` name dense ones): a linear router over `num_experts`,
softmax, top-`num_experts_per_tok`, renormalised when `norm_topk_prob`, SwiGLU experts, no shared expert. That
is megatron's `MoELayer` exactly: top-k on the router logits then softmax over the k (`moe_router_pre_softmax`
off) equals softmax, top-k, renormalise; `pre_softmax` on is the unnormalised variant. Experts are our
`GroupedExperts` (two grouped GEMMs per layer; `grouped_experts.py`) or megatron's `SequentialMLP` (one
`linear_fc1` = [gate; up] and `linear_fc2` per expert). Experts are split over the expert-parallel group and never
over TP (`expert_tensor_parallel_size=1`).

Weights: transformers >= 5 keeps a layer's experts fused in memory (`mlp.experts.gate_up_proj` [E, 2F, H],
`mlp.experts.down_proj` [E, H, F]) and writes them per expert on disk (`mlp.experts.{e}.gate_proj.weight` …, the
layout SGLang and vLLM load). `hf_to_mcore` reads either; `mcore_to_hf` gives the fused one and
`per_expert_layout` the on-disk one. Megatron names here number the experts globally
(`mlp.experts.local_experts.{e}`); `local_experts` / `global_experts` move between that and one EP rank's share.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

MOE_TYPES = ("qwen3_moe",)
_LOCAL = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")
_STACKED = re.compile(r"^(.*\.mlp\.experts\.)weight([12])$")
_ADAPTER = re.compile(r"^.*\.mlp\.experts\.fc[12]\.lora_[AB]$")  # LoRA on `GroupedExperts` (megatron/lora.py)


def is_moe(hf_config: Any) -> bool:
    return getattr(hf_config, "model_type", None) in MOE_TYPES


def sparse_layers(c: Any) -> list[bool]:
    """Which decoder layers are MoE, by transformers' own rule for Qwen3-MoE (none of a dense model's)."""
    if not is_moe(c):
        return [False] * c.num_hidden_layers
    step, dense = getattr(c, "decoder_sparse_step", 1) or 1, set(getattr(c, "mlp_only_layers", None) or [])
    return [i not in dense and c.num_experts > 0 and (i + 1) % step == 0 for i in range(c.num_hidden_layers)]


def moe_config(c: Any, *, ep: int = 1, aux_loss_coeff: float | None = None, load_balancing: str = "aux_loss",
               dispatcher: str | None = None) -> dict[str, Any]:
    """`TransformerConfig` fields of an MoE model; refuses, naming the numbers, an EP size that does not divide
    the experts. `aux_loss_coeff` None takes the model's `router_aux_loss_coef`; `dispatcher` None is megatron's
    all-to-all token dispatcher on CUDA and its all-gather one elsewhere (the all-to-all one needs CUDA streams)."""
    if dispatcher is None:
        dispatcher = "alltoall" if torch.cuda.is_available() else "allgather"
    if dispatcher not in ("alltoall", "allgather"):
        raise ValueError(f"moe_token_dispatcher {dispatcher!r}: alltoall or allgather")
    if c.num_experts % ep:
        raise ValueError(f"expert-parallel size {ep} does not divide the {c.num_experts} experts of {c.model_type}")
    if load_balancing not in ("aux_loss", "seq_aux_loss", "global_aux_loss", "none"):
        raise ValueError(f"moe_load_balancing {load_balancing!r}: aux_loss, seq_aux_loss, global_aux_loss or none")
    coeff = getattr(c, "router_aux_loss_coef", 0.0) if aux_loss_coeff is None else aux_loss_coeff
    return dict(num_moe_experts=c.num_experts, moe_ffn_hidden_size=c.moe_intermediate_size,
                moe_router_topk=c.num_experts_per_tok, moe_router_pre_softmax=not getattr(c, "norm_topk_prob", False),
                moe_router_score_function="softmax", moe_router_dtype="fp32",
                moe_router_load_balancing_type=load_balancing,
                moe_aux_loss_coeff=0.0 if load_balancing == "none" else float(coeff),
                moe_token_dispatcher_type=dispatcher, moe_layer_freq=[int(s) for s in sparse_layers(c)],
                moe_grouped_gemm=False, moe_permute_fusion=False, expert_model_parallel_size=ep,
                expert_tensor_parallel_size=1)


# --- Hugging Face <-> megatron, one layer's experts ------------------------------------------------------------
def fused_layout(hf: Mapping[str, torch.Tensor], c: Any) -> dict[str, torch.Tensor]:
    """`hf` with per-expert (on-disk) expert weights stacked into transformers' fused in-memory ones."""
    from slime_env.agents.weight_layout import fused

    return fused(hf, {f"model.layers.{i}.mlp.experts.": c.num_experts for i, sparse in enumerate(sparse_layers(c))
                      if sparse})


def per_expert_layout(hf: Mapping[str, torch.Tensor], c: Any) -> dict[str, torch.Tensor]:
    """`hf` with fused expert weights written per expert: the checkpoint layout engines and HF files use
    (`slime_env.agents.weight_layout`, where every weight channel decides it)."""
    from slime_env.agents.weight_layout import per_expert

    return per_expert(hf)


def experts_to_mcore(hf: Mapping[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """One sparse layer's router and experts (fused HF layout) in megatron names, experts numbered globally."""
    h, m = f"model.layers.{layer}.mlp.", f"decoder.layers.{layer}.mlp."
    out = {m + "router.weight": hf[h + "gate.weight"]}
    for e, (gate_up, down) in enumerate(zip(hf[h + "experts.gate_up_proj"], hf[h + "experts.down_proj"])):
        out[f"{m}experts.local_experts.{e}.linear_fc1.weight"] = gate_up  # [gate; up], megatron's fc1 order
        out[f"{m}experts.local_experts.{e}.linear_fc2.weight"] = down
    return out


def experts_to_hf(mc: Mapping[str, torch.Tensor], layer: int, n_experts: int) -> dict[str, torch.Tensor]:
    """Inverse of `experts_to_mcore` (fused HF layout)."""
    h, m = f"model.layers.{layer}.mlp.", f"decoder.layers.{layer}.mlp."
    fc1 = [mc[f"{m}experts.local_experts.{e}.linear_fc1.weight"] for e in range(n_experts)]
    fc2 = [mc[f"{m}experts.local_experts.{e}.linear_fc2.weight"] for e in range(n_experts)]
    return {h + "gate.weight": mc[m + "router.weight"], h + "experts.gate_up_proj": torch.stack(fc1),
            h + "experts.down_proj": torch.stack(fc2)}


def required_hf_keys(c: Any, layer: int) -> list[str]:
    h = f"model.layers.{layer}.mlp."
    return [h + "gate.weight", h + "experts.gate_up_proj", h + "experts.down_proj"]


# --- global <-> one expert-parallel rank's experts -----------------------------------------------------------
def is_expert_param(name: str) -> bool:
    """A parameter of an expert (per-expert or `GroupedExperts`' stacked names, or their LoRA adapters): split over
    EP, not DP."""
    return any(r.match(name) is not None for r in (_LOCAL, _STACKED, _ADAPTER))


def to_grouped(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert megatron names (one rank's experts, numbered from 0) -> `GroupedExperts`' stacked `weight1` /
    `weight2` per layer."""
    out, stacks = {}, {}
    for k, v in state.items():
        hit = _LOCAL.match(k)
        if hit is None:
            out[k] = v
            continue
        which = {".linear_fc1.weight": "1", ".linear_fc2.weight": "2"}[hit.group(3)]
        stacks.setdefault(hit.group(1)[: -len("local_experts.")] + "weight" + which, {})[int(hit.group(2))] = v
    for name, parts in stacks.items():
        out[name] = torch.stack([parts[e] for e in range(len(parts))])
    return out


def from_grouped(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of `to_grouped`."""
    out = {}
    for k, v in state.items():
        hit = _STACKED.match(k)
        if hit is None:
            out[k] = v
            continue
        for e, w in enumerate(v):
            out[f"{hit.group(1)}local_experts.{e}.linear_fc{hit.group(2)}.weight"] = w
    return out


def local_experts(state: Mapping[str, torch.Tensor], n_experts: int, ep_rank: int, ep_size: int
                  ) -> dict[str, torch.Tensor]:
    """`state` (experts numbered globally) keeping only EP rank `ep_rank`'s experts, renumbered from 0."""
    per = n_experts // ep_size
    out = {}
    for k, v in state.items():
        hit = _LOCAL.match(k)
        if hit is None:
            out[k] = v
        elif ep_rank * per <= int(hit.group(2)) < (ep_rank + 1) * per:
            out[f"{hit.group(1)}{int(hit.group(2)) - ep_rank * per}{hit.group(3)}"] = v
    return out


def global_experts(shards: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The expert weights of every EP rank (in rank order, each numbered from 0) numbered globally."""
    out = {}
    for r, shard in enumerate(shards):
        per: dict[str, int] = {}  # experts per layer on this rank
        for k in shard:
            hit = _LOCAL.match(k)
            if hit is not None and hit.group(3) == ".linear_fc1.weight":
                per[hit.group(1)] = per.get(hit.group(1), 0) + 1
        for k, v in shard.items():
            hit = _LOCAL.match(k)
            if hit is not None:
                out[f"{hit.group(1)}{r * per[hit.group(1)] + int(hit.group(2))}{hit.group(3)}"] = v
    return out


def install_moe_patches() -> None:
    """megatron-core 0.16.1's router gating GEMM reads a name (`te_general_gemm`) that its module binds only when
    Transformer Engine imports, so without TE every MoE forward raises NameError; bound to None it takes its own
    plain `torch.mm` path. Idempotent."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
