"""LoRA on megatron-core's tensor-parallel linear layers: `trainer.lora` with `backend: megatron` (docs/lora.md).

Our own adapters, not Megatron-Bridge's PEFT (`megatron.bridge.peft.lora.LoRA`): megatron-bridge 0.3.1 pins
`transformers<5` (ours is 5.x: pip's resolver refuses the pair) and imports `transformer_engine.pytorch` at module level
in `peft/lora.py` and `peft/lora_layers.py` (its dependency `transformer-engine[core_cu13,pytorch]` is a CUDA-13 build,
and this trainer runs without TE on CPU and GPU alike).

The adapted layers are built into the model by its layer spec (`layer_spec(..., lora=plan)`), so the base weights keep
their megatron names and the converters, checkpoints and reference swaps see the model they always saw:
- `LoRAColumnParallelLinear` (`linear_qkv`, `linear_fc1`): y = W x + s B A x with A [r, in] replicated over TP and
  B [out / TP, r] sharded on the output dimension like W. The branch's own TP collective runs on r-wide activations
  (`A x`): an all-reduce of their gradient, or under sequence parallel an all-gather of the local tokens' `A x`.
- `LoRARowParallelLinear` (`linear_proj`, `linear_fc2`): A [r, in / TP] sharded on the input dimension like W, B
  [out, r] replicated; the rank's partial s B A x is added to its partial W x before the one all-reduce (or
  reduce-scatter) of the base output, so the adapter adds no collective to the forward.
Where an adapter gradient is a partial sum over the TP ranks (B of a row-parallel layer: each rank saw its share of
A x; A of a column-parallel layer under sequence parallel: each rank saw its own tokens) the parameter is marked
`lora_tp_partial` and the trainer sums it over TP once per optimizer step (`sum_partial_grads`).

Fused layers carry one adapter: `linear_qkv` one A shared by q, k and v and B with the fused rows, `linear_fc1` one A
for gate and up. In PEFT's names (`to_peft`) each of q_proj / k_proj / v_proj gets that A and its rows of B, exactly
the same function; a projection not in `target_modules` keeps its rows of B at zero (`rows`, a fixed mask).

Qwen3-MoE (transformers 5 keeps a layer's experts as two 3-D parameters): peft adapts them through its
`target_parameters` (`ParamWrapper`), and so do we, with the same parametrisation:
- `LoRAGroupedExperts` (`experts_fc1` = HF gate_proj + up_proj, `experts_fc2` = down_proj): per local expert e,
  fc(x) = W_e x + s B_e A_e x, A [E, r, in] and B [E, out, r] stacked like `weight1` / `weight2` and computed by the
  same grouped GEMMs (the per-expert loop on CPU). fc1 has rank 2r and alpha 2·alpha: peft fuses gate and up into one
  `gate_up_proj` adapter with that `rank_pattern` / `alpha_pattern`. Split over EP with the experts; their gradients
  are reduced over the expert-data-parallel group (`allreduce = False`, as the base weights).
- `LoRATopKRouter` (`router` = HF `gate`, peft adapts it under all-linear): logits + s B A x in the router's dtype.
In PEFT's names one expert weight is `mlp.experts.lora_A.weight` [E·r, in] (expert e's A its rows e·r…e·r+r-1) and
`lora_B.weight` [out, r·E] (expert e's B its columns e, e+E, …: peft reshapes it to [out, r, E]); with both expert
weights adapted peft nests its wrappers: gate_up_proj's is `mlp.experts.base_layer.lora_*`, down_proj's
`mlp.experts.lora_*`. On an MoE model gate_proj / up_proj / down_proj name the experts (peft's mapping), so a dense
MLP layer of a mixed model (`mlp_only_layers`) stays unadapted, as under peft.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.moe.router import TopKRouter

from slime_env.trainers.megatron import moe
from slime_env.trainers.megatron.convert import _qkv, _shard, _split_qkv, attention_dims
from slime_env.trainers.megatron.grouped_experts import GroupedExperts, _grouped, mark_expert_param, param_device

# HF projection -> (megatron linear, its block: self_attention / mlp); the fused layers' parts in their row order.
LINEARS = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
           "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}
PARTS = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
         "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
_BLOCK = {"linear_qkv": ("self_attention", "self_attn"), "linear_proj": ("self_attention", "self_attn"),
          "linear_fc1": ("mlp", "mlp"), "linear_fc2": ("mlp", "mlp")}
# Qwen3-MoE: peft's HF names (its `target_modules` before its transformers-5 conversion) of the experts and router
MOE_PARTS = {"experts_fc1": ("gate_proj", "up_proj"), "experts_fc2": ("down_proj",), "router": ("gate",)}
_MOE_MODULE = {"experts_fc1": "mlp.experts.fc1", "experts_fc2": "mlp.experts.fc2", "router": "mlp.router"}


@dataclass(frozen=True)
class Adapted:
    """One megatron linear's adapter: rank, scale (alpha / rank, or alpha / sqrt(rank) with rsLoRA) and the HF
    projections of the (fused) layer it covers, in the layer's row order."""

    rank: int
    scaling: float
    parts: tuple[str, ...]


