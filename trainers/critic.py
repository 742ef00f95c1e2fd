"""`ValueModel`: PPO's critic for `TorchTrainer` — a copy of the policy's backbone with a linear value head.

Values are aligned like log-probs: `values[:, t]` is V of the state before token t, read from the hidden
state at t - 1, so GAE pairs each generated token with the value of the context it was sampled in. The
head starts at zero (V = 0): the first updates learn the returns' scale without disturbing the backbone.
"""

from __future__ import annotations

import copy

import torch
from slime_env.trainers.batch import TrainBatch


class ValueModel(torch.nn.Module):
    """V(s_t) for the response columns of a `TrainBatch`, from a Hugging Face causal LM's backbone (copied)."""

    def __init__(self, causal_lm: torch.nn.Module):
        super().__init__()
        self.backbone = copy.deepcopy(causal_lm.base_model)
        hidden = causal_lm.config.hidden_size
        self.head = torch.nn.Linear(hidden, 1, dtype=next(self.backbone.parameters()).dtype)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, batch: TrainBatch, device: torch.device) -> torch.Tensor:
        """[B, L] values (0 outside the trailing response columns)."""
        B, L = batch.input_ids.shape
        r = min(batch.response_columns(), L - 1)
        values = torch.zeros((B, L), dtype=torch.float32, device=device)
        if r > 0:
            h = self.backbone(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                              position_ids=batch.position_ids.to(device)).last_hidden_state
            values[:, L - r:] = self.head(h[:, L - r - 1:-1]).squeeze(-1).float()
        return values
