"""trainers: from trajectories to gradient steps.

- `trainers.algorithms`: advantage estimators and policy losses as small pure tensor functions.
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
    "TorchTrainer": "trainers.torch_trainer", "TrainerConfig": "trainers.torch_trainer",
    "MegatronTrainer": "trainers.megatron_trainer", "FSDPTrainer": "trainers.fsdp_trainer", "TrainBatch": "trainers.batch", "pack": "trainers.batch",
    "TrainConfig": "trainers.train_loop", "train": "trainers.train_loop",
    "OpponentPool": "trainers.opponent_pool", "snapshot": "trainers.opponent_pool",
    "AsyncConfig": "trainers.asynchrony",
    "WarmupConfig": "trainers.warmup",
    "ServerTeacher": "trainers.teacher", "LocalTeacher": "trainers.teacher", "make_teacher": "trainers.teacher",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports("trainers", _EXPORTS)