def plan(options: Any, hf_config: Any) -> dict[str, Adapted]:
    """{megatron linear: Adapted} for `trainer.lora` (`slime_env.trainers.lora.LoRAOptions`) on `hf_config`'s model,
    what peft adapts for the same options: on an MoE model gate_proj / up_proj / down_proj are the experts' and
    all-linear takes the router (`gate`) too. ValueError naming `lora.<field>` for what this backend does not build:
    dropout > 0, a module other than these, gate_proj without up_proj on an MoE model (peft refuses it too)."""
    if options.dropout:
        raise ValueError(f"lora.dropout {options.dropout}: the Megatron trainer's adapters have no dropout yet; set "
                         "lora.dropout: 0")
    sparse = any(moe.sparse_layers(hf_config))
    known = list(LINEARS) + (["gate"] if sparse else [])
    names = options.target_modules
    if names == "all-linear":
        names = known
    elif isinstance(names, str):
        raise ValueError(f"lora.target_modules {names!r}: the Megatron trainer takes 'all-linear' or a list of {known}")
    for n in names:
        if n not in known:
            where = (f" (on {hf_config.model_type} gate_proj / up_proj / down_proj are the experts' and gate the "
                     "router's, peft's names)") if sparse else " (the attention and dense MLP projections)"
            raise ValueError(f"lora.target_modules {n!r}: the Megatron trainer adapts {known}{where}")
    parts_of = PARTS
    if sparse:
        parts_of = {k: PARTS[k] for k in ("linear_qkv", "linear_proj")} | MOE_PARTS
        fused = [p for p in MOE_PARTS["experts_fc1"] if p in names]
        if len(fused) == 1:
            raise ValueError(f"lora.target_modules {fused[0]!r} on {hf_config.model_type}: the experts' gate and up "
                             "rows are one weight (gate_up_proj): list gate_proj and up_proj together, as peft needs")
    out = {}
    for linear, parts in parts_of.items():
        chosen = tuple(p for p in parts if p in names)
        if chosen:  # peft's fused expert weight: rank and alpha times its parts (its rank_pattern / alpha_pattern)
            k = len(chosen) if linear == "experts_fc1" else 1
            rank, alpha = options.rank * k, options.alpha * k
            out[linear] = Adapted(rank, alpha / (math.sqrt(rank) if options.use_rslora else rank), chosen)
    return out


def peft_target_modules(adapted: Mapping[str, Adapted]) -> list[str]:
    """The HF projection names of a plan, as PEFT's `target_modules`."""
    return sorted(p for a in adapted.values() for p in a.parts)


# --- the layers ----------------------------------------------------------------------------------------------------
def _adapter(module: torch.nn.Module, adapted: Adapted, a_shape: tuple[int, int], b_shape: tuple[int, int], *,
             sharded: str, partial: str | None) -> None:
    """Registers `lora_A` (zeros: the trainer loads its initial adapter) and `lora_B` (zeros) on `module`; `sharded`
    names the one split over TP (its megatron attributes set as the weight's), `partial` the one whose gradient is a
    partial sum over TP."""
    kw = dict(dtype=module.config.params_dtype, device=param_device())
    module.lora = adapted
    module.lora_on = True
    module.lora_A = torch.nn.Parameter(torch.zeros(*a_shape, **kw))
    module.lora_B = torch.nn.Parameter(torch.zeros(*b_shape, **kw))
    set_tensor_model_parallel_attributes(getattr(module, f"lora_{sharded}"), True, 0 if sharded == "B" else 1, 1)
    if partial is not None:
        getattr(module, f"lora_{partial}").lora_tp_partial = True


