"""`FusedRMSNorm`: every RMSNorm of our megatron layer spec; one compiled kernel per direction on CUDA.

`torch.nn.RMSNorm` (megatron's choice without apex / Transformer Engine) runs as several elementwise and
reduction kernels on bf16 activations; at 1B parameters the 33 norms of a step cost a few percent of MFU.
And megatron's wrapper of it refuses sequence parallelism. Same math as Hugging Face's `LlamaRMSNorm`:
normalise in fp32, cast back, scale by the weight (eager on CPU). The weight is marked `sequence_parallel`
as the config says, so megatron (and our CPU path) sums its partial gradients over the TP group.
"""

from __future__ import annotations

import torch
from slime_env.trainers.megatron.compiled import lazily_compiled


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


_fused_rms_norm = lazily_compiled(rms_norm)


class FusedRMSNorm(torch.nn.Module):
    """megatron norm-module contract: `(config, hidden_size, eps)`; one parameter, `weight`."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (_fused_rms_norm if x.is_cuda else rms_norm)(x, self.weight, self.eps)
