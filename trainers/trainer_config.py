"""`TrainerConfig`: the run config's `trainer:` section, the options every backend reads (its own fields
beside: `MegatronOptions`, `FSDPOptions`). Its own module so that the step and the backends can import it without
importing a trainer class."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from slime_env.trainers import algorithms as alg
from slime_env.trainers.fsdp_options import FSDPOptions
from slime_env.trainers.megatron.options import MegatronOptions

BACKENDS = ("torch", "megatron", "fsdp")


@dataclass
class TrainerConfig(MegatronOptions, FSDPOptions):
    """The run config's `trainer:` section: what one RL step does (the fields here; defaults: GRPO, DAPO clip
    (0.2 / 0.28), token-mean, no KL, one update), which backend runs it, and that backend's own fields, which live
    with it (`slime_env.trainers.megatron.options.MegatronOptions`, `slime_env.trainers.fsdp_options.FSDPOptions`)
    and are taken flat, as the YAML writes them. A field of another backend than `backend` is refused by name."""

    estimator: str = "grpo"
    # "rl": the policy-gradient loss of `estimator`; "sft": the negative log-likelihood of the loss-masked tokens
    # (supervised fine-tuning on trajectories or rendered conversations; `sft_step` runs one without changing this).
    loss: str = "rl"
    # On-policy distillation (slime's --use-opd): the advantages get -opd_coef * (log p_student - log p_teacher) per
    # token; the teacher's log-probs ride on each trajectory (metadata["teacher_logprobs"],
    # slime_env.trainers.run.teacher).
    opd_coef: float = 0.0
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = 1.0
    micro_batch_size: int = 4
    n_minibatches: int = 1
    ppo_epochs: int = 1
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = None
    kl_coef: float = 0.0
    kl_kind: str = "low_var_kl"
    entropy_coef: float = 0.0
    use_tis: bool = False
    tis_cap: float = 2.0
    # Off-policy correction against the engine's log-probs (slime_env.trainers.algorithms.off_policy_weights): "auto"
    # is "tis" when the run is asynchronous (its RunSections resolve it) and otherwise none (or the legacy `use_tis`
    # above); "none" | "tis" | "mis" | "decoupled" (AReaL's decoupled PPO: proximal = the step's recomputed log-probs).
    off_policy: str = "auto"
    off_policy_level: str = "token"
    off_policy_low: float = 0.5
    off_policy_high: float = 2.0
    reduction: str = "token_mean"
    reward_assignment: str = "sequence"
    # PPO (estimator: ppo): the critic's learning rate, value clipping (None: off), GAE's gamma and lambda.
    critic_lr: float = 1e-5
    value_clip: float | None = 0.2
    gamma: float = 1.0
    lam: float = 0.95
    # RAE (estimator: rae, multi-agent self-play): the decay of the running (game, role) baselines.
    rae_decay: float = 0.95
    # Which trainer runs the step: "torch" (TorchTrainer), "megatron" (MegatronTrainer) or "fsdp" (FSDPTrainer:
    # TorchTrainer's step on FSDP2-sharded HF models). Each backend's own fields are its options' (`MegatronOptions`,
    # `FSDPOptions`); the two below are both sharded backends': the parameter / compute dtype ("auto": bfloat16 on
    # CUDA, float32 on CPU) and activation recompute ("none" | "selective": megatron's recompute_modules, default the
    # core attention | "full": megatron keeps only the input of every `recompute_layers` layers, FSDP checkpoints
    # each decoder layer).
    backend: str = "torch"
    dtype: str = "auto"
    recompute: str = "none"
    # LoRA (`slime_env.trainers.lora.LoRAOptions`, docs/lora.md): {rank, alpha, dropout, target_modules, ...}; only
    # the adapter is trained, the reference policy of a KL term is the base model (adapter off), a sync sends the
    # adapter alone, a checkpoint holds it in PEFT's format. None: full fine-tuning.
    lora: Any = None
    # MoE routing replay (R3): "rollout" replays the engine's routed experts of the generated tokens in the training
    # forward (slime_env.trainers.routing_replay); "off": the trainer routes every token itself.
    routing_replay: str = "off"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r}: 'torch', 'megatron' or 'fsdp'")
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"recompute {self.recompute!r}: 'none', 'selective' or 'full'")
        self.check_megatron(self.backend, self.estimator, self.recompute)
        self.check_fsdp(self.backend)
        if self.dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"dtype {self.dtype!r}: 'auto', 'bfloat16' or 'float32'")
        if self.routing_replay not in ("off", "rollout"):
            raise ValueError(f"routing_replay {self.routing_replay!r}: 'off' or 'rollout'")
        if self.routing_replay == "rollout" and self.backend == "fsdp":
            raise ValueError("routing_replay: rollout runs on the torch and megatron backends (fsdp: not yet)")
        if self.loss not in ("rl", "sft"):
            raise ValueError(f"loss {self.loss!r}: 'rl' or 'sft'")
        if self.opd_coef < 0:
            raise ValueError(f"opd_coef must be >= 0, got {self.opd_coef}")
        for name in ("micro_batch_size", "n_minibatches", "ppo_epochs"):  # a count below 1 trains nothing
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("lr", "critic_lr"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {getattr(self, name)!r}")
        for name in ("weight_decay", "kl_coef", "entropy_coef", "clip_low", "clip_high"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {getattr(self, name)!r}")
        if not self.max_grad_norm >= 0:  # inf: no clipping; NaN fails this too
            raise ValueError(f"max_grad_norm must be >= 0 (inf: no clipping), got {self.max_grad_norm!r}")
        if self.estimator not in alg.ADVANTAGE_ESTIMATORS:
            raise ValueError(f"estimator {self.estimator!r}: one of {alg.ADVANTAGE_ESTIMATORS}")
        if not (0.0 <= self.gamma <= 1.0 and 0.0 <= self.lam <= 1.0):
            raise ValueError(f"gamma ({self.gamma}) and lam ({self.lam}) must be in [0, 1]")
        if self.reduction not in alg.REDUCTIONS:
            raise ValueError(f"reduction {self.reduction!r}: one of {sorted(alg.REDUCTIONS)}")
        if self.off_policy not in ("auto", *alg.OFF_POLICY_KINDS):
            raise ValueError(f"off_policy {self.off_policy!r}: 'auto' or one of {alg.OFF_POLICY_KINDS}")
        if self.off_policy_level not in alg.OFF_POLICY_LEVELS:
            raise ValueError(f"off_policy_level {self.off_policy_level!r}: one of {alg.OFF_POLICY_LEVELS}")
        if not 0.0 <= self.off_policy_low <= 1.0 <= self.off_policy_high:
            raise ValueError(f"off_policy_low ({self.off_policy_low}) <= 1 <= off_policy_high ({self.off_policy_high})"
                             " is required")
        self.betas = tuple(self.betas)
        from slime_env.trainers.lora import LoRAOptions

        self.lora = LoRAOptions.parse(self.lora)
        if self.lora is not None:
            if self.estimator == "ppo":
                raise ValueError("lora with estimator: ppo: the critic is a full copy of the backbone, which LoRA "
                                 "would not train; use a critic-free estimator (grpo, rloo, ...)")

    @property
    def legacy_tis(self) -> bool:
        """The older `use_tis` switch (truncated IS with `tis_cap`), kept as it was while `off_policy` is "auto"."""
        return self.off_policy == "auto" and self.use_tis

    def correction(self) -> str:
        """The `algorithms.off_policy_weights` kind in effect: `off_policy`, or "none" for "auto" (which the train
        loop turns into "tis" for an asynchronous run; `legacy_tis` has its own path)."""
        return "none" if self.off_policy == "auto" else self.off_policy
