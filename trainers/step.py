"""One RL step, written once over a `Backend`: pack → old / reference log-probs → mini-batches → micro-slices →
loss → exact reduction → optimizer step.

`RLStep.step(trajectories, group_size)` packs the groups (`slime_env.trainers.batch`), computes the old policy's
log-probs (and the reference model's, for a KL term) without gradient, then for `ppo_epochs` x `n_minibatches`
optimizer steps forwards the actor micro-batch by micro-batch, computes the clipped policy loss (+ KL, − entropy,
off-policy weights) from `slime_env.trainers.algorithms` and backs it weighted by the micro-batch's share of the
mini-batch, so the reduction is exact over the whole mini-batch whatever the slicing or the number of ranks.

A `Backend` (`trainers/backends/torch.py`, `trainers/backends/fsdp.py`, `trainers/megatron/backend.py`) owns the
model and everything that depends on how it is laid out: log-probs, which micro-slices this process computes, the
backward, the reduction of statistics over ranks, the optimizer step, checkpoints and weights. The trainers
(`TorchTrainer`, `FSDPTrainer`, `MegatronTrainer`) are a backend and this step, composed (`trainers.trainer`).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ContextManager, Protocol

import torch

from slime_env.trainers import algorithms as alg
from slime_env.trainers import routing_replay as rr
from slime_env.trainers.batch import TrainBatch, pack
from slime_env.trainers.split_step import AdamParams, Datum, DatumLoss
from slime_env.trajectory import Trajectory

if TYPE_CHECKING:
    from slime_env.trainers.trainer_config import TrainerConfig

# A micro-batch's loss from its log-probs: (micro, its rows in the mini-batch, log-probs, entropies) -> (loss, share).
MicroLoss = Callable[[TrainBatch, slice, torch.Tensor, torch.Tensor], tuple[torch.Tensor, float]]

# The statistics every rank of a data-parallel backend reports (zeros from a rank with no tokens).
STATS = ("loss", "pg_loss", "kl", "entropy", "clip_frac", "ratio_mean", "rollout_logprob_gap")
OFF_STATS = ("off_policy/weight_mean", "off_policy/clipped_frac", "off_policy/logprob_gap", "off_policy/kl")


class Backend(Protocol):
    """What one RL step needs from where the model lives. Attributes: `config` (the `TrainerConfig` in effect: a
    step may swap it for its duration), `model`, `device`, `pad_id`, `step_count`, `role_baselines` (RAE), `critic`
    (PPO, else None), `routing_shape` (routing replay, else None), `pipelined` (the gradient passes run in a pipeline
    schedule: `pipeline_passes`)."""

    config: TrainerConfig
    model: Any
    device: torch.device
    pad_id: int
    step_count: int
    role_baselines: alg.RoleBaselines | None
    critic: Any
    routing_shape: tuple[int, int, int] | None
    pipelined: bool

    def logprobs(self, model: Any, batch: TrainBatch, *, with_entropy: bool = False) -> Any:
        """[B, L] log-probs of `batch`'s response tokens (and entropies with `with_entropy`), 0.0 elsewhere."""
        ...

    def frozen_logprobs(self, model: Any, batch: TrainBatch) -> torch.Tensor:
        """`model`'s [B, L] log-probs of every row (CPU), no gradient, dropout off."""
        ...

    def reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """The KL reference policy's log-probs, as `frozen_logprobs`."""
        ...

    def micro_slices(self, batch: TrainBatch) -> list[slice]:
        """Row ranges of the micro-batches this process computes."""
        ...

    def prepare(self, trajectories: Sequence[Trajectory]) -> None:
        """Before a step: refuse what the backend cannot train, bring back what `finish` released."""
        ...

    def finish(self) -> None:
        """After a step (e.g. release memory a colocated engine needs)."""
        ...

    def train_mode(self) -> None:
        """The mode of the gradient passes."""
        ...

    def update_context(self) -> ContextManager[Any]:
        """Held around one mini-batch's gradient passes and optimizer step."""
        ...

    def pipeline_passes(self, mini: TrainBatch, slices: list[slice], loss_of: MicroLoss,
                        stats: dict[str, float]) -> dict[str, float]:
        """`pipelined` backends only: the gradient passes of `mini`'s micro-batches `slices`, each backing
        `loss * share` from `loss_of`; returns the last stage's `stats` on every stage."""
        ...

    def zero_grad(self) -> None: ...

    def backward(self, loss: torch.Tensor, share: float) -> None:
        """Backward of one micro-batch's loss weighted by its `share` of the mini-batch."""
        ...

    def idle_micro_batch(self) -> None:
        """A micro-batch without loss tokens (a rank that must still join its group's passes runs a zero one)."""
        ...

    def reduce_stats(self, stats: dict[str, float]) -> dict[str, float]:
        """This rank's token-weighted partial statistics summed over the data-parallel ranks."""
        ...

    def optimizer_step(self) -> float:
        """Clip to `config.max_grad_norm`, step (skipped on a non-finite norm), return the gradient norm."""
        ...

    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's live parameter groups (their `lr` is what `sft_step` and `optim_step` set)."""
        ...

    def values(self, batch: TrainBatch) -> torch.Tensor:
        """The critic's [B, L] values, with gradient (PPO)."""
        ...

    def all_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[B, L] rows computed by other processes filled in."""
        ...

    def critic_step(self) -> float:
        """The critic's optimizer step; returns its gradient norm."""
        ...

    def split_share(self) -> float:
        """The weight of a split-step backward (every rank computes a call's whole data)."""
        ...

    def datum_logprobs(self, data: Sequence[Datum]) -> list[torch.Tensor]:
        """Each datum's log-probs of its targets ([n]), with gradient."""
        ...

    def save(self, path: str | Path) -> Path: ...

    def load(self, path: str | Path, *, optimizer: bool = True) -> None: ...

    def weights(self) -> dict[str, torch.Tensor]: ...

    def adapter(self) -> Any: ...

    def save_weights(self, path: str | Path) -> Path: ...

    def weight_layout(self) -> Any: ...

    @property
    def pushes(self) -> bool: ...


