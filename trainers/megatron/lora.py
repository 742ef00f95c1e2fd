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
MoE experts and routers are not adapted (`plan` refuses them by name).
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

from slime_env.trainers.megatron import moe
from slime_env.trainers.megatron.convert import _qkv, _shard, _split_qkv, attention_dims

# HF projection -> (megatron linear, its block: self_attention / mlp); the fused layers' parts in their row order.
LINEARS = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
           "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}
PARTS = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
         "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
_BLOCK = {"linear_qkv": ("self_attention", "self_attn"), "linear_proj": ("self_attention", "self_attn"),
          "linear_fc1": ("mlp", "mlp"), "linear_fc2": ("mlp", "mlp")}
_EXPERT_NAMES = ("experts", "gate_up_proj", "gate", "router", "shared_expert")


@dataclass(frozen=True)
class Adapted:
    """One megatron linear's adapter: rank, scale (alpha / rank, or alpha / sqrt(rank) with rsLoRA) and the HF
    projections of the (fused) layer it covers, in the layer's row order."""

    rank: int
    scaling: float
    parts: tuple[str, ...]


def plan(options: Any, hf_config: Any) -> dict[str, Adapted]:
    """{megatron linear: Adapted} for `trainer.lora` (`slime_env.trainers.lora.LoRAOptions`) on `hf_config`'s model.
    ValueError naming `lora.<field>` for what this backend does not build: dropout > 0, MoE experts or routers — on an
    MoE model that includes `all-linear` and the MLP names, which peft maps onto the experts' fused weights (its
    `target_parameters`) — and a module other than the seven dense projections."""
    if options.dropout:
        raise ValueError(f"lora.dropout {options.dropout}: the Megatron trainer's adapters have no dropout yet; set "
                         "lora.dropout: 0")
    sparse = moe.sparse_layers(hf_config)
    names = options.target_modules
    if names == "all-linear":
        if any(sparse):
            raise ValueError(f"lora.target_modules: all-linear on {hf_config.model_type} means the MoE experts and "
                             "routers too (peft adapts them), which the Megatron trainer does not adapt yet; list the "
                             "attention projections: [q_proj, k_proj, v_proj, o_proj]")
        names = list(LINEARS)
    elif isinstance(names, str):
        raise ValueError(f"lora.target_modules {names!r}: the Megatron trainer takes 'all-linear' or a list of "
                         f"{list(LINEARS)}")
    for n in names:
        if n in _EXPERT_NAMES or "expert" in n:
            raise ValueError(f"lora.target_modules {n!r}: LoRA on MoE experts and routers is not built for the "
                             f"Megatron trainer yet; it adapts {list(LINEARS)}")
        if n not in LINEARS:
            raise ValueError(f"lora.target_modules {n!r}: the Megatron trainer adapts {list(LINEARS)} (the "
                             "attention and dense MLP projections)")
        if any(sparse) and LINEARS[n] in ("linear_fc1", "linear_fc2"):
            raise ValueError(f"lora.target_modules {n!r} on {hf_config.model_type}: peft adapts the MoE experts under "
                             "this name (their fused gate_up_proj / down_proj), which the Megatron trainer does not "
                             "adapt yet; use the attention projections [q_proj, k_proj, v_proj, o_proj]")
    scaling = options.alpha / (math.sqrt(options.rank) if options.use_rslora else options.rank)
    return {linear: Adapted(options.rank, scaling, tuple(p for p in parts if p in names))
            for linear, parts in PARTS.items() if any(p in names for p in parts)}


def peft_target_modules(adapted: Mapping[str, Adapted]) -> list[str]:
    """The HF projection names of a plan, as PEFT's `target_modules`."""
    return sorted(p for a in adapted.values() for p in a.parts)


# --- the layers ----------------------------------------------------------------------------------------------------
def _adapter(module: torch.nn.Module, adapted: Adapted, a_shape: tuple[int, int], b_shape: tuple[int, int], *,
             sharded: str, partial: str | None) -> None:
    """Registers `lora_A` (zeros: the trainer loads its initial adapter) and `lora_B` (zeros) on `module`; `sharded`
    names the one split over TP (its megatron attributes set as the weight's), `partial` the one whose gradient is a
    partial sum over TP."""
    kw = dict(dtype=module.config.params_dtype,
              device=torch.cuda.current_device() if torch.cuda.is_available() else "cpu")
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
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    return mask.to(device=device, dtype=config.params_dtype)


