"""`FSDPTrainer`: the RL step (`slime_env.trainers.step`) over an `FSDPBackend` (`slime_env.trainers.backends.fsdp`):
any Hugging Face causal LM sharded with FSDP2 over every rank (slime's `--train-backend fsdp`); docs/fsdp.md.
"""

from __future__ import annotations

import torch

from slime_env.trainers.backends.fsdp import FSDPBackend, decoder_layers
from slime_env.trainers.torch_trainer import TrainerConfig
from slime_env.trainers.trainer import Trainer

__all__ = ["FSDPTrainer", "decoder_layers"]


class FSDPTrainer(Trainer):
    """RL updates of a Hugging Face causal LM sharded with FSDP2.

    `model`: any `AutoModelForCausalLM` in float32, on any device (moved to this rank's device and sharded in
    place). Run one process per GPU under `torchrun` (one process alone needs no launcher); every rank calls
    `step` with the same trajectories, and `save`, `weights`, `sync` too (they gather).
    """

    def __init__(self, model: torch.nn.Module, config: TrainerConfig | None = None, *, pad_id: int):
        super().__init__(FSDPBackend(model, config, pad_id=pad_id))