@torch.no_grad()
def frozen_logprobs(backend: Backend, model: Any, batch: TrainBatch) -> torch.Tensor:
    """`model`'s [B, L] log-probs of `batch` (CPU), micro-batch by micro-batch, in eval mode, no gradient."""
    was_training = model.training
    model.eval()
    out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
    for rows in backend.micro_slices(batch):
        mb = batch.rows(rows)
        out[rows] = pad_left(backend.logprobs(model, mb.trimmed()).cpu(), mb.input_ids.shape[1])
    model.train(was_training)
    return out


def pad_left(x: torch.Tensor, cols: int) -> torch.Tensor:
    """`x` [B, c] left-padded with zeros to `cols` columns."""
    return torch.nn.functional.pad(x, (cols - x.shape[1], 0)) if x.shape[1] < cols else x


def sum_stats(config: TrainerConfig, stats: dict[str, float], group: Any, device: torch.device,
              extra: tuple[str, ...] = ()) -> dict[str, float]:
    """Each rank's token-weighted partial `stats` summed over `group`; every rank sends the same keys: `STATS` (+
    `extra`), and the off-policy ones when a correction is in effect."""
    from slime_env.trainers.distributed import reduce_stats

    c = config
    keys = set(STATS) | set(extra) | (set(OFF_STATS) if c.correction() != "none" and c.loss == "rl" else set())
    if c.opd_coef > 0 and c.loss == "rl":
        keys.add("opd/reverse_kl")
    return reduce_stats(stats, keys, group, device)


