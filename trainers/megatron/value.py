"""`MegatronValueModel`: PPO's critic on megatron-core — the policy's architecture without its LM head, the
final norm and a linear value head on top (replicated across TP ranks: hidden states are whole there).

Same function as `slime_env.trainers.critic.ValueModel` (HF backbone + head) for the same weights (tested), so both
trainers run the same PPO.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.module import MegatronModule


class MegatronValueModel(MegatronModule):
    """forward(input_ids [1, T], packed_seq_params) -> hidden [T, h]; `head(norm(hidden))` gives values."""

    def __init__(self, hf_config: Any, *, tp: int = 1, dtype: torch.dtype = torch.float32, **options):
        from slime_env.trainers.megatron.model import build_gpt
        from slime_env.trainers.megatron.norm import FusedRMSNorm

        gpt = build_gpt(hf_config, tp=tp, dtype=dtype, post_process=False, **options)
        super().__init__(config=gpt.config)
        self.gpt = gpt
        device = next(gpt.parameters()).device
        if torch.cuda.is_available():
            self.norm = FusedRMSNorm(gpt.config, hf_config.hidden_size, eps=hf_config.rms_norm_eps).to(device)
        else:
            self.norm = torch.nn.RMSNorm(hf_config.hidden_size, eps=hf_config.rms_norm_eps, dtype=dtype)
        self.head = torch.nn.Linear(hf_config.hidden_size, 1, dtype=dtype, device=device)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, packed_seq_params: Any) -> torch.Tensor:
        hidden = self.gpt(input_ids=input_ids, position_ids=None, attention_mask=None,
                          packed_seq_params=packed_seq_params)  # [T, 1, h]: no final norm without post_process
        if self.config.sequence_parallel:  # each TP rank holds T / tp rows: the head needs them all
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return hidden.squeeze(1)

    def values(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(hidden)).squeeze(-1).float()
