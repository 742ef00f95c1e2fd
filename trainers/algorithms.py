"""RL math as small pure functions over tensors: advantage estimators, policy losses, KL, importance
correction, entropy, masked reductions. No models, devices or data loading here — the PyTorch trainer
and the Megatron trainer call these same functions.

Shapes: per-token tensors are `[B, T]` (response positions), with `mask` 1 where a token was sampled by
the policy (the trajectory's loss mask) and 0 elsewhere (prompt, env output, template glue, padding).
Every loss multiplies by `mask` before reducing: a masked token contributes nothing to the loss or to
the gradient.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch

# --- reductions ---------------------------------------------------------------------------------------

def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(x * m) / max(sum(m), 1) — the "token-mean" over all unmasked tokens (or along `dim`)."""
    mask = mask.to(x.dtype)
    total = (x * mask).sum() if dim is None else (x * mask).sum(dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count.clamp(min=1.0)


def seq_mean_token_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """mean over sequences of sum over their tokens (Dr. GRPO's length-unbiased reduction)."""
    return (x * mask.to(x.dtype)).sum(-1).mean()


def seq_mean_token_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """mean over sequences of the mean over their tokens (the original GRPO reduction)."""
    return masked_mean(x, mask, dim=-1).mean()


REDUCTIONS = {"token_mean": masked_mean, "seq_mean_token_sum": seq_mean_token_sum,
              "seq_mean_token_mean": seq_mean_token_mean}


# --- advantage estimators (outcome rewards: one scalar per sequence) ----------------------------------

def _group_view(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    return rewards.view(-1, group_size)


def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: A_i = (r_i - mean(r_group)) / (std(r_group) + eps). `rewards` [N], groups consecutive."""
    r = _group_view(rewards, group_size)
    mean, std = r.mean(-1, keepdim=True), r.std(-1, keepdim=True, unbiased=True) if group_size > 1 else 0 * r
    return ((r - mean) / (std + eps)).view(-1)


def dr_grpo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dr. GRPO: A_i = r_i - mean(r_group) (no division by the std, which up-weights easy/hard groups)."""
    r = _group_view(rewards, group_size)
    return (r - r.mean(-1, keepdim=True)).view(-1)


def reinforce_plus_plus_advantages(rewards: torch.Tensor, group_size: int | None = None,
                                   eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++: A = (r - b) / std_batch(r - b), whitened over the whole batch.

    b = 0 (plain REINFORCE++), or the group mean when `group_size` is given (REINFORCE++-baseline).
    """
    centred = rewards if group_size is None else (rewards.view(-1, group_size)
                                                  - rewards.view(-1, group_size).mean(-1, keepdim=True)).view(-1)
    if group_size is None:
        centred = centred - centred.mean()
    return centred / (centred.std(unbiased=False) + eps)


class RoleBaselines:
    """SPIRAL's role-conditioned advantage estimation (RAE) for multi-agent self-play: a running baseline
    per (game, role), b <- decay * b + (1 - decay) * r for each trajectory in order, then A = r - b.
    Unlike group baselines it needs no n samples of one prompt, and it keeps a shared policy from
    learning a seat's advantage (X moves first) as skill. `state_dict()` / `load_state_dict()` for
    checkpoints."""

    def __init__(self, decay: float = 0.95):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.values: dict[str, float] = {}

    def advantages(self, rewards: torch.Tensor, keys: list[tuple[str, str] | None]) -> torch.Tensor:
        """Advantages for `rewards` [N]; a None key (a failed trajectory) gets 0 and moves no baseline."""
        if rewards.dim() != 1 or rewards.numel() != len(keys):
            raise ValueError(f"{rewards.numel()} rewards for {len(keys)} (game, role) keys")
        out = torch.zeros_like(rewards)
        for i, game_role in enumerate(keys):
            if game_role is None:
                continue
            key = "/".join(game_role)
            r = float(rewards[i])
            b = self.decay * self.values.get(key, 0.0) + (1.0 - self.decay) * r
            self.values[key] = b
            out[i] = r - b
        return out

    def state_dict(self) -> dict[str, object]:
        return {"decay": self.decay, "values": dict(self.values)}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.decay, self.values = float(state["decay"]), dict(state["values"])


def token_returns(turn_rewards: torch.Tensor, turn_of_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token return-to-go from per-turn rewards: token t of turn k gets sum_{j >= k} r_j (gamma = 1).

    `turn_rewards` [B, K], `turn_of_token` [B, T] (index of the turn each token belongs to, clamped to K-1).
    """
    to_go = turn_rewards.flip(-1).cumsum(-1).flip(-1)  # R_k = sum_{j>=k} r_j
    idx = turn_of_token.clamp(min=0, max=turn_rewards.shape[-1] - 1)
    return torch.gather(to_go, -1, idx) * mask.to(to_go.dtype)


def gae_advantages(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
                   lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's GAE over the unmasked (generated) tokens: (advantages, returns), both [B, T].

    delta_t = r_t + gamma * V_{t+1} - V_t;  A_t = delta_t + gamma * lam * A_{t+1}; returns = A + V.
    Masked positions are skipped (the next value is that of the next *generated* token).
    """
    B, T = token_rewards.shape
    adv = torch.zeros_like(values)
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)
    next_adv = torch.zeros_like(next_value)
    m = mask.to(values.dtype)
    for t in reversed(range(T)):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = a * m[:, t]
        next_value = torch.where(m[:, t] > 0, values[:, t], next_value)
        next_adv = torch.where(m[:, t] > 0, a, next_adv)
    return adv, (adv + values) * m


def token_rewards(turn_rewards: torch.Tensor, turn_of_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token rewards for PPO: turn k's reward on the last generated token of turn k, 0 elsewhere. [B, T].

    With one reward per sequence (`turn_rewards` [B, 1]) that is the outcome reward on the last generated token.
    """
    B, T = mask.shape
    out = torch.zeros((B, T), dtype=torch.float32)
    m = mask > 0
    turns = turn_of_token.clamp(min=0, max=turn_rewards.shape[-1] - 1)
    for b in range(B):
        positions = m[b].nonzero().squeeze(-1)
        if positions.numel() == 0:
            continue
        t = turns[b, positions]
        last = torch.ones_like(t, dtype=torch.bool)
        last[:-1] = t[1:] != t[:-1]  # the last generated token of each turn
        if turn_rewards.shape[-1] == 1:
            last[:] = False
            last[-1] = True
        out[b, positions[last]] = turn_rewards[b, t[last]].float()
    return out


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the unmasked entries; 0 at masked ones (PPO's advantage normalisation)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean).square(), mask)
    return (x - mean) * torch.rsqrt(var + eps) * mask.to(x.dtype)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, *,
               clip: float | None = 0.2, reduction: str = "token_mean") -> torch.Tensor:
    """PPO's critic loss: 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2), reduced over masked
    tokens (no clipping with `clip=None`)."""
    err = (values - returns).square()
    if clip is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        err = torch.maximum(err, (clipped - returns).square())
    return 0.5 * REDUCTIONS[reduction](err, mask)


# --- policy loss ----------------------------------------------------------------------------------------

def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                clip_low: float = 0.2, clip_high: float = 0.28, dual_clip: float | None = None,
                ratio_level: str = "token", is_weights: torch.Tensor | None = None,
                reduction: str = "token_mean") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped surrogate, per token, reduced over unmasked tokens; returns (loss, stats).

    ratio = exp(logp - old_logp) per token, or GSPO's sequence ratio exp(mean_t(logp - old_logp))
    (`ratio_level="sequence"`). loss_t = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)
    (DAPO's separate low/high clip). Dual clip: for A < 0 the loss is capped at -dual_clip * A.
    `is_weights` (truncated importance sampling against the rollout engine) multiply the per-token loss.
    """
    m = mask.to(logp.dtype)
    log_ratio = (logp - old_logp) * m
    if ratio_level == "sequence":
        seq = log_ratio.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
        log_ratio = seq + logp - logp.detach()  # value of the sequence ratio, gradient through each token
    elif ratio_level != "token":
        raise ValueError(f"ratio_level must be 'token' or 'sequence', got {ratio_level!r}")
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
    adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(-1).expand_as(logp)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * dual_clip), loss)
    if is_weights is not None:
        loss = loss * is_weights
    clipped_frac = masked_mean(((unclipped < clipped) & (adv != 0)).to(logp.dtype), m)
    reduced = REDUCTIONS[reduction](loss, m)
    return reduced, {"clip_frac": clipped_frac.detach(), "ratio_mean": masked_mean(ratio.detach(), m)}


def truncated_is_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                         cap: float = 2.0) -> torch.Tensor:
    """Truncated importance sampling (slime's --use-tis): w = min(exp(old_logp - rollout_logp), cap).

    Corrects for the engine sampling from a slightly different distribution than the trainer computes
    (kernels, precision). No gradient; 0 at masked positions.
    """
    w = torch.exp((old_logp - rollout_logp).clamp(max=20.0)).clamp(max=cap)
    return (w * mask.to(w.dtype)).detach()


OFF_POLICY_KINDS = ("none", "tis", "mis", "decoupled")
OFF_POLICY_LEVELS = ("token", "sequence", "geometric")


def off_policy_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, *, kind: str = "tis",
                       level: str = "token", low: float = 0.5, high: float = 2.0
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weights that correct for tokens sampled by another policy than the one the loss is centred on.

    rho = pi_old / pi_rollout per token (`old_logp`: the trainer's log-probs at the start of the step, the proximal
    policy; `rollout_logp`: the engine's, the behaviour policy — stale weights in async training, other kernels
    always). `level`: token (rho_t), sequence (exp(sum_t log rho_t), every token of the row) or geometric
    (exp(mean_t log rho_t)), as slime's train_infer_mismatch_helper. `kind`: tis — min(rho, high) (truncated IS);
    mis — rho inside [low, high], 0 outside (masked IS); decoupled — AReaL's behaviour weight of the decoupled PPO
    objective: rho where rho <= high, else 0 (token level). Returns (weights: no gradient, 0 at masked positions;
    stats: weight_mean, clipped_frac (tokens whose weight was truncated or zeroed), logprob_gap (mean |old - rollout|),
    kl (mean k3 estimate of KL(rollout || old)))."""
    if kind not in OFF_POLICY_KINDS or kind == "none":
        raise ValueError(f"off-policy kind {kind!r}: one of {OFF_POLICY_KINDS[1:]}")
    if level not in OFF_POLICY_LEVELS:
        raise ValueError(f"off-policy level {level!r}: one of {OFF_POLICY_LEVELS}")
    m = mask.to(torch.float32)
    log_rho = ((old_logp - rollout_logp).float() * m).detach()
    if kind != "decoupled" and level != "token":
        per_row = log_rho.sum(-1, keepdim=True)
        if level == "geometric":
            per_row = per_row / m.sum(-1, keepdim=True).clamp(min=1.0)
        log_rho = per_row.expand_as(log_rho)
    rho = torch.exp(log_rho.clamp(-20.0, 20.0))
    if kind == "tis":
        w = rho.clamp(max=high)
        changed = rho > high
    else:
        keep = rho <= high if kind == "decoupled" else (rho >= low) & (rho <= high)
        w = torch.where(keep, rho, torch.zeros_like(rho))
        changed = ~keep
    w = w * m
    gap = (old_logp - rollout_logp).float().detach()
    stats = {"weight_mean": masked_mean(w, m), "clipped_frac": masked_mean(changed.float(), m),
             "logprob_gap": masked_mean(gap.abs(), m), "kl": masked_mean(torch.exp(gap) - 1.0 - gap, m)}
    return w, stats


# --- KL and entropy ---------------------------------------------------------------------------------------

def kl_divergence(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token KL estimate of pi against the reference, from sampled-token log-probs.

    k1: log r (r = pi/ref); k2: (log r)^2 / 2; k3 / low_var_kl: exp(-log r) - 1 + log r (Schulman's
    unbiased, non-negative estimator; low_var_kl clamps it to [-10, 10] as verl and slime do).
    """
    log_r = logp - ref_logp
    if kind == "k1":
        return log_r
    if kind == "k2":
        return 0.5 * log_r.square()
    if kind in ("k3", "low_var_kl"):
        kl = torch.exp(-log_r) - 1.0 + log_r
        return kl.clamp(-10.0, 10.0) if kind == "low_var_kl" else kl
    raise ValueError(f"unknown KL kind {kind!r}: k1, k2, k3, low_var_kl")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax distribution at each position: -sum p log p, [B, T]. Differentiable; without a graph
    (`torch.no_grad`) it works a slice of positions at a time, so no [B, T, V] temporary is made."""
    if torch.is_grad_enabled() and logits.requires_grad:
        logp = torch.log_softmax(logits.float(), dim=-1)
        return -(logp.exp() * logp).sum(-1)
    out = torch.empty(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    for s in _position_slices(logits):
        logp = torch.log_softmax(logits[s].float(), dim=-1)
        out[s] = -(logp.exp() * logp).sum(-1)
    return out


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token_t) for each position from logits aligned with the tokens they predict ([B, T, V], [B, T]),
    in float32: log_softmax(logits)[token], computed as logit[token] - logsumexp(logits)."""
    return _TokenLogprobs.apply(logits, tokens)


SLICE_ELEMENTS = {"cpu": 1 << 24, "cuda": 1 << 28}  # float32 elements of one slice's temporaries (64 MB, 1 GB)


def _position_slices(x: torch.Tensor) -> Iterator[tuple]:
    """Indexes that cover the positions of `x` ([..., T, V]) a few at a time, as views: a strided `x` (logits[:, :-1])
    is never copied whole, and a slice's float32 temporaries stay near 64 MB on a CPU, 1 GB on a GPU (where smaller
    slices cost kernel launches: 64 MB slices took log-probs of 4 x 4,096 tokens from 36 to 68 ms on an H200)."""
    step = max(1, SLICE_ELEMENTS["cuda" if x.is_cuda else "cpu"] // x.shape[-1])
    for lead in itertools.product(*(range(n) for n in x.shape[:-2])):
        for i in range(0, x.shape[-2], step):
            yield (*lead, slice(i, i + step))


class _TokenLogprobs(torch.autograd.Function):
    """`token_logprobs` without a [B, T, V] log-softmax: the forward keeps the logits (alive for the backward anyway)
    and one logsumexp per position; both passes work a slice of positions at a time. A whole log_softmax kept its
    float32 output for the backward and made temporaries as large beside it (bench/logprobs.py: 4 x 4,096 tokens of
    a 151,936-token vocabulary in bf16 on an H200, 27.8 GB before, 9.3 GB now)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        lse = torch.empty(logits.shape[:-1], dtype=torch.float32, device=logits.device)
        for s in _position_slices(logits):
            lse[s] = torch.logsumexp(logits[s].float(), dim=-1)
        ctx.save_for_backward(logits, tokens, lse)
        return logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).float() - lse

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, tokens, lse = ctx.saved_tensors
        out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        grad = grad.float().unsqueeze(-1)
        for s in _position_slices(logits):  # d/dx (x[t] - logsumexp(x)) = onehot(t) - softmax(x)
            part = torch.exp(logits[s].float() - lse[s].unsqueeze(-1)).mul_(-grad[s])
            out[s] = part.scatter_add_(-1, tokens[s].unsqueeze(-1), grad[s])
        return out, None


def sft_loss(logp: torch.Tensor, mask: torch.Tensor, reduction: str = "token_mean") -> torch.Tensor:
    """Supervised fine-tuning: the negative log-likelihood of the masked tokens (the assistant's), reduced like the
    RL losses: loss = reduce_t(-log p(token_t)) over `mask`."""
    return REDUCTIONS[reduction](-logp, mask.to(logp.dtype))


def opd_advantages(advantages: torch.Tensor, student_logp: torch.Tensor, teacher_logp: torch.Tensor,
                   mask: torch.Tensor, coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """On-policy distillation (slime's `--use-opd`): A_t - coef * (log p_student(y_t) - log p_teacher(y_t)) on the
    student's own sampled tokens. The bracket is the per-token estimate of the reverse KL(student || teacher), so a
    policy-gradient step on these advantages lowers it while the estimator's own advantages still apply. Returns
    (advantages, the masked per-token reverse-KL estimate [B, T])."""
    m = mask.to(student_logp.dtype)
    reverse_kl = (student_logp - teacher_logp) * m
    return advantages - coef * reverse_kl, reverse_kl


ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo",
                        "rae")


def outcome_advantages(estimator: str, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per-sequence advantages for the outcome-reward estimators (GSPO uses GRPO's; PPO's come from GAE over a
    value model, computed by the trainer: zeros here)."""
    if estimator == "ppo":
        return torch.zeros_like(rewards)
    if estimator in ("grpo", "gspo"):
        return grpo_advantages(rewards, group_size)
    if estimator == "dr_grpo":
        return dr_grpo_advantages(rewards, group_size)
    if estimator == "reinforce_plus_plus":
        return reinforce_plus_plus_advantages(rewards)
    if estimator == "reinforce_plus_plus_baseline":
        return reinforce_plus_plus_advantages(rewards, group_size)
    if estimator == "rae":
        raise ValueError("estimator 'rae' keeps running baselines: the trainer passes them (RoleBaselines)")
    raise ValueError(f"unknown advantage estimator {estimator!r}; one of {ADVANTAGE_ESTIMATORS} (ppo: gae_advantages)")
