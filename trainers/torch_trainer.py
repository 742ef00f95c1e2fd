"""`TorchTrainer`: the reference RL trainer on a Hugging Face causal LM (CPU or one GPU).

One `step(trajectories)` = pack the groups (`slime_env.trainers.batch`), compute the old policy's log-probs (and the
reference model's, for a KL term) without gradient, then for `ppo_epochs` x `n_minibatches` optimizer
steps: forward the actor micro-batch by micro-batch with the right shift (logits at position p score
token p + 1), the clipped policy loss (+ KL, − entropy, TIS weights) from `slime_env.trainers.algorithms`,
gradient accumulation weighted so the reduction is exact over the whole mini-batch, gradient clipping,
AdamW. `save`/`load` checkpoint model, optimizer and step; `sync` pushes the new weights to an engine through the
weight channels of `slime_env.trainers.weight_sync` (in place for a `TransformersPolicy`, from memory or a model
folder for SGLang or `serve-engine`), the same ones `slime-env train` uses.
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from slime_env.trainers import algorithms as alg
from slime_env.trainers.batch import TrainBatch, pack
from slime_env.trainers.distributed import padded_slices
from slime_env.trainers.fsdp_options import FSDPOptions
from slime_env.trainers.megatron.options import MegatronOptions
from slime_env.trainers import routing_replay as rr
from slime_env.trainers.split_step import AdamParams, Datum, DatumLoss

from slime_env.trajectory import Trajectory


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


class TorchTrainer:
    """RL updates of `model` (a transformers causal LM) from trajectories (see the module docstring)."""

    sft_steps = 0  # supervised steps taken (`sft_step`), apart from the RL steps of `step_count`

    def __init__(self, model: torch.nn.Module, config: TrainerConfig | None = None, *, pad_id: int,
                 ref_model: torch.nn.Module | None = None):
        self.config, self.pad_id = config or TrainerConfig(), pad_id
        c = self.config
        if c.lora is not None:  # only the adapter trains: the base weights are frozen inside the peft model
            from slime_env.trainers.lora import is_peft, wrap

            model = model if is_peft(model) else wrap(model, c.lora)
        self.model = model
        self.device = next(model.parameters()).device
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=c.lr,
                                           betas=c.betas, weight_decay=c.weight_decay)
        self.ref_model = ref_model
        if c.kl_coef > 0 and ref_model is None and c.lora is None:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)  # the initial policy
        self.critic = None
        if c.estimator == "ppo":
            from slime_env.trainers.critic import ValueModel

            self.critic = ValueModel(model).to(self.device)
            self.critic_optimizer = torch.optim.AdamW(self.critic.parameters(), lr=c.critic_lr, betas=c.betas,
                                                      weight_decay=c.weight_decay)
        self.role_baselines = alg.RoleBaselines(c.rae_decay) if c.estimator == "rae" else None
        self.step_count = 0
        self.routing_shape = rr.model_routing_shape(model) if c.routing_replay == "rollout" else None

    # --- log-probs --------------------------------------------------------------------------------
    def logprobs(self, model: torch.nn.Module, batch: TrainBatch, *, with_entropy: bool = False):
        """Log-probs aligned with `batch.input_ids` ([B, L]), computed for the trailing response columns only
        (0.0 elsewhere): logits at position p score token p + 1, so R response columns need R + 1 logits."""
        B, L = batch.input_ids.shape
        r = min(batch.response_columns(), L - 1)
        lp = torch.zeros((B, L), dtype=torch.float32, device=self.device)
        ent = torch.zeros_like(lp)
        if r > 0:
            ids = batch.input_ids.to(self.device)
            if self.routing_shape is not None:  # routing replay: the engine's experts where it recorded them
                rr.use_routes(model, None if batch.routed_experts is None else batch.routed_experts.to(self.device))
            dtype = next(model.parameters()).dtype
            pixels = {} if batch.vision is None else {  # a VLM's images, as its processor made them at rollout
                k: v.to(self.device, dtype if v.is_floating_point() else v.dtype) for k, v in batch.vision.items()}
            logits = model(input_ids=ids, attention_mask=batch.attention_mask.to(self.device),
                           position_ids=batch.position_ids.to(self.device), logits_to_keep=r + 1,
                           use_cache=False, **pixels).logits  # no KV cache: nothing generates, a checkpoint replays
            lp[:, L - r:] = alg.token_logprobs(logits[:, :-1], ids[:, L - r:])
            if with_entropy:  # its graph (a softmax over the vocabulary per token) is kept only for an entropy bonus
                with torch.set_grad_enabled(torch.is_grad_enabled() and bool(self.config.entropy_coef)):
                    ent[:, L - r:] = alg.entropy_from_logits(logits[:, :-1])
        return (lp, ent) if with_entropy else lp

    @torch.no_grad()
    def _frozen_logprobs(self, model: torch.nn.Module, batch: TrainBatch) -> torch.Tensor:
        was_training = model.training
        model.eval()
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        for rows in self._micro_slices(batch):
            mb = batch.rows(rows)
            out[rows] = _pad_left(self.logprobs(model, mb.trimmed()).cpu(), mb.input_ids.shape[1])
        model.train(was_training)
        return out

    def _reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """The reference policy's log-probs (a KL term): `ref_model`, or with LoRA the base model itself, the
        adapter off (no second copy of the weights)."""
        if self.ref_model is not None:
            return self._frozen_logprobs(self.ref_model, batch)
        with self.model.disable_adapter():
            return self._frozen_logprobs(self.model, batch)

    # --- one RL step ------------------------------------------------------------------------------
    def step(self, trajectories: Sequence[Trajectory], group_size: int) -> dict[str, float]:
        """One RL step on groups of `group_size` consecutive trajectories; returns metrics."""
        c = self.config
        t0 = time.perf_counter()
        if self.routing_shape is not None:
            rr.check_routing(trajectories, self.routing_shape)
        batch = pack(trajectories, group_size=group_size, pad_id=self.pad_id, estimator=c.estimator,
                     reward_assignment=c.reward_assignment, role_baselines=self.role_baselines,
                     routing=self.routing_shape is not None)
        if c.opd_coef > 0 and batch.teacher_logprobs is None:
            raise ValueError("opd_coef > 0 needs the teacher's log-probs on every trajectory "
                             "(metadata['teacher_logprobs']; `teacher:` in the run config computes them)")
        sft = c.loss == "sft"
        reuse_old = sft or (c.ppo_epochs == 1 and c.n_minibatches == 1 and not c.use_tis)
        old = None if reuse_old else self._frozen_logprobs(self.model, batch)  # the policy that sampled
        ref = self._reference_logprobs(batch) if c.kl_coef > 0 and not sft else None
        targets = None
        if self.critic is not None and not sft:  # PPO: GAE over the critic's values replaces the outcome advantages
            batch, targets = self._gae(batch)
        self._training_mode()
        totals: dict[str, float] = {}
        updates = 0
        for _ in range(c.ppo_epochs):
            for mini in self._split(batch, old, ref, targets):
                stats = self._update(*mini)
                for k, v in stats.items():
                    totals[k] = totals.get(k, 0.0) + v
                updates += 1
        self.step_count += 1
        metrics = {f"train/{k}": v / max(updates, 1) for k, v in totals.items()}
        mask = batch.loss_mask
        metrics.update({"train/reward_mean": float(batch.rewards.mean()), "train/tokens": float(mask.sum()),
                        "train/response_len": float(mask.sum(-1).mean()), "train/step_s": time.perf_counter() - t0,
                        "train/step": float(self.step_count)})
        if self.routing_shape is not None:
            # loss tokens routed by the trainer: their routing was lost (abort, preemption)
            lost, share = rr.rerouted_tokens(batch.loss_mask, batch.routed_experts)
            metrics.update({"train/routing_replay_rerouted_tokens": lost, "train/routing_replay_rerouted_frac": share})
        return metrics

    def sft_step(self, trajectories: Sequence[Trajectory], *, lr: float | None = None) -> dict[str, float]:
        """One supervised step on `trajectories` (their loss-masked tokens: what the policy or a teacher generated,
        or a conversation's assistant turns) at learning rate `lr` (default: the config's), whatever `loss` the
        config says. It is not an RL step: `step_count` is unchanged. Returns `sft/*` metrics (`sft/loss`: the
        mean negative log-likelihood per token)."""
        from dataclasses import replace

        saved, steps = self.config, self.step_count
        groups = self._param_groups()
        lrs = [g["lr"] for g in groups]
        self.config = replace(saved, loss="sft", estimator="grpo", n_minibatches=1, ppo_epochs=1, kl_coef=0.0,
                              opd_coef=0.0, off_policy="none", use_tis=False)
        try:
            for g in groups:
                g["lr"] = saved.lr if lr is None else lr
            metrics = self.step(trajectories, 1)
        finally:
            self.config, self.step_count = saved, steps
            for g, v in zip(groups, lrs):
                g["lr"] = v
        self.sft_steps += 1
        keep = ("loss", "entropy", "grad_norm", "tokens", "response_len", "step_s")
        out = {f"sft/{k}": metrics[f"train/{k}"] for k in keep if f"train/{k}" in metrics}
        out["sft/step"] = float(self.sft_steps)
        return out

    def _param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's parameter groups (their `lr` is what `sft_step` sets)."""
        return list(self.optimizer.param_groups)

    def _split(self, batch: TrainBatch, old: torch.Tensor | None, ref: torch.Tensor | None, targets=None):
        def cut(x, a, b):
            return None if x is None else x[a:b]

        for a, b in batch.minibatch_bounds(self.config.n_minibatches):
            yield (batch.rows(slice(a, b)), cut(old, a, b), cut(ref, a, b),
                   None if targets is None else tuple(t[a:b] for t in targets))

    # --- PPO's critic -----------------------------------------------------------------------------------
    def values(self, batch: TrainBatch) -> torch.Tensor:
        """The critic's [B, L] values, aligned like `logprobs` (with gradient)."""
        return self.critic(batch, self.device)

    def _all_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Rows computed by other processes filled in (a data-parallel trainer sums over ranks)."""
        return x

    @torch.no_grad()
    def _gae(self, batch: TrainBatch) -> tuple[TrainBatch, tuple[torch.Tensor, torch.Tensor]]:
        """Old values, GAE advantages (whitened over the batch's generated tokens) and returns."""
        from dataclasses import replace

        c = self.config
        old_values = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        for rows in self._micro_slices(batch):
            mb = batch.rows(rows)
            old_values[rows] = _pad_left(self.values(mb.trimmed()).cpu(), mb.input_ids.shape[1])
        old_values = self._all_rows(old_values)
        adv, returns = alg.gae_advantages(batch.token_rewards, old_values, batch.loss_mask, gamma=c.gamma, lam=c.lam)
        return replace(batch, advantages=alg.whiten(adv, batch.loss_mask)), (old_values, returns)

    def _critic_step(self) -> float:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.critic.parameters(), self.config.max_grad_norm))
        if math.isfinite(grad_norm):
            self.critic_optimizer.step()
        self.critic_optimizer.zero_grad(set_to_none=True)
        return grad_norm

    # --- the parts a parallel trainer replaces ---------------------------------------------------------
    def _micro_slices(self, batch: TrainBatch) -> list[slice]:
        """Row ranges of the micro-batches this process computes (all rows, `micro_batch_size` at a time, fewer where
        their padded size would pass `max_tokens_per_micro_batch`: a step's activations grow with it)."""
        return padded_slices(batch.attention_mask.sum(-1).tolist(), 0, batch.size, self.config.micro_batch_size,
                             self.config.max_tokens_per_micro_batch)

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _optimizer_step(self) -> float:
        """Clip, step (skipped on a non-finite norm), return the gradient norm."""
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm))
        if math.isfinite(grad_norm):
            self.optimizer.step()
        return grad_norm

    def _reduce_stats(self, stats: dict[str, float]) -> dict[str, float]:
        return stats

    # The statistics every rank of a data-parallel trainer reports (zeros from a rank with no tokens).
    _STATS = ("loss", "pg_loss", "kl", "entropy", "clip_frac", "ratio_mean", "rollout_logprob_gap")
    _OFF_STATS = ("off_policy/weight_mean", "off_policy/clipped_frac", "off_policy/logprob_gap", "off_policy/kl")

    def _sum_stats(self, stats: dict[str, float], group: Any) -> dict[str, float]:
        """Each rank's token-weighted partial `stats` summed over `group`; every rank sends the same keys: `_STATS`,
        and the off-policy ones when a correction is in effect."""
        from slime_env.trainers.distributed import reduce_stats

        c = self.config
        keys = set(self._STATS) | (set(self._OFF_STATS) if c.correction() != "none" and c.loss == "rl" else set())
        if c.opd_coef > 0 and c.loss == "rl":
            keys.add("opd/reverse_kl")
        return reduce_stats(stats, keys, group, self.device)

    def _training_mode(self) -> None:
        """The mode of the gradient passes: eval (dropout off: the importance ratio must compare the same function
        the engine sampled). A LoRA `dropout` acts in supervised steps (`loss: sft`) only."""
        lora = self.config.lora
        self.model.train(bool(lora and lora.dropout > 0 and self.config.loss == "sft"))

    def _idle_micro_batch(self) -> None:
        """A micro-batch without loss tokens: nothing to do here. Trainers whose ranks must run the same forward and
        backward passes (expert parallel, FSDP) run a zero-weighted one instead."""

    def _backward(self, loss: torch.Tensor, share: float) -> None:
        """Backward of one micro-batch's loss weighted by its `share` of the mini-batch."""
        (loss * share).backward()

    def _update(self, mini: TrainBatch, old: torch.Tensor | None, ref: torch.Tensor | None,
                targets: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, float]:
        c = self.config
        self._zero_grad()
        total_tokens = float(mini.loss_mask.sum().clamp(min=1.0))
        stats: dict[str, float] = {}
        for rows in self._micro_slices(mini):
            micro = mini.rows(rows)
            micro = micro.trimmed()
            cols = micro.input_ids.shape[1]  # the last `cols` columns of the mini-batch (left padding)
            mask = micro.loss_mask.to(self.device)
            if mask.sum() == 0:
                self._idle_micro_batch()
                continue
            logp, entropy = self.logprobs(self.model, micro, with_entropy=True)
            loss, share, reported = self._micro_loss(micro, rows, logp, entropy, old, ref, total_tokens, mini.size)
            self._backward(loss, share)
            if targets is not None:
                old_v, returns = (t[rows, -cols:].to(self.device) for t in targets)
                v_loss = alg.value_loss(self.values(micro), old_v, returns, mask, clip=c.value_clip,
                                        reduction=c.reduction)
                (v_loss * share).backward()
                reported["value_loss"] = v_loss
            for k, v in reported.items():
                stats[k] = stats.get(k, 0.0) + float(v.detach()) * share
        stats = self._reduce_stats(stats)
        stats["grad_norm"] = self._optimizer_step()
        self._zero_grad()
        if targets is not None:
            stats["critic_grad_norm"] = self._critic_step()
        return stats

    def _micro_loss(self, micro: TrainBatch, rows: slice, logp: torch.Tensor, entropy: torch.Tensor,
                    old: torch.Tensor | None, ref: torch.Tensor | None, total_tokens: float, mini_size: int
                    ) -> tuple[torch.Tensor, float, dict[str, torch.Tensor]]:
        """One (trimmed) micro-batch's RL loss from its log-probs and entropies [B', L'] — clipped policy loss, KL,
        entropy bonus, off-policy weights — with its `share` of the mini-batch (the exact reduction weights each
        micro-batch by it) and the statistics it reports. `rows`: its rows in the mini-batch, for `old` and `ref`."""
        c = self.config
        cols = micro.input_ids.shape[1]
        mask = micro.loss_mask.to(self.device)
        ent = alg.REDUCTIONS[c.reduction](entropy, mask)
        share = float(mask.sum()) / total_tokens if c.reduction == "token_mean" else micro.size / mini_size
        if c.loss == "sft":
            nll = alg.sft_loss(logp, mask, c.reduction)
            zero = torch.zeros((), device=nll.device)
            return nll, share, {"loss": nll, "pg_loss": nll, "kl": zero, "entropy": ent, "clip_frac": zero,
                                "ratio_mean": zero + 1.0, "rollout_logprob_gap": zero}
        old_lp = logp.detach() if old is None else old[rows, -cols:].to(self.device)
        # The train-inference mismatch: mean |trainer - engine| log-prob of the sampled tokens (a drift here, with the
        # ratio at 1, means the engine samples from another policy than the one trained).
        gap = alg.masked_mean((old_lp - micro.rollout_logprobs.to(self.device)).abs(), mask)
        advantages = micro.advantages.to(self.device)
        opd_stats = {}
        if c.opd_coef > 0:
            advantages, reverse_kl = alg.opd_advantages(advantages, old_lp, micro.teacher_logprobs.to(self.device),
                                                        mask, c.opd_coef)
            opd_stats["opd/reverse_kl"] = alg.REDUCTIONS[c.reduction](reverse_kl, mask)
        is_w, off_stats = None, {}
        if c.legacy_tis:  # the older switch, unchanged
            is_w = alg.truncated_is_weights(old_lp, micro.rollout_logprobs.to(self.device), mask, c.tis_cap)
        elif c.correction() != "none":
            is_w, off_stats = alg.off_policy_weights(
                old_lp, micro.rollout_logprobs.to(self.device), mask, kind=c.correction(),
                level=c.off_policy_level, low=c.off_policy_low, high=c.off_policy_high)
        pg, pg_stats = alg.policy_loss(logp, old_lp, advantages, mask,
                                       clip_low=c.clip_low, clip_high=c.clip_high, dual_clip=c.dual_clip,
                                       ratio_level="sequence" if c.estimator == "gspo" else "token",
                                       is_weights=is_w, reduction=c.reduction)
        loss = pg
        kl_value = torch.zeros(())
        if ref is not None:
            kl = alg.kl_divergence(logp, ref[rows, -cols:].to(self.device), c.kl_kind)
            kl_value = alg.REDUCTIONS[c.reduction](kl, mask)
            loss = loss + c.kl_coef * kl_value
        if c.entropy_coef:
            loss = loss - c.entropy_coef * ent
        # `share`: the exact reduction over the whole mini-batch weights each micro-batch by it
        reported = {"loss": loss, "pg_loss": pg, "kl": kl_value, "entropy": ent, "rollout_logprob_gap": gap,
                    **pg_stats, **opd_stats,
                    **{f"off_policy/{k}": v for k, v in off_stats.items()}}
        return loss, share, reported

    # --- the split step (`slime_env.trainers.split_step.SplitStepTrainer`: Tinker's training calls) -----------
    def forward(self, data: Sequence[Datum]) -> list[torch.Tensor]:
        """Each datum's log-probs of its targets, no gradient (`SplitStepTrainer.forward`)."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                return [lp.cpu() for chunk in self._datum_chunks(data) for lp in self._datum_logprobs(chunk)]
        finally:
            self.model.train(was_training)

    def forward_backward(self, data: Sequence[Datum], loss: DatumLoss) -> tuple[list[torch.Tensor], float]:
        """Log-probs and the summed `loss`; its gradient accumulates until `optim_step`
        (`SplitStepTrainer.forward_backward`). Micro-batches of `micro_batch_size` data bound the memory."""
        self._training_mode()
        out, total = [], 0.0
        for chunk in self._datum_chunks(data):
            logps = self._datum_logprobs(chunk)
            chunk_loss = sum((loss(lp, {k: v.to(self.device) for k, v in d.inputs.items()})
                              for lp, d in zip(logps, chunk)), torch.zeros((), device=self.device))
            self._backward(chunk_loss, self._split_share())  # a sum over data: weighted for replicas only
            total += float(chunk_loss.detach())
            out += [lp.detach().cpu() for lp in logps]
        return out, total

    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        """AdamW with `adam`'s hyper-parameters on the accumulated gradients, then zero them
        (`SplitStepTrainer.optim_step`); counts as a step of `step_count` (what a checkpoint resumes)."""
        from dataclasses import replace

        for g in self._param_groups():
            g.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,  # megatron's groups
                     weight_decay=adam.weight_decay * g.get("wd_mult", 1.0))  # without decay (norms, biases) keep none
        saved = self.config
        self.config = replace(saved, max_grad_norm=adam.grad_clip_norm or math.inf)  # what `_optimizer_step` clips to
        try:
            grad_norm = self._optimizer_step()
        finally:
            self.config = saved
        self._zero_grad()
        self.step_count += 1
        return {"grad_norm": grad_norm, "learning_rate": adam.learning_rate}

    def _split_share(self) -> float:
        """The weight of a split-step backward. Every rank computes a call's whole data (`serve-tinker` broadcasts
        it), so a trainer whose ranks reduce their gradients weights each rank's by what makes the reduction the
        one-process gradient; one process: 1."""
        return 1.0

    def _datum_chunks(self, data: Sequence[Datum]) -> list[Sequence[Datum]]:
        if not data:
            raise ValueError("data is empty: forward / forward_backward need at least one Datum")
        n = self.config.micro_batch_size
        return [data[i:i + n] for i in range(0, len(data), n)]

    def _datum_logprobs(self, data: Sequence[Datum]) -> list[torch.Tensor]:
        """Each datum's log-probs of its targets ([n]), the data right-padded into one forward."""
        width = max(len(d.tokens) for d in data)
        ids = torch.full((len(data), width), self.pad_id, dtype=torch.long)
        targets, attention = torch.zeros_like(ids), torch.zeros_like(ids)
        for row, d in enumerate(data):
            ids[row, :len(d.tokens)], targets[row, :len(d.tokens)] = d.tokens, d.targets
            attention[row, :len(d.tokens)] = 1
        logits = self.model(input_ids=ids.to(self.device), attention_mask=attention.to(self.device),
                            use_cache=False).logits
        logp = alg.token_logprobs(logits, targets.to(self.device))
        return [logp[row, :len(d.tokens)] for row, d in enumerate(data)]

    # --- checkpoints and weight sync ------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Model (safetensors, `save_pretrained`), optimizer, step and config under `path` (and PPO's critic)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if self.config.lora is not None:  # the adapter alone, in PEFT's format (no base weights)
            self.adapter().save(path / "adapter")
        else:
            self.model.save_pretrained(path / "model", safe_serialization=True)
        torch.save({"optimizer": self.optimizer.state_dict(), "step": self.step_count,
                    "role_baselines": self.role_baselines.state_dict() if self.role_baselines else None},
                   path / "trainer.pt")
        if self.critic is not None:  # PPO: the critic resumes too
            torch.save({"critic": self.critic.state_dict(), "optimizer": self.critic_optimizer.state_dict()},
                       path / "critic.pt")
        (path / "config.json").write_text(json.dumps(asdict(self.config)))
        return path

    def load(self, path: str | Path, *, optimizer: bool = True) -> None:
        """Weights from `path/model` (safetensors); optimizer state and step too when `path` holds them and
        `optimizer`."""
        path = Path(path)
        from safetensors.torch import load_file

        from slime_env.agents.weight_layout import load_state

        if self.config.lora is not None:
            self._load_adapter(path)
        else:
            state = {}
            for f in sorted((path / "model").glob("*.safetensors")):
                state.update(load_file(str(f)))
            load_state(self.model, state)  # either layout: checkpoints hold MoE experts one matrix each
        # a MegatronTrainer checkpoint holds the same HF weights, not this state
        if optimizer and (path / "trainer.pt").exists():
            saved = torch.load(path / "trainer.pt", map_location=self.device, weights_only=False)
            self.optimizer.load_state_dict(saved["optimizer"])
            self.step_count = int(saved["step"])
            if self.role_baselines is not None and saved.get("role_baselines"):
                self.role_baselines.load_state_dict(saved["role_baselines"])
        if self.critic is not None and (path / "critic.pt").exists():
            saved = torch.load(path / "critic.pt", map_location=self.device, weights_only=False)
            self.critic.load_state_dict(saved["critic"])
            if optimizer:
                self.critic_optimizer.load_state_dict(saved["optimizer"])

    def _load_adapter(self, path: Path) -> None:
        """The adapter of checkpoint `path` (`path/adapter`, PEFT's format) into this trainer's peft model."""
        from slime_env.agents.lora_adapter import LoRAAdapter
        from slime_env.trainers.lora import adapter_names

        folder = path / "adapter" if (path / "adapter").is_dir() else path
        if not (folder / "adapter_config.json").exists():
            raise FileNotFoundError(f"{path}: a LoRA trainer resumes from an adapter checkpoint (adapter/ in PEFT's "
                                    "format); this one holds none")
        saved = LoRAAdapter.load(folder)
        names = adapter_names(self.model)
        unknown = sorted(set(saved.tensors) - set(names))
        if unknown:
            raise ValueError(f"{folder}: adapter tensors {unknown[:3]} match no module of this model")
        self._load_model_state({names[k]: v for k, v in saved.tensors.items()})

    def _load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        """Full tensors under the model's own state-dict names into it (the others unchanged)."""
        self.model.load_state_dict({k: v.to(self.device) for k, v in state.items()}, strict=False)

    def _model_state(self, adapter_only: bool = False) -> dict[str, torch.Tensor]:
        """The model's state dict as full tensors (views here; a sharded trainer gathers them, a collective), or
        only its LoRA tensors."""
        return {k: v.detach() for k, v in self.model.state_dict().items() if not adapter_only or ".lora_" in k}

    def adapter(self) -> Any:
        """The current LoRA adapter (`slime_env.trainers.lora.LoRAAdapter`: PEFT names, copies); LoRA trainers only.
        A collective where the weights are sharded."""
        from slime_env.trainers.lora import adapter_of

        if self.config.lora is None:
            raise ValueError("adapter(): this trainer has no trainer.lora section")
        return adapter_of(self.model, self.config.lora.name, self._model_state(adapter_only=True))

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

        version = version or str(self.step_count)
        channel = channel_for(policy, self.weight_layout(), path=path)
        if self.syncs_adapter:
            adapter = self.adapter()  # a collective where the weights are sharded
            if self.pushes:
                await channel.push_adapter(adapter, version)
            await channel.close()
            return version
        weights = self.weights()  # a collective where the weights are sharded
        if self.pushes:
            await channel.push(weights, version)
        await channel.close()
        return version

    @property
    def pushes(self) -> bool:
        """Whether this process sends the weights to engines (rank 0 of a sharded trainer; this one always)."""
        return True

    def weight_layout(self) -> Any:
        """How these weights reach an engine (`slime_env.agents.weight_layout.WeightLayout` of the model's config)."""
        from slime_env.agents.weight_layout import WeightLayout

        return WeightLayout.of(self.model.config)

    def weights(self) -> dict[str, torch.Tensor]:
        """The current weights with Hugging Face names (views, not copies: consume them before the next step); with
        LoRA, the base weights with the adapter merged in. A collective where the weights are sharded."""
        if self.config.lora is not None:
            from slime_env.trainers.lora import merged_weights

            return merged_weights(self.model, self.config.lora.name, self._model_state())
        return self._model_state()

    def save_weights(self, path: str | Path) -> Path:
        """Only the Hugging Face model folder (safetensors + config.json): what an engine loads (with LoRA: the
        merged weights)."""
        if self.config.lora is not None:
            self.model.get_base_model().save_pretrained(path, state_dict=self.weights(), safe_serialization=True)
        else:
            self.model.save_pretrained(path, safe_serialization=True)
        return Path(path)


def read_hf_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the HF folder `path/model` (a trainer checkpoint) or `path` itself (a model folder), read
    from its safetensors files; FileNotFoundError naming the folder when it holds none."""
    from safetensors.torch import load_file

    path = Path(path)
    folder = path / "model" if (path / "model").is_dir() else path
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights under {folder}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def _pad_left(x: torch.Tensor, cols: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (cols - x.shape[1], 0)) if x.shape[1] < cols else x