def adapt_layer_spec(spec: Any, adapted: Mapping[str, Adapted]) -> None:
    """One transformer layer's spec with its attention and (dense) MLP linears adapted as `adapted` says."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    attn = spec.submodules.self_attention.submodules
    if "linear_qkv" in adapted:  # SelfAttention calls this submodule directly, not through build_module
        attn.linear_qkv = functools.partial(LoRAColumnParallelLinear, adapted=adapted["linear_qkv"])
    if "linear_proj" in adapted:
        attn.linear_proj = ModuleSpec(module=LoRARowParallelLinear, params={"adapted": adapted["linear_proj"]})
    mlp = spec.submodules.mlp.submodules
    if getattr(mlp, "experts", None) is not None:  # an MoE layer (`plan` adapts no MLP of an MoE model)
        return
    for name, cls in (("linear_fc1", LoRAColumnParallelLinear), ("linear_fc2", LoRARowParallelLinear)):
        if name in adapted:
            setattr(mlp, name, ModuleSpec(module=cls, params={"adapted": adapted[name]}))


# --- the model's adapters ----------------------------------------------------------------------------------------------
def is_lora_param(name: str) -> bool:
    return name.endswith((".lora_A", ".lora_B"))


def freeze_base(model: torch.nn.Module) -> None:
    """Only the adapters train: every other parameter stops needing a gradient (megatron's DDP and optimizer skip it)."""
    for name, p in model.named_parameters():
        p.requires_grad_(is_lora_param(name))


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
    return f"decoder.layers.{layer}.{_BLOCK[linear][0]}.{linear}.lora_{which}"


def initial_adapter(adapted: Mapping[str, Adapted], hf_config: Any, seed: int) -> dict[str, torch.Tensor]:
    """A fresh adapter in PEFT names, as peft initialises one (A ~ U(-1/sqrt(in), 1/sqrt(in)), its kaiming-uniform;
    B = 0: the function is the base model's), from `seed` alone, so every rank and parallel layout starts from the
    same one. A fused layer's parts share its A."""
    heads, kv, d = attention_dims(hf_config)
    h = hf_config.hidden_size
    ffn = hf_config.intermediate_size
    shapes = {"q_proj": (heads * d, h), "k_proj": (kv * d, h), "v_proj": (kv * d, h), "o_proj": (h, heads * d),
              "gate_proj": (ffn, h), "up_proj": (ffn, h), "down_proj": (h, ffn)}
    out = {}
    for n, (linear, a) in enumerate(sorted(adapted.items())):
        for layer in range(hf_config.num_hidden_layers):
            g = torch.Generator().manual_seed(seed * 1_000_003 + layer * 8 + n)
            fan_in = shapes[a.parts[0]][1]
            bound = 1.0 / math.sqrt(fan_in)
            shared = torch.empty(a.rank, fan_in).uniform_(-bound, bound, generator=g)
            for part in a.parts:
                out[_peft_key(layer, part, "A")] = shared.clone()
                out[_peft_key(layer, part, "B")] = torch.zeros(shapes[part][0], a.rank)
    return out


def from_peft(tensors: Mapping[str, torch.Tensor], adapted: Mapping[str, Adapted], hf_config: Any, *,
              tp_rank: int = 0, tp_size: int = 1) -> dict[str, torch.Tensor]:
    """TP rank `tp_rank`'s adapter parameters (megatron names, layers numbered globally) from a PEFT adapter's tensors.
    ValueError naming the key for a missing tensor, a shape that is not this plan's rank, the parts of a fused
    layer with different A matrices (its one adapter shares A), or a tensor this plan does not adapt."""
    out = {}
    used = set()

    def get(layer: int, part: str, which: str) -> torch.Tensor:
        key = _peft_key(layer, part, which)
        if key not in tensors:
            raise ValueError(f"adapter: {key} is missing (target_modules of this trainer: "
                             f"{peft_target_modules(adapted)})")
        used.add(key)
        return tensors[key].float()

    for linear, a in adapted.items():
        for layer in range(hf_config.num_hidden_layers):
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
    """The adapter in PEFT names from every TP rank's adapter parameters (rank order, layers numbered globally): each
    part of a fused layer gets its A and its rows of B. The inverse of `from_peft`, exactly."""
    out = {}
    for linear, a in adapted.items():
        for layer in range(hf_config.num_hidden_layers):
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

    return config_dict(LoraConfig(r=options.rank, lora_alpha=options.alpha, lora_dropout=0.0,
                                  target_modules=peft_target_modules(adapted), use_rslora=options.use_rslora,
                                  bias="none", task_type="CAUSAL_LM",
                                  base_model_name_or_path=getattr(hf_config, "_name_or_path", None) or None))
