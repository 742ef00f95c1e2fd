"""The split training step: `forward_backward` adds one batch's gradients to those of earlier calls, `optim_step`
applies them with that call's own Adam hyper-parameters and clears them — Tinker's training-client contract, the
entry point `slime-env serve-tinker` drives (`slime_env.trainers.tinker`), beside the trainers' own `step`.

- `Datum`: one sequence (input tokens, the token scored at each position, the loss's per-token inputs).
- `DatumLoss`: a datum's loss from its log-probs; the caller owns the loss (Tinker's are `trainers.tinker.losses`),
  the trainer owns the forward and the gradients.
- `AdamParams`: one `optim_step`'s hyper-parameters, checked (a `ValueError` naming the field).
- `SplitStepTrainer`: the Protocol. Every trainer implements it (full weights or LoRA, `trainers.lora`) through
  `SplitStep`, written once over the trainers' `Backend` (`trainers.step`): `forward_backward` backs each
  micro-batch's loss through `Backend.backward` (FSDP: its sharded gradients), the log-probs come from
  `Backend.datum_logprobs` (Megatron: the data packed as THD sequences), `optim_step` sets the hyper-parameters on
  `Backend.param_groups()` and clips through `Backend.optimizer_step` (Megatron: its own optimizer and gradient
  buffers, the clipping set on its config). Over several ranks every rank calls each method with the same data
  (`serve-tinker` broadcasts them: `trainers.tinker.ranks`) and `Backend.split_share` weights the DP replicas'
  gradients; not under Megatron's pipeline parallel (its schedule would need the loss inside it).

No run import here: a trainer and its caller meet on these types only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

DatumLoss = Callable[[torch.Tensor, Mapping[str, torch.Tensor]], torch.Tensor]
"""(log-probs of a datum's targets [n], differentiable; its `inputs`) -> its loss, a scalar; a call's loss is the sum
over its data."""


@dataclass(frozen=True, slots=True)
class Datum:
    """One sequence: `tokens` [n] (int64) go in, the logits at position p score `targets[p]` ([n], int64; for
    next-token prediction `targets` is `tokens` shifted by one), `inputs` are the loss's per-token tensors ([n] each).
    ValueError naming the field when a shape disagrees."""

    tokens: torch.Tensor
    targets: torch.Tensor
    inputs: Mapping[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.tokens.dim() != 1 or self.tokens.numel() == 0:
            raise ValueError(f"Datum.tokens must be a non-empty 1-D tensor, got shape {list(self.tokens.shape)}")
        n = self.tokens.numel()
        for name, t in {"targets": self.targets, **{f"inputs[{k!r}]": v for k, v in self.inputs.items()}}.items():
            if list(t.shape) != [n]:
                raise ValueError(f"Datum.{name} has shape {list(t.shape)}; tokens has {n} (it needs [{n}])")


@dataclass(frozen=True, slots=True)
class AdamParams:
    """One `optim_step`'s AdamW hyper-parameters (Tinker's `AdamParams`, its defaults); `grad_clip_norm` 0: none."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    def __post_init__(self) -> None:
        for name in ("learning_rate", "eps", "weight_decay", "grad_clip_norm"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"adam_params.{name} must be a finite number >= 0, got {value!r}")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and 0 <= value < 1):
                raise ValueError(f"adam_params.{name} must be in [0, 1), got {value!r}")

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> AdamParams:
        """From a mapping (a request's JSON); unknown keys refused by name."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"adam_params.{unknown[0]}: unknown field; adam_params takes {sorted(known)}")
        return cls(**raw)


@runtime_checkable
class SplitStepTrainer(Protocol):
    """A trainer driven one call at a time (see the module docstring). Calls are made from one thread, in order."""

    def forward(self, data: Sequence[Datum]) -> list[torch.Tensor]:
        """Each datum's log-probs of its `targets` ([n] float32, CPU) under the current weights; no gradient, no
        state changes."""
        ...

    def forward_backward(self, data: Sequence[Datum], loss: DatumLoss) -> tuple[list[torch.Tensor], float]:
        """Each datum's log-probs (as `forward`) and the loss summed over `data`; its gradient is *added* to the
        gradients accumulated since the last `optim_step` (two calls on halves of a batch leave what one call on the
        batch leaves). The weights do not change."""
        ...

    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        """One AdamW step on the accumulated gradients with `adam`'s hyper-parameters (they stay with the optimizer
        until the next call), clipped to `adam.grad_clip_norm` when > 0; then the gradients are zero. Returns
        `grad_norm` (before clipping) and `learning_rate`. A non-finite norm skips the update (it is reported)."""
        ...

    def adapter(self) -> Any:
        """The current LoRA adapter (`slime_env.agents.lora_adapter.LoRAAdapter`, copies): what a weight channel
        pushes to engines (`push_adapter`); LoRA trainers only."""
        ...

    def save(self, path: str | Path) -> Path:
        """A checkpoint under `path`: weights (with LoRA the adapter alone, PEFT's format), optimizer, step."""
        ...

    def load(self, path: str | Path, *, optimizer: bool = True) -> None:
        """Resume from a `save`: the weights, and the optimizer state and step too when `optimizer`."""
        ...
