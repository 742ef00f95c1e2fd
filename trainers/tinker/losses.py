"""Tinker's built-in losses as pure functions of one datum's tensors (Tinker's definitions: every loss is a *sum*
over tokens; the caller normalises through `weights` / `advantages`).

`logp`: the trained model's log-probs of `target_tokens` (differentiable); `inputs`: the datum's `loss_fn_inputs`
as tensors (`logprobs` are the sampler's, `advantages` per token); `config`: the request's `loss_fn_config`.
`loss_for(name, config)` binds the config: a `slime_env.trainers.split_step.DatumLoss`, what a trainer's
`forward_backward` takes. `ppo` is `trainers.algorithms.policy_loss` (the run's clipped surrogate) summed over the
datum; the others are Tinker's own.

    cross_entropy        L = -sum(w * logp)
    importance_sampling  r = exp(logp - q);  L = -sum(r * A)
    ppo                  L = -sum(min(r * A, clip(r, lo, hi) * A))          lo, hi = clip_low/high_threshold
    cispo                L = -sum(sg(clip(r, lo, hi)) * logp * A)
    dro                  L = -sum(logp * A - beta / 2 * (logp - q)^2)       beta from loss_fn_config
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from slime_env.errors import InvalidInput
from slime_env.trainers import algorithms as alg
from slime_env.trainers.split_step import DatumLoss

LossFn = Callable[[torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, float | str]], torch.Tensor]


def _ratio(logp: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return torch.exp(logp - inputs["logprobs"])


def _clip(config: Mapping[str, float | str]) -> tuple[float, float]:
    return float(config.get("clip_low_threshold", 0.8)), float(config.get("clip_high_threshold", 1.2))


def cross_entropy(logp, inputs, config):
    return -(inputs["weights"] * logp).sum()


def importance_sampling(logp, inputs, config):
    return -(_ratio(logp, inputs) * inputs["advantages"]).sum()


def ppo(logp, inputs, config):
    lo, hi = _clip(config)  # Tinker's thresholds are ratios; policy_loss clips to [1 - clip_low, 1 + clip_high]
    loss, _ = alg.policy_loss(logp[None], inputs["logprobs"][None], inputs["advantages"][None],
                              torch.ones_like(logp)[None], clip_low=1.0 - lo, clip_high=hi - 1.0,
                              reduction="seq_mean_token_sum")  # one sequence: the sum over its tokens
    return loss


def cispo(logp, inputs, config):
    lo, hi = _clip(config)
    return -(_ratio(logp, inputs).clamp(lo, hi).detach() * logp * inputs["advantages"]).sum()


def dro(logp, inputs, config):
    beta = float(config["beta"])
    return -(logp * inputs["advantages"] - 0.5 * beta * (logp - inputs["logprobs"]) ** 2).sum()


# name -> (function, the loss_fn_inputs it needs besides target_tokens)
LOSSES: dict[str, tuple[LossFn, tuple[str, ...]]] = {
    "cross_entropy": (cross_entropy, ("weights",)),
    "importance_sampling": (importance_sampling, ("logprobs", "advantages")),
    "ppo": (ppo, ("logprobs", "advantages")),
    "cispo": (cispo, ("logprobs", "advantages")),
    "dro": (dro, ("logprobs", "advantages")),
}


def loss_for(name: str, config: Mapping[str, float | str]) -> tuple[DatumLoss, tuple[str, ...]]:
    """The loss named `name` with `config` bound, and the `loss_fn_inputs` it needs besides `target_tokens`; a clear
    refusal naming the losses served, or the config field a loss lacks."""
    if name not in LOSSES:
        raise InvalidInput(f"unknown loss_fn {name!r}; this server computes {sorted(LOSSES)} (custom losses run in "
                           "the SDK over `forward` and a linear cross_entropy, as Tinker's client-side path does)")
    if name == "dro" and "beta" not in config:
        raise InvalidInput("loss 'dro' needs loss_fn_config={'beta': ...}")
    fn, needed = LOSSES[name]
    config = dict(config)
    return (lambda logp, inputs: fn(logp, inputs, config)), needed
