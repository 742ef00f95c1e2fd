"""The trainers' backends (`slime_env.trainers.step.Backend`): `torch` (one process, a Hugging Face model), `fsdp`
(that model sharded with FSDP2); megatron-core's lives in `slime_env.trainers.megatron.backend`."""