class LoRAColumnParallelLinear(ColumnParallelLinear):
    """`ColumnParallelLinear` (W [out / TP, in]) plus s·B·A, A [r, in] replicated, B [out / TP, r] (module
    docstring). `adapted.parts` not all of the fused layer's: the other parts' rows of B stay zero."""

    def __init__(self, input_size: int, output_size: int, *, adapted: Adapted, **kw):
        super().__init__(input_size, output_size, **kw)
        if self.gather_output or self.explicit_expert_comm:
            raise ValueError("LoRA adapts column-parallel layers that keep their output sharded (no experts)")
        _adapter(self, adapted, (adapted.rank, input_size), (self.output_size_per_partition, adapted.rank),
                 sharded="B", partial="A" if self.sequence_parallel else None)
        rows = _row_mask(self.config, kw.get("tp_comm_buffer_name"), adapted.parts, self.output_size_per_partition)
        self.register_buffer("lora_rows", rows, persistent=False)

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None):
        out, bias = super().forward(input_, weight, runtime_gather_output)
        if not self.lora_on:
            return out, bias
        h = F.linear(input_, self.lora_A)  # [s, b, r]: the adapter's TP collective on r-wide activations
        h = gather_from_sequence_parallel_region(h, group=self.tp_group) if self.sequence_parallel else \
            copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        b = self.lora_B if self.lora_rows is None else self.lora_B * self.lora_rows
        return out + self.lora.scaling * F.linear(h, b), bias


class LoRARowParallelLinear(RowParallelLinear):
    """`RowParallelLinear` (W [out, in / TP]) plus s·B·A, A [r, in / TP], B [out, r] replicated, the adapter's partial
    output reduced with the base's (module docstring)."""

    def __init__(self, input_size: int, output_size: int, *, adapted: Adapted, **kw):
        super().__init__(input_size, output_size, **kw)
        if not self.input_is_parallel or self.explicit_expert_comm:
            raise ValueError("LoRA adapts row-parallel layers whose input is already split (no experts)")
        _adapter(self, adapted, (adapted.rank, self.input_size_per_partition), (output_size, adapted.rank),
                 sharded="A", partial="B")

    def forward(self, input_: torch.Tensor):
        if not self.lora_on:
            return super().forward(input_)
        # RowParallelLinear.forward's matmul and reduction, with the adapter's partial sum added in between
        partial = self._forward_impl(input=input_, weight=self.weight, bias=None,
                                     gradient_accumulation_fusion=self.gradient_accumulation_fusion,
                                     allreduce_dgrad=False, sequence_parallel=False, tp_group=None,
                                     grad_output_buffer=None)
        partial = partial + self.lora.scaling * F.linear(F.linear(input_, self.lora_A), self.lora_B)
        out = reduce_scatter_to_sequence_parallel_region(partial, group=self.tp_group) if self.sequence_parallel \
            else reduce_from_tensor_model_parallel_region(partial, group=self.tp_group)
        if self.skip_bias_add:
            return out, self.bias
        return (out + self.bias if self.bias is not None else out), None


class LoRAGroupedExperts(GroupedExperts):
    """`GroupedExperts` plus s·B_e·A_e on fc1 and / or fc2 of every local expert e (module docstring), A [E, r, in] and
    B [E, out, r], through the same grouped GEMMs (torch._grouped_mm on CUDA when r keeps its 16-byte alignment)."""

    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None, *,
                 adapted: Mapping[str, Adapted]):
        super().__init__(num_local_experts, config, submodules, pg_collection)
        h, f, e = config.hidden_size, config.moe_ffn_hidden_size, num_local_experts
        kw = dict(dtype=config.params_dtype, device=param_device())
        self.lora_on = True
        for linear, a in adapted.items():
            fan_in, fan_out = (h, 2 * f) if linear == "experts_fc1" else (f, h)
            branch = torch.nn.Module()
            branch.lora = a
            branch.lora_A = torch.nn.Parameter(torch.zeros(e, a.rank, fan_in, **kw))
            branch.lora_B = torch.nn.Parameter(torch.zeros(e, fan_out, a.rank, **kw))
            for p in (branch.lora_A, branch.lora_B):
                mark_expert_param(p, dim=0)  # as the experts' weights
            self.add_module(linear.removeprefix("experts_"), branch)

    def fc(self, which: int, x: torch.Tensor, offsets: torch.Tensor | None, counts: list[int] | None) -> torch.Tensor:
        out = super().fc(which, x, offsets, counts)
        branch = getattr(self, f"fc{which}", None)
        if branch is None or not self.lora_on:
            return out
        if offsets is not None and branch.lora.rank % 8:  # cuBLAS grouped GEMM needs 16-byte aligned strides
            counts = torch.diff(offsets, prepend=offsets.new_zeros(1)).tolist()
            offsets = None
        h = _grouped(x, branch.lora_A, offsets, counts)
        return out + branch.lora.scaling * _grouped(h, branch.lora_B, offsets, counts).to(out.dtype)


