"""`GroupedExperts`: a layer's local SwiGLU experts as two grouped GEMMs, for megatron's `MoELayer`.

megatron's local spec offers `SequentialMLP` (a Python loop of one MLP per expert: 16 experts of a small model
ran at 0.26x its dense twin's MFU on an H100) or `GroupedMLP`, which needs the `grouped_gemm` package. PyTorch
has the kernel: `torch._grouped_mm` (cuBLAS grouped GEMM, bf16 on Hopper) multiplies every expert's contiguous
block of tokens by its own weight in one launch, with autograd. Elsewhere (CPU, fp32 tests, older GPUs) each
expert's block is one matmul — the same math.

Weights are stacked as transformers stores them: `weight1` [E, 2F, H] (each expert's gate then up rows, as
`gate_up_proj` and megatron's `linear_fc1`), `weight2` [E, H, F]. `moe.to_grouped` / `moe.from_grouped` move
between these and the per-expert names the converter speaks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule


def param_device() -> torch.device | str:
    """Where megatron builds this rank's parameters: its current CUDA device, else the CPU."""
    return torch.cuda.current_device() if torch.cuda.is_available() else "cpu"


def grouped_mm_available(x: torch.Tensor) -> bool:
    """torch._grouped_mm runs here: CUDA, bf16, compute capability 9.0+ (its cuBLAS path)."""
    return (hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device)[0] >= 9)


def mark_expert_param(p: torch.nn.Parameter, dim: int) -> None:
    """What megatron marks on an expert's parameter (`is_expert=True`): its gradient is summed over the
    expert-data-parallel group (`allreduce=False`) — every rank holding these experts, TP ranks included (each routes
    its own share of the tokens under SP) — and it counts in the gradient norm on every TP rank
    (`tensor_model_parallel`). Unmarked, megatron's norm takes it from TP rank 0 alone, while its distributed
    optimizer shards expert gradients over that group: TP rank 1's shard went missing from the norm and the clip."""
    p.allreduce = False
    set_tensor_model_parallel_attributes(p, is_parallel=True, dim=dim, stride=1)


def _grouped(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor | None, counts: list[int] | None
             ) -> torch.Tensor:
    """x [N, K] (rows grouped by expert), w [E, M, K] -> [N, M]: each group times its expert's weight (`offsets`:
    torch._grouped_mm's cumulative group ends, else `counts`: the per-expert loop)."""
    if counts is None:
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
    return torch.cat([part @ w[e].t() for e, part in enumerate(torch.split(x, counts))], dim=0)


class GroupedExperts(MegatronModule):
    """megatron experts contract: `(num_local_experts, config, submodules=None, pg_collection=None)`;
    `forward(hidden [N, H] sorted by expert, tokens_per_expert [E], probs [N]) -> (out [N, H], None)`, where
    out = (silu(gate) * up * prob) @ down for each token's expert. No bias, SwiGLU only, experts not split over TP."""

    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None):
        super().__init__(config=config)
        if config.add_bias_linear or not config.gated_linear_unit or config.activation_func is not F.silu:
            raise ValueError("GroupedExperts implements bias-free SwiGLU experts only")
        if (config.expert_tensor_parallel_size or 1) != 1:
            raise ValueError("GroupedExperts keeps experts whole: expert_tensor_parallel_size must be 1")
        h, f, e = config.hidden_size, config.moe_ffn_hidden_size, num_local_experts
        device = param_device()
        self.num_local_experts = e
        self.weight1 = torch.nn.Parameter(torch.empty(e, 2 * f, h, dtype=config.params_dtype, device=device))
        self.weight2 = torch.nn.Parameter(torch.empty(e, h, f, dtype=config.params_dtype, device=device))
        for w in (self.weight1, self.weight2):
            torch.nn.init.normal_(w, std=config.init_method_std)
            mark_expert_param(w, dim=0)

    def forward(self, hidden: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor):
        fast = grouped_mm_available(hidden)
        offsets = torch.cumsum(tokens_per_expert.to(hidden.device), 0, dtype=torch.int32) if fast else None
        counts = None if fast else [int(n) for n in tokens_per_expert.tolist()]
        gate, up = self.fc(1, hidden, offsets, counts).chunk(2, dim=-1)
        inner = (F.silu(gate) * up * probs.unsqueeze(-1)).to(hidden.dtype)
        return self.fc(2, inner, offsets, counts), None

    def fc(self, which: int, x: torch.Tensor, offsets: torch.Tensor | None, counts: list[int] | None) -> torch.Tensor:
        """fc1 (x [N, H] -> [N, 2F]) or fc2 ([N, F] -> [N, H]) of every token's expert; LoRA adds its branch here."""
        return _grouped(x, self.weight1 if which == 1 else self.weight2, offsets, counts)

    def backward_dw(self) -> None:  # megatron calls it when it splits weight gradients out; ours come with autograd
        return None
