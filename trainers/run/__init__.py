"""run: the training application of `slime-env train` / `slime-env sft` — a thin loop over typed roles.

- `roles`: the contracts — `Engines`, `TrainerGroup`, `WeightChannel`, `BatchSource` (Protocols).
- `config`: `TrainConfig` (the YAML document) and `RunSections` (its sections, parsed once, `cfg.sections`).
- `loop`: `train(cfg)` — the roles built, then `train_step` per step; failure handling in one place.
- `engines` (embedded engine or servers, which weight channel reaches them), `channel` (`ChannelSpec`, `make_channel`:
  the one factory of the run's weight channel), `placement` (this process or Ray placement groups), `trainer_group`
  (the trainer backend here or its ranks as Ray actors or child processes; it owns the channel), `sources` (the async
  modes), `recorder` (metrics, samples, checkpoints, the report), `meter` (engine busy time).
- What a run may add: `evaluation` (held-out split and named eval sets), `warmup` (SFT before RL), `teacher`
  (on-policy distillation), `reward_models`, `scoring` (both applied to a batch), `opponent_pool` (league self-play),
  `report` (`slime-env report`), `data` (split specs).

The weight channels themselves are `slime_env.trainers.weight_sync` (the trainers' `sync` uses them too); config
sections are checked by `slime_env.trainers.config_fields`. Imports the trainer backends, `slime_env.agents` and the
core; nothing below it imports it.
"""

from slime_env.loading import lazy_exports

_EXPORTS = {
    "TrainConfig": "slime_env.trainers.run.config", "RunSections": "slime_env.trainers.run.config",
    "trainer_config": "slime_env.trainers.run.config", "train": "slime_env.trainers.run.loop",
    "train_step": "slime_env.trainers.run.loop", "Run": "slime_env.trainers.run.loop",
    "load_split": "slime_env.trainers.run.data", "make_trainer": "slime_env.trainers.run.trainer_group",
    "Engines": "slime_env.trainers.run.roles", "TrainerGroup": "slime_env.trainers.run.roles",
    "WeightChannel": "slime_env.trainers.run.roles", "BatchSource": "slime_env.trainers.run.roles",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
