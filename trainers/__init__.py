"""trainers: from trajectories to gradient steps, at three altitudes.

The maths (small pure functions over tensors):
- `slime_env.trainers.algorithms`: advantage estimators and policy losses; `critic`: PPO's value model.
- `pack`, `TrainBatch`: trajectories -> padded / packed tensors with per-token advantages.

One RL step over pluggable backends (one `step / sft_step / save / load / sync / weights` contract): the step is
written once in `slime_env.trainers.step` (`RLStep`) over its `Backend` Protocol; the backends are
`trainers.backends.torch`, `trainers.backends.fsdp` and `trainers.megatron.backend`, each trainer below one of them
and the step composed (`trainers.trainer.Trainer`):
- `TorchTrainer`, `TrainerConfig`: the reference trainer on a Hugging Face causal LM (CPU or one GPU); the config
  holds each backend's fields beside the RL step's (`MegatronOptions`, `FSDPOptions`).
- `MegatronTrainer`: the same RL step on megatron-core (GPUs, TP x DP x EP, MoE); imported on first use, since
  megatron-core is an optional dependency (`slime_env[megatron]`).
- `FSDPTrainer`: the same RL step on any Hugging Face causal LM sharded with FSDP2 (no conversion).
- `weight_sync`: the weight channels every backend's `sync` and the run push through (engine-bound layout).
- `LoRAOptions`: the `trainer.lora` section (peft on torch / FSDP2, our TP-aware adapters on Megatron).
- `SplitStepTrainer`, `Datum`, `AdamParams`: the split step (`forward_backward` accumulates, `optim_step` applies with
  its own Adam hyper-parameters) that every backend implements and `slime-env serve-tinker` drives.

The training application, `slime_env.trainers.run` (`slime-env train` / `sft` / `report`):
- `TrainConfig`, `train`: the run config and the loop over its roles; `AsyncConfig`: its `async:` section;
  `WarmupConfig`: the SFT warm-up (`warmup:`); `ServerTeacher`, `LocalTeacher`, `make_teacher`: on-policy
  distillation's teachers; `OpponentPool`, `snapshot`: league self-play.

Imports `slime_env` (and `slime_env.agents`), never the reverse.
"""

from slime_env.loading import lazy_exports

_EXPORTS = {
    "TorchTrainer": "slime_env.trainers.torch_trainer", "TrainerConfig": "slime_env.trainers.torch_trainer",
    "MegatronTrainer": "slime_env.trainers.megatron_trainer", "FSDPTrainer": "slime_env.trainers.fsdp_trainer",
    "TrainBatch": "slime_env.trainers.batch", "pack": "slime_env.trainers.batch",
    "TrainConfig": "slime_env.trainers.run.config", "train": "slime_env.trainers.run.loop",
    "OpponentPool": "slime_env.trainers.run.opponent_pool", "snapshot": "slime_env.trainers.run.opponent_pool",
    "AsyncConfig": "slime_env.trainers.run.sources",
    "WarmupConfig": "slime_env.trainers.run.warmup",
    "ServerTeacher": "slime_env.trainers.run.teacher", "LocalTeacher": "slime_env.trainers.run.teacher",
    "make_teacher": "slime_env.trainers.run.teacher",
    "LoRAOptions": "slime_env.trainers.lora",
    "SplitStepTrainer": "slime_env.trainers.split_step", "Datum": "slime_env.trainers.split_step",
    "AdamParams": "slime_env.trainers.split_step",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