class RLStep:
    """The RL step and the supervised step over `backend` (see the module docstring)."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.sft_steps = 0  # supervised steps taken (`sft_step`), apart from the RL steps of `step_count`

    def step(self, trajectories: Sequence[Trajectory], group_size: int) -> dict[str, float]:
        """One RL step on groups of `group_size` consecutive trajectories; returns metrics."""
        b = self.backend
        b.prepare(trajectories)
        metrics = self._step(trajectories, group_size)
        b.finish()
        return metrics

    def _step(self, trajectories: Sequence[Trajectory], group_size: int) -> dict[str, float]:
        b, c = self.backend, self.backend.config
        t0 = time.perf_counter()
        if b.routing_shape is not None:
            rr.check_routing(trajectories, b.routing_shape)
        batch = pack(trajectories, group_size=group_size, pad_id=b.pad_id, estimator=c.estimator,
                     reward_assignment=c.reward_assignment, role_baselines=b.role_baselines,
                     routing=b.routing_shape is not None)
        if c.opd_coef > 0 and batch.teacher_logprobs is None:
            raise ValueError("opd_coef > 0 needs the teacher's log-probs on every trajectory "
                             "(metadata['teacher_logprobs']; `teacher:` in the run config computes them)")
        sft = c.loss == "sft"
        reuse_old = sft or (c.ppo_epochs == 1 and c.n_minibatches == 1 and not c.use_tis)
        old = None if reuse_old else b.frozen_logprobs(b.model, batch)  # the policy that sampled
        ref = b.reference_logprobs(batch) if c.kl_coef > 0 and not sft else None
        targets = None
        if b.critic is not None and not sft:  # PPO: GAE over the critic's values replaces the outcome advantages
            batch, targets = self.gae(batch)
        b.train_mode()
        totals: dict[str, float] = {}
        updates = 0
        for _ in range(c.ppo_epochs):
            for mini in self.minibatches(batch, old, ref, targets):
                for k, v in self.update(*mini).items():
                    totals[k] = totals.get(k, 0.0) + v
                updates += 1
        b.step_count += 1
        metrics = {f"train/{k}": v / max(updates, 1) for k, v in totals.items()}
        mask = batch.loss_mask
        metrics.update({"train/reward_mean": float(batch.rewards.mean()), "train/tokens": float(mask.sum()),
                        "train/response_len": float(mask.sum(-1).mean()), "train/step_s": time.perf_counter() - t0,
                        "train/step": float(b.step_count)})
        if b.routing_shape is not None:
            # loss tokens routed by the trainer: their routing was lost (abort, preemption)
            lost, share = rr.rerouted_tokens(batch.loss_mask, batch.routed_experts)
            metrics.update({"train/routing_replay_rerouted_tokens": lost, "train/routing_replay_rerouted_frac": share})
        return metrics

    def sft_step(self, trajectories: Sequence[Trajectory], *, lr: float | None = None) -> dict[str, float]:
        """One supervised step on `trajectories`' loss-masked tokens at learning rate `lr` (default: the config's),
        whatever `loss` the config says; `step_count` is unchanged. Returns `sft/*` metrics."""
        b = self.backend
        saved, steps = b.config, b.step_count
        groups = b.param_groups()
        lrs = [g["lr"] for g in groups]
        b.config = replace(saved, loss="sft", estimator="grpo", n_minibatches=1, ppo_epochs=1, kl_coef=0.0,
                           opd_coef=0.0, off_policy="none", use_tis=False)
        try:
            for g in groups:
                g["lr"] = saved.lr if lr is None else lr
            metrics = self.step(trajectories, 1)
        finally:
            b.config, b.step_count = saved, steps
            for g, v in zip(groups, lrs):
                g["lr"] = v
        self.sft_steps += 1
        keep = ("loss", "entropy", "grad_norm", "tokens", "response_len", "step_s")
        out = {f"sft/{k}": metrics[f"train/{k}"] for k in keep if f"train/{k}" in metrics}
        out["sft/step"] = float(self.sft_steps)
        return out

    def minibatches(self, batch: TrainBatch, old: torch.Tensor | None, ref: torch.Tensor | None, targets=None):
        """(mini-batch, its old log-probs, reference log-probs, (old values, returns)) for each mini-batch."""
        def cut(x, a, b):
            return None if x is None else x[a:b]

        for a, b in batch.minibatch_bounds(self.backend.config.n_minibatches):
            yield (batch.rows(slice(a, b)), cut(old, a, b), cut(ref, a, b),
                   None if targets is None else tuple(t[a:b] for t in targets))

    @torch.no_grad()
    def gae(self, batch: TrainBatch) -> tuple[TrainBatch, tuple[torch.Tensor, torch.Tensor]]:
        """Old values, GAE advantages (whitened over the batch's generated tokens) and returns."""
        b, c = self.backend, self.backend.config
        old_values = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        for rows in b.micro_slices(batch):
            mb = batch.rows(rows)
            old_values[rows] = pad_left(b.values(mb.trimmed()).cpu(), mb.input_ids.shape[1])
        old_values = b.all_rows(old_values)
        adv, returns = alg.gae_advantages(batch.token_rewards, old_values, batch.loss_mask, gamma=c.gamma, lam=c.lam)
        return replace(batch, advantages=alg.whiten(adv, batch.loss_mask)), (old_values, returns)

    def update(self, mini: TrainBatch, old: torch.Tensor | None, ref: torch.Tensor | None,
               targets: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, float]:
        """One optimizer step on `mini`: its micro-batches' losses backed with their shares, statistics reduced."""
        b = self.backend
        with b.update_context():
            b.zero_grad()
            total_tokens = float(mini.loss_mask.sum().clamp(min=1.0))
            stats: dict[str, float] = {}

            def loss_of(micro: TrainBatch, rows: slice, logp: torch.Tensor, entropy: torch.Tensor):
                loss, share, reported = self.micro_loss(micro, rows, logp, entropy, old, ref, total_tokens, mini.size)
                for k, v in reported.items():
                    stats[k] = stats.get(k, 0.0) + float(v.detach()) * share
                return loss, share

            if b.pipelined:
                stats = b.pipeline_passes(mini, b.micro_slices(mini), loss_of, stats)
            else:
                self._gradient_passes(mini, loss_of, targets, stats)
            stats = b.reduce_stats(stats)
            stats["grad_norm"] = b.optimizer_step()
            b.zero_grad()
            if targets is not None:
                stats["critic_grad_norm"] = b.critic_step()
        return stats

    def _gradient_passes(self, mini: TrainBatch, loss_of: MicroLoss, targets: tuple[torch.Tensor, ...] | None,
                         stats: dict[str, float]) -> None:
        b, c = self.backend, self.backend.config
        for rows in b.micro_slices(mini):
            micro = mini.rows(rows).trimmed()
            cols = micro.input_ids.shape[1]  # the last `cols` columns of the mini-batch (left padding)
            mask = micro.loss_mask.to(b.device)
            if mask.sum() == 0:
                b.idle_micro_batch()
                continue
            logp, entropy = b.logprobs(b.model, micro, with_entropy=True)
            loss, share = loss_of(micro, rows, logp, entropy)
            b.backward(loss, share)
            if targets is not None:
                old_v, returns = (t[rows, -cols:].to(b.device) for t in targets)
                v_loss = alg.value_loss(b.values(micro), old_v, returns, mask, clip=c.value_clip,
                                        reduction=c.reduction)
                (v_loss * share).backward()
                stats["value_loss"] = stats.get("value_loss", 0.0) + float(v_loss.detach()) * share

    def micro_loss(self, micro: TrainBatch, rows: slice, logp: torch.Tensor, entropy: torch.Tensor,
                   old: torch.Tensor | None, ref: torch.Tensor | None, total_tokens: float, mini_size: int
                   ) -> tuple[torch.Tensor, float, dict[str, torch.Tensor]]:
        """One (trimmed) micro-batch's RL loss from its log-probs and entropies [B', L'] — clipped policy loss, KL,
        entropy bonus, off-policy weights — with its `share` of the mini-batch (the exact reduction weights each
        micro-batch by it) and the statistics it reports. `rows`: its rows in the mini-batch, for `old` and `ref`."""
        c, device = self.backend.config, self.backend.device
        cols = micro.input_ids.shape[1]
        mask = micro.loss_mask.to(device)
        ent = alg.REDUCTIONS[c.reduction](entropy, mask)
        share = float(mask.sum()) / total_tokens if c.reduction == "token_mean" else micro.size / mini_size
        if c.loss == "sft":
            nll = alg.sft_loss(logp, mask, c.reduction)
            zero = torch.zeros((), device=nll.device)
            return nll, share, {"loss": nll, "pg_loss": nll, "kl": zero, "entropy": ent, "clip_frac": zero,
                                "ratio_mean": zero + 1.0, "rollout_logprob_gap": zero}
        old_lp = logp.detach() if old is None else old[rows, -cols:].to(device)
        rollout = micro.rollout_logprobs.to(device)
        # The train-inference mismatch: mean |trainer - engine| log-prob of the sampled tokens (a drift here, with the
        # ratio at 1, means the engine samples from another policy than the one trained).
        gap = alg.masked_mean((old_lp - rollout).abs(), mask)
        advantages, opd_stats = micro.advantages.to(device), {}
        if c.opd_coef > 0:
            advantages, reverse_kl = alg.opd_advantages(advantages, old_lp, micro.teacher_logprobs.to(device),
                                                        mask, c.opd_coef)
            opd_stats["opd/reverse_kl"] = alg.REDUCTIONS[c.reduction](reverse_kl, mask)
        is_w, off_stats = None, {}
        if c.legacy_tis:  # the older switch, unchanged
            is_w = alg.truncated_is_weights(old_lp, rollout, mask, c.tis_cap)
        elif c.correction() != "none":
            is_w, off_stats = alg.off_policy_weights(old_lp, rollout, mask, kind=c.correction(),
                                                     level=c.off_policy_level, low=c.off_policy_low,
                                                     high=c.off_policy_high)
        pg, pg_stats = alg.policy_loss(logp, old_lp, advantages, mask,
                                       clip_low=c.clip_low, clip_high=c.clip_high, dual_clip=c.dual_clip,
                                       ratio_level="sequence" if c.estimator == "gspo" else "token",
                                       is_weights=is_w, reduction=c.reduction)
        loss, kl_value = pg, torch.zeros(())
        if ref is not None:
            kl = alg.kl_divergence(logp, ref[rows, -cols:].to(device), c.kl_kind)
            kl_value = alg.REDUCTIONS[c.reduction](kl, mask)
            loss = loss + c.kl_coef * kl_value
        if c.entropy_coef:
            loss = loss - c.entropy_coef * ent
        reported = {"loss": loss, "pg_loss": pg, "kl": kl_value, "entropy": ent, "rollout_logprob_gap": gap,
                    **pg_stats, **opd_stats, **{f"off_policy/{k}": v for k, v in off_stats.items()}}
        return loss, share, reported


def no_context() -> ContextManager[None]:
    """`Backend.update_context` for a backend that holds nothing around an update."""
    return contextlib.nullcontext()


class SplitStep:
    """`SplitStepTrainer`'s three training calls over a trainer's `Backend` (`slime_env.trainers.step`)."""

    def __init__(self, backend: Backend):
        self.backend = backend

    def forward(self, data: Sequence[Datum]) -> list[torch.Tensor]:
        """Each datum's log-probs of its targets, no gradient (`SplitStepTrainer.forward`)."""
        model = self.backend.model
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                return [lp.cpu() for chunk in self._chunks(data) for lp in self.backend.datum_logprobs(chunk)]
        finally:
            model.train(was_training)

    def forward_backward(self, data: Sequence[Datum], loss: DatumLoss) -> tuple[list[torch.Tensor], float]:
        """Log-probs and the summed `loss`; its gradient accumulates until `optim_step`
        (`SplitStepTrainer.forward_backward`). Micro-batches of `micro_batch_size` data bound the memory."""
        b = self.backend
        b.train_mode()
        out, total = [], 0.0
        for chunk in self._chunks(data):
            logps = b.datum_logprobs(chunk)
            chunk_loss = sum((loss(lp, {k: v.to(b.device) for k, v in d.inputs.items()})
                              for lp, d in zip(logps, chunk)), torch.zeros((), device=b.device))
            b.backward(chunk_loss, b.split_share())  # a sum over data: weighted for replicas only
            total += float(chunk_loss.detach())
            out += [lp.detach().cpu() for lp in logps]
        return out, total

    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        """AdamW with `adam`'s hyper-parameters on the accumulated gradients, then zero them
        (`SplitStepTrainer.optim_step`); counts as a step of `step_count` (what a checkpoint resumes)."""
        b = self.backend
        for g in b.param_groups():
            g.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,  # megatron's groups
                     weight_decay=adam.weight_decay * g.get("wd_mult", 1.0))  # without decay (norms, biases) keep none
        saved = b.config
        b.config = replace(saved, max_grad_norm=adam.grad_clip_norm or math.inf)  # what `optimizer_step` clips to
        try:
            grad_norm = b.optimizer_step()
        finally:
            b.config = saved
        b.zero_grad()
        b.step_count += 1
        return {"grad_norm": grad_norm, "learning_rate": adam.learning_rate}

    def _chunks(self, data: Sequence[Datum]) -> list[Sequence[Datum]]:
        if not data:
            raise ValueError("data is empty: forward / forward_backward need at least one Datum")
        n = self.backend.config.micro_batch_size
        return [data[i:i + n] for i in range(0, len(data), n)]
