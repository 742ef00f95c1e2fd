"""trainers: from trajectories to gradient steps.

- `slime_env.trainers.algorithms`: advantage estimators and policy losses as small pure tensor functions.
- `pack`, `TrainBatch`: trajectories -> padded / packed tensors with per-token advantages.
- `TorchTrainer`, `TrainerConfig`: the reference trainer on a Hugging Face causal LM (CPU or one GPU).
- `MegatronTrainer`: the same RL step on megatron-core (GPUs, TP x DP x EP, MoE); imported on first use, since
  megatron-core is an optional dependency (`slime_env[megatron]`).
- `FSDPTrainer`: the same RL step on any Hugging Face causal LM sharded with FSDP2 (no conversion).
- `OpponentPool`, `snapshot`: frozen past policies as opponents (league self-play in multi-agent envs).
- `TrainConfig`, `train`: `slime-env train`; `AsyncConfig`: its `async:` section (overlap / fully asynchronous).
- `WarmupConfig`: the SFT warm-up before RL (`warmup:`; `slime-env sft`); `ServerTeacher`, `LocalTeacher`,
  `make_teacher`: on-policy distillation's teachers (`teacher:`, `trainer.opd_coef`).

Imports `slime_env`, never the reverse.
"""

from slime_env.loading import lazy_exports

_EXPORTS = {
    "TorchTrainer": "slime_env.trainers.torch_trainer", "TrainerConfig": "slime_env.trainers.torch_trainer",
    "MegatronTrainer": "slime_env.trainers.megatron_trainer", "FSDPTrainer": "slime_env.trainers.fsdp_trainer", "TrainBatch": "slime_env.trainers.batch", "pack": "slime_env.trainers.batch",
    "TrainConfig": "slime_env.trainers.train_loop", "train": "slime_env.trainers.train_loop",
    "OpponentPool": "slime_env.trainers.opponent_pool", "snapshot": "slime_env.trainers.opponent_pool",
    "AsyncConfig": "slime_env.trainers.asynchrony",
    "WarmupConfig": "slime_env.trainers.warmup",
    "ServerTeacher": "slime_env.trainers.teacher", "LocalTeacher": "slime_env.trainers.teacher", "make_teacher": "slime_env.trainers.teacher",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