class LoRATopKRouter(TopKRouter):
    """megatron's `TopKRouter` (logits = W x, W [E, H]) plus s·B·A x, A [r, H], B [E, r], in the router's dtype;
    replicated like W (the same `sequence_parallel` mark: under SP each TP rank's gradient is its tokens' share)."""

    def __init__(self, config, pg_collection=None, *, adapted: Adapted):
        super().__init__(config=config, pg_collection=pg_collection)
        kw = dict(dtype=config.params_dtype, device=param_device())
        self.lora = adapted
        self.lora_on = True
        self.lora_A = torch.nn.Parameter(torch.zeros(adapted.rank, config.hidden_size, **kw))
        self.lora_B = torch.nn.Parameter(torch.zeros(config.num_moe_experts, adapted.rank, **kw))
        for p in (self.lora_A, self.lora_B):
            p.sequence_parallel = config.sequence_parallel

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        logits = super().gating(input)
        if not self.lora_on:
            return logits
        h = F.linear(input.to(logits.dtype), self.lora_A.to(logits.dtype))
        return logits + self.lora.scaling * F.linear(h, self.lora_B.to(logits.dtype))


def _row_mask(config: Any, layer: str | None, parts: tuple[str, ...], rows: int) -> torch.Tensor | None:
    """[rows, 1] ones on this TP rank's rows of the adapted parts of a fused layer (`linear_qkv`: per local KV group
    its query heads, key, value; `linear_fc1`: [gate; up]), None when every part is adapted."""
    every = PARTS["linear_qkv" if layer == "qkv" else "linear_fc1"]
    if set(every) <= set(parts) or layer not in ("qkv", "fc1"):
        return None
    if layer == "qkv":
        d, per_group = config.kv_channels, config.num_attention_heads // config.num_query_groups
        sizes = (per_group * d, d, d)
    else:
        sizes = (rows // 2, rows // 2)
    block = torch.cat([torch.full((n, 1), float(p in parts)) for p, n in zip(every, sizes)])
    mask = block.repeat(rows // block.shape[0], 1)
    return mask.to(device=param_device(), dtype=config.params_dtype)


def adapt_layer_spec(spec: Any, adapted: Mapping[str, Adapted]) -> None:
    """One transformer layer's spec with its attention and (dense) MLP linears adapted as `adapted` says."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    attn = spec.submodules.self_attention.submodules
    if "linear_qkv" in adapted:  # SelfAttention calls this submodule directly, not through build_module
        attn.linear_qkv = functools.partial(LoRAColumnParallelLinear, adapted=adapted["linear_qkv"])
    if "linear_proj" in adapted:
        attn.linear_proj = ModuleSpec(module=LoRARowParallelLinear, params={"adapted": adapted["linear_proj"]})
    mlp = spec.submodules.mlp.submodules
    if getattr(mlp, "experts", None) is not None:  # an MoE layer: its experts and router (`plan`'s MoE names)
        if "router" in adapted:  # MoELayer calls this submodule directly, not through build_module
            mlp.router = functools.partial(LoRATopKRouter, adapted=adapted["router"])
        experts = {k: a for k, a in adapted.items() if k.startswith("experts_")}
        if experts:
            module = getattr(mlp.experts, "module", None)
            if not (isinstance(module, type) and issubclass(module, GroupedExperts)):  # a shared spec: adapted once
                raise ValueError("LoRA on MoE experts adapts GroupedExperts: set trainer.moe_grouped_gemm: true")
            mlp.experts = ModuleSpec(module=LoRAGroupedExperts, params={"adapted": experts})
        return
    for name, cls in (("linear_fc1", LoRAColumnParallelLinear), ("linear_fc2", LoRARowParallelLinear)):
        if name in adapted:
            setattr(mlp, name, ModuleSpec(module=cls, params={"adapted": adapted[name]}))


# --- the model's adapters ---------------------------------------------------------------------------------------------
def is_lora_param(name: str) -> bool:
    return name.endswith((".lora_A", ".lora_B"))


def freeze_base(model: torch.nn.Module) -> None:
    """Only the adapters train: every other parameter stops needing a gradient
    (megatron's DDP and optimizer skip it)."""
    for name, p in model.named_parameters():
        p.requires_grad_(is_lora_param(name))


def inputs_need_grad(model: torch.nn.Module) -> None:
    """Under megatron's activation recompute (a reentrant checkpoint: a chunk whose inputs need no gradient returns
    outputs that need none, so the adapters inside it would get none) the frozen embedding's output is made to need a
    gradient, as peft's `enable_input_require_grads` does for transformers' checkpointing."""
    embedding = getattr(model, "embedding", None)  # the first pipeline stage's; later stages receive graded inputs
    if embedding is not None:
        embedding.register_forward_hook(lambda module, args, out: out.requires_grad_(True))


def lora_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's adapter parameters (this rank's shards, megatron names)."""
    return {k: p for k, p in model.named_parameters() if is_lora_param(k)}


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module) -> Iterator[None]:
    """Within: the base model (every adapter skipped), the reference policy of a KL term without a second copy."""
    layers = [m for m in model.modules() if hasattr(m, "lora_on")]
    for m in layers:
        m.lora_on = False
    try:
        yield
    finally:
        for m in layers:
            m.lora_on = True


def sum_partial_grads(model: torch.nn.Module, group: Any) -> None:
    """Sum over TP `group` the gradients that are partial sums there (`lora_tp_partial`); megatron DDP's `main_grad`
    where it keeps one. One coalesced all-reduce."""
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    grads = [getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad
             for p in model.parameters() if getattr(p, "lora_tp_partial", False) and p.requires_grad]
    grads = [g for g in grads if g is not None]
    if not grads or group is None:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


# --- PEFT names <-> megatron ----------------------------------------------------------------------------------------
def _peft_key(layer: int, part: str, which: str) -> str:
    block = _BLOCK[LINEARS[part]][1]
    return f"base_model.model.model.layers.{layer}.{block}.{part}.lora_{which}.weight"


def _mcore_key(layer: int, linear: str, which: str) -> str:
    if linear in _MOE_MODULE:
        return f"decoder.layers.{layer}.{_MOE_MODULE[linear]}.lora_{which}"
    return f"decoder.layers.{layer}.{_BLOCK[linear][0]}.{linear}.lora_{which}"


def _moe_peft_key(layer: int, linear: str, which: str, adapted: Mapping[str, Adapted]) -> str:
    """peft's saved name of an expert weight's or the router's adapter (module docstring: nested expert wrappers)."""
    module = {"router": "gate", "experts_fc2": "experts"}.get(linear) or \
        ("experts.base_layer" if "experts_fc2" in adapted else "experts")
    return f"base_model.model.model.layers.{layer}.mlp.{module}.lora_{which}.weight"


def _moe_dims(linear: str, c: Any) -> tuple[int, int, int]:
    """(experts, in, out) of an MoE adapter's weight (1 expert: the router)."""
    return {"experts_fc1": (c.num_experts, c.hidden_size, 2 * c.moe_intermediate_size),
            "experts_fc2": (c.num_experts, c.moe_intermediate_size, c.hidden_size),
            "router": (1, c.hidden_size, c.num_experts)}[linear]


def _moe_layers(adapted: Mapping[str, Adapted], hf_config: Any) -> list[tuple[int, str, Adapted]]:
    sparse = moe.sparse_layers(hf_config)
    return [(layer, linear, a) for linear, a in adapted.items() if linear in MOE_PARTS
            for layer in range(hf_config.num_hidden_layers) if sparse[layer]]


def initial_adapter(adapted: Mapping[str, Adapted], hf_config: Any, seed: int) -> dict[str, torch.Tensor]:
    """A fresh adapter in PEFT names, as peft initialises one (A ~ U(-1/sqrt(in), 1/sqrt(in)), its kaiming-uniform;
    B = 0: the function is the base model's), from `seed` alone, so every rank and parallel layout starts from the
    same one. A fused layer's parts share its A."""
    heads, kv, d = attention_dims(hf_config)
    h = hf_config.hidden_size
    ffn = getattr(hf_config, "intermediate_size", None)
    shapes = {"q_proj": (heads * d, h), "k_proj": (kv * d, h), "v_proj": (kv * d, h), "o_proj": (h, heads * d),
              "gate_proj": (ffn, h), "up_proj": (ffn, h), "down_proj": (h, ffn)}
    moe_layers = _moe_layers(adapted, hf_config)
    out = {}
    for n, (linear, a) in enumerate(sorted(adapted.items())):
        for layer in range(hf_config.num_hidden_layers):
            g = torch.Generator().manual_seed(seed * 1_000_003 + layer * 8 + n)
            if linear in MOE_PARTS:
                if (layer, linear, a) in moe_layers:  # peft's [E * r, in] and [out, r * E]
                    e, fan_in, fan_out = _moe_dims(linear, hf_config)
                    bound = 1.0 / math.sqrt(fan_in)
                    out[_moe_peft_key(layer, linear, "A", adapted)] = \
                        torch.empty(e * a.rank, fan_in).uniform_(-bound, bound, generator=g)
                    out[_moe_peft_key(layer, linear, "B", adapted)] = torch.zeros(fan_out, a.rank * e)
                continue
            fan_in = shapes[a.parts[0]][1]
            bound = 1.0 / math.sqrt(fan_in)
            shared = torch.empty(a.rank, fan_in).uniform_(-bound, bound, generator=g)
            for part in a.parts:
                out[_peft_key(layer, part, "A")] = shared.clone()
                out[_peft_key(layer, part, "B")] = torch.zeros(shapes[part][0], a.rank)
    return out


def from_peft(tensors: Mapping[str, torch.Tensor], adapted: Mapping[str, Adapted], hf_config: Any, *,
              tp_rank: int = 0, tp_size: int = 1, ep_rank: int = 0, ep_size: int = 1) -> dict[str, torch.Tensor]:
    """TP rank `tp_rank`'s (and EP rank `ep_rank`'s local experts') adapter parameters (megatron names, layers
    numbered globally) from a PEFT adapter's tensors. ValueError naming the key for a missing tensor, a shape that is
    not this plan's, the parts of a fused layer with different A matrices (its one adapter shares A), or a tensor
    this plan does not adapt."""
    out = {}
    used = set()

    def get(layer: int, part: str, which: str, key: str | None = None) -> torch.Tensor:
        key = key or _peft_key(layer, part, which)
        if key not in tensors:
            raise ValueError(f"adapter: {key} is missing (target_modules of this trainer: "
                             f"{peft_target_modules(adapted)})")
        used.add(key)
        return tensors[key].float()

    for layer, linear, a in _moe_layers(adapted, hf_config):
        e, fan_in, fan_out = _moe_dims(linear, hf_config)
        A, B = (get(layer, "", w, _moe_peft_key(layer, linear, w, adapted)) for w in "AB")
        if A.shape != (e * a.rank, fan_in) or B.shape != (fan_out, a.rank * e):
            raise ValueError(f"adapter: {_moe_peft_key(layer, linear, 'A', adapted)} and lora_B are "
                             f"{tuple(A.shape)} and {tuple(B.shape)}, this trainer's (rank {a.rank}, {e} experts) are "
                             f"{(e * a.rank, fan_in)} and {(fan_out, a.rank * e)}")
        if linear != "router":  # per expert: [E, r, in] and [E, out, r], this EP rank's experts
            per = e // ep_size
            A = A.reshape(e, a.rank, fan_in)[ep_rank * per:(ep_rank + 1) * per]
            B = B.reshape(fan_out, a.rank, e).permute(2, 0, 1)[ep_rank * per:(ep_rank + 1) * per]
        out[_mcore_key(layer, linear, "A")], out[_mcore_key(layer, linear, "B")] = A, B.contiguous()
    for linear, a in adapted.items():
        for layer in range(hf_config.num_hidden_layers if linear not in MOE_PARTS else 0):
            As = [get(layer, p, "A") for p in a.parts]
            for p, other in zip(a.parts[1:], As[1:]):
                if not torch.equal(other, As[0]):
                    raise ValueError(f"adapter: {_peft_key(layer, p, 'A')} differs from {a.parts[0]}'s: the Megatron "
                                     f"trainer's fused {linear} has one A for {list(a.parts)}")
            if As[0].shape[0] != a.rank:
                raise ValueError(f"adapter: {_peft_key(layer, a.parts[0], 'A')} has rank {As[0].shape[0]}, "
                                 f"trainer.lora.rank is {a.rank}")
            Bs = {p: get(layer, p, "B") for p in a.parts}
            if linear == "linear_qkv":
                heads, kv, d = attention_dims(hf_config)
                full = [Bs.get(p, torch.zeros(rows, a.rank)) for p, rows in
                        zip(PARTS[linear], (heads * d, kv * d, kv * d))]
                A, B = As[0], _shard(_qkv(*full, hf_config), 0, tp_rank, tp_size)
            elif linear == "linear_fc1":
                ffn = hf_config.intermediate_size
                A = As[0]
                B = torch.cat([_shard(Bs.get(p, torch.zeros(ffn, a.rank)), 0, tp_rank, tp_size)
                               for p in PARTS[linear]])
            else:  # row-parallel: A split on its input dimension
                A, B = _shard(As[0], 1, tp_rank, tp_size), Bs[a.parts[0]]
            out[_mcore_key(layer, linear, "A")], out[_mcore_key(layer, linear, "B")] = A, B
    extra = sorted(k for k in tensors if k not in used)
    if extra:
        raise ValueError(f"adapter: {extra[0]} is not adapted by this trainer (target_modules "
                         f"{peft_target_modules(adapted)})")
    return out


def to_peft(shards: list[Mapping[str, torch.Tensor]], adapted: Mapping[str, Adapted], hf_config: Any
            ) -> dict[str, torch.Tensor]:
    """The adapter in PEFT names from every TP rank's adapter parameters (rank order, layers numbered globally, every
    expert in the first shard: the EP ranks' joined): each part of a fused layer gets its A and its rows of B. The
    inverse of `from_peft`, exactly."""
    out = {}
    for layer, linear, a in _moe_layers(adapted, hf_config):
        A, B = shards[0][_mcore_key(layer, linear, "A")], shards[0][_mcore_key(layer, linear, "B")]
        if linear != "router":  # peft's [E * r, in] and [out, r * E]
            A, B = A.reshape(-1, A.shape[-1]), B.permute(1, 2, 0).reshape(B.shape[1], -1)
        out[_moe_peft_key(layer, linear, "A", adapted)] = A.detach().clone()
        out[_moe_peft_key(layer, linear, "B", adapted)] = B.detach().clone()
    for linear, a in adapted.items():
        for layer in range(hf_config.num_hidden_layers if linear not in MOE_PARTS else 0):
            As = [sh[_mcore_key(layer, linear, "A")] for sh in shards]
            Bs = [sh[_mcore_key(layer, linear, "B")] for sh in shards]
            if linear == "linear_qkv":
                A, B = As[0], dict(zip(PARTS[linear], _split_qkv(torch.cat(Bs), hf_config)))
            elif linear == "linear_fc1":
                gates, ups = zip(*(b.chunk(2) for b in Bs))
                A, B = As[0], {"gate_proj": torch.cat(gates), "up_proj": torch.cat(ups)}
            else:
                A, B = torch.cat(As, dim=1), {a.parts[0]: Bs[0]}
            for p in a.parts:
                out[_peft_key(layer, p, "A")] = A.detach().clone()
                out[_peft_key(layer, p, "B")] = B[p].detach().clone()
    return out


def peft_config(options: Any, adapted: Mapping[str, Adapted], hf_config: Any) -> dict[str, Any]:
    """PEFT's adapter_config.json for this adapter (what `peft.PeftModel.from_pretrained`, SGLang and vLLM read)."""
    from peft import LoraConfig

    from slime_env.agents.lora_adapter import config_dict

    config = LoraConfig(r=options.rank, lora_alpha=options.alpha, lora_dropout=0.0,
                        target_modules=peft_target_modules(adapted), use_rslora=options.use_rslora, bias="none",
                        task_type="CAUSAL_LM",
                        base_model_name_or_path=getattr(hf_config, "_name_or_path", None) or None)
    if any(linear in MOE_PARTS for linear in adapted):
        # peft's own transformers-5 conversion (what `get_peft_model` does to the torch trainer's config): the expert
        # and router names become `target_parameters`, the fused gate_up_proj gets its rank and alpha patterns. It
        # reads the model's config alone for a list of names.
        import types

        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers

        convert_peft_config_for_transformers(config, types.SimpleNamespace(config=hf_config), None)
    return config_dict(config)
