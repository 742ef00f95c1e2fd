"""`FSDPOptions`: the fields of the run config's `trainer:` section that only `FSDPTrainer` reads.

`TrainerConfig` (`slime_env.trainers.torch_trainer`) takes them flat beside the RL step's fields (`trainer: {backend:
fsdp, fsdp_cpu_offload: true}`); `check_fsdp` refuses them, by name, under another backend. FSDP also reads the
shared `dtype` (its compute dtype) and `recompute: full` (each decoder layer checkpointed).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FSDPOptions:
    """Memory placement of `backend: fsdp` (docs/fsdp.md)."""

    # Parameters, gradients and optimizer state in CPU memory between uses.
    fsdp_cpu_offload: bool = False

    def check_fsdp(self, backend: str) -> None:
        if backend == "torch" and self.fsdp_cpu_offload:
            raise ValueError("fsdp_cpu_offload needs backend: fsdp")
