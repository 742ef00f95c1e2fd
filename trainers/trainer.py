"""`Trainer`: a `Backend` and the RL step composed — the public face `TorchTrainer`, `FSDPTrainer` and
`MegatronTrainer` share. It owns no logic: `step` / `sft_step` are `trainers.step.RLStep`'s, `forward` /
`forward_backward` / `optim_step` are `trainers.split_step.SplitStep`'s, everything else is the backend's (its
attributes too: `trainer.model`, `trainer.optimizer`, `trainer.device`, ... read through to it).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from slime_env.trainers.batch import TrainBatch
from slime_env.trainers.split_step import AdamParams, Datum, DatumLoss
from slime_env.trainers.step import Backend, RLStep, SplitStep
from slime_env.trajectory import Trajectory


_OWN = ("backend", "rl", "split")


class Trainer:
    """`backend` driven by one RL step (`RLStep`) and the split step (`SplitStep`)."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.rl = RLStep(backend)
        self.split = SplitStep(backend)

    def __getattr__(self, name: str) -> Any:
        # the backend's own attributes and methods (model, optimizer, device, offload, config, step_count, ...)
        if name in _OWN:
            raise AttributeError(name)
        return getattr(self.backend, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # writes go where reads come from: `trainer.routing_shape = None` or `trainer.config = ...` must change what
        # the backend uses, not shadow it on this object
        if name not in _OWN and not hasattr(type(self), name) and hasattr(self.backend, name):
            setattr(self.backend, name, value)
        else:
            object.__setattr__(self, name, value)

    @property
    def sft_steps(self) -> int:
        """Supervised steps taken (`sft_step`), apart from `step_count`."""
        return self.rl.sft_steps

    # --- the RL step -------------------------------------------------------------------------------------
    def step(self, trajectories: Sequence[Trajectory], group_size: int) -> dict[str, float]:
        """One RL step on groups of `group_size` consecutive trajectories; returns metrics."""
        return self.rl.step(trajectories, group_size)

    def sft_step(self, trajectories: Sequence[Trajectory], *, lr: float | None = None) -> dict[str, float]:
        """One supervised step on `trajectories`' loss-masked tokens (`RLStep.sft_step`)."""
        return self.rl.sft_step(trajectories, lr=lr)

    def logprobs(self, model: Any, batch: TrainBatch, *, with_entropy: bool = False) -> Any:
        """`model`'s [B, L] log-probs of `batch` (and entropies), as the backend computes them."""
        return self.backend.logprobs(model, batch, with_entropy=with_entropy)

    def values(self, batch: TrainBatch) -> torch.Tensor:
        """The critic's [B, L] values (PPO)."""
        return self.backend.values(batch)

    # --- the split step (`slime_env.trainers.split_step.SplitStepTrainer`) -------------------------------------
    def forward(self, data: Sequence[Datum]) -> list[torch.Tensor]:
        """Each datum's log-probs of its targets, no gradient."""
        return self.split.forward(data)

    def forward_backward(self, data: Sequence[Datum], loss: DatumLoss) -> tuple[list[torch.Tensor], float]:
        """Log-probs and the summed `loss`; its gradient accumulates until `optim_step`."""
        return self.split.forward_backward(data, loss)

    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        """AdamW with `adam`'s hyper-parameters on the accumulated gradients, then zero them."""
        return self.split.optim_step(adam)

    # --- checkpoints and weight sync ------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """A checkpoint under `path` (weights or LoRA adapter, optimizer, step, config); every rank calls it."""
        return self.backend.save(path)

    def load(self, path: str | Path, *, optimizer: bool = True) -> None:
        """Resume from a `save` (or an HF folder): the weights, and the optimizer and step when `optimizer`."""
        self.backend.load(path, optimizer=optimizer)

    def weights(self) -> dict[str, torch.Tensor]:
        """The current weights with Hugging Face names (with LoRA the adapter merged in); a collective if sharded."""
        return self.backend.weights()

    def adapter(self) -> Any:
        """The current LoRA adapter (`LoRAAdapter`, PEFT names); LoRA trainers only; a collective if sharded."""
        return self.backend.adapter()

    def save_weights(self, path: str | Path) -> Path:
        """Only the HF model folder an engine loads (with LoRA the merged weights)."""
        return self.backend.save_weights(path)

    def weight_layout(self) -> Any:
        """How these weights reach an engine (`slime_env.agents.weight_layout.WeightLayout`)."""
        return self.backend.weight_layout()

    @property
    def pushes(self) -> bool:
        """Whether this process sends the weights to engines (rank 0 of a sharded trainer)."""
        return self.backend.pushes

    @property
    def syncs_adapter(self) -> bool:
        """Whether a weight sync sends the adapter alone (`trainer.lora.sync: adapter`)."""
        return self.config.lora is not None and self.config.lora.sync == "adapter"

    async def sync(self, policy: Any, *, version: str | None = None, path: str | Path | None = None) -> str:
        """Push the current weights to `policy` through the run's own weight channels (`vllm_sync.channel_for`):
        in place when it has `update_weights` (TransformersPolicy); to an engine server (SGLangPolicy: SGLang or
        serve-engine) through a model folder at `path` and `update_weights_from_disk` when `path` is given, else from
        memory (`update_weights_from_tensor`: CUDA IPC / shared memory, same host); to a vLLM server (`VLLMPolicy`)
        through a model folder and its `reload_weights`. What leaves this process takes the engine-bound layout
        (`weight_layout()`). Every rank of a sharded trainer calls it; rank 0 pushes."""
        from slime_env.trainers.vllm_sync import channel_for
        from slime_env.trainers.weight_sync import push_trainer

        version = version or str(self.step_count)
        channel = channel_for(policy, self.weight_layout(), path=path)
        await push_trainer(self, channel if self.pushes else None, version)  # every rank gathers; rank 0 pushes
        await channel.close()
        return version
