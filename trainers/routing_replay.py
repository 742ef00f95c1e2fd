"""Routing replay (R3) in the training forward of Hugging Face MoE layers (`trainer: {routing_replay: rollout}`).

The engine's routed experts ride on each trajectory (`slime_env.routing`); `pack` lays them out per forward position
(`TrainBatch.routed_experts` [B, L, layers, top_k], -1 where the trainer routes itself: prompt and inserted tokens,
tokens whose routing was lost to an abort or preemption). `use_routes(model, routes)` makes every MoE router of the
model (`layer.mlp.gate`, Qwen3-MoE's `(logits, weights, index)` router) replay them, as slime does in Megatron's
`compute_topk`:

    probs   = softmax(router_logits)                      # the router's own scores, with their gradient
    index   = replayed experts where recorded, else top-k(probs)
    weights = probs.gather(index)  (renormalised when the model does: norm_topk_prob)

so the token goes through the experts the engine used, and the router still gets the gradient of the gate weights
of those experts. The routes stay set until the next call, so a checkpointed layer recomputed in the backward pass
replays the same experts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from slime_env.agents.routing_capture import moe_routers

from slime_env.errors import InvalidInput

ROUTING_REPLAY_MODES = ("off", "rollout")


def model_routing_shape(model: Any) -> tuple[int, int, int]:
    """(num_hidden_layers, top_k, num_experts) of a MoE model; InvalidInput for a dense one."""
    routers = moe_routers(model)
    if not routers:
        raise InvalidInput(f"routing_replay: {type(model).__name__} has no MoE router (layer.mlp.gate): routing replay "
                           "is for MoE models; set trainer.routing_replay: off")
    gate = routers[0][1]
    return len(model.model.layers), int(gate.top_k), int(gate.num_experts)


def _replay_forward(gate: Any):
    def forward(hidden_states: torch.Tensor):
        h = hidden_states.reshape(-1, gate.hidden_dim)
        logits = F.linear(h, gate.weight)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        _, index = torch.topk(probs, gate.top_k, dim=-1)
        routes = gate._replay_routes
        if routes is not None:
            if routes.shape[0] != h.shape[0]:
                raise InvalidInput(f"routing replay: {routes.shape[0]} routed positions for a forward of {h.shape[0]} "
                                   "tokens (the batch and its routes diverged)")
            have = (routes >= 0).all(-1, keepdim=True)
            index = torch.where(have, routes.to(index.dtype), index)
        weights = probs.gather(1, index)
        if gate.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), index
    return forward


def install(model: Any) -> None:
    """Make `model`'s MoE routers replay routes set by `use_routes`
    (idempotent; without routes they route as before)."""
    for _, gate in moe_routers(model):
        if getattr(gate, "_replay_routes", "unset") == "unset":
            gate._replay_routes = None
            gate.forward = _replay_forward(gate)


def use_routes(model: Any, routes: torch.Tensor | None) -> None:
    """Routes for the next forward(s) of `model` ([B, L, layers, top_k] matching its input, -1: route itself; None:
    route every token itself). Installs the replay on first use."""
    install(model)
    for layer, gate in moe_routers(model):
        gate._replay_routes = None if routes is None else routes[:, :, layer].reshape(-1, routes.shape[-1])


def check_routing(trajectories: Any, model_shape: tuple[int, int, int]) -> None:
    """InvalidInput naming the trajectory whose routed experts do not fit the model (shape or expert ids)."""
    layers, top_k, experts = model_shape
    for i, t in enumerate(trajectories):
        if t.routing is not None:
            t.routing.experts.check_model(layers, top_k, experts,
                                          where=f"trajectory {i} (task {t.task.id or '-'}) routed experts")


def rerouted_tokens(loss_mask: torch.Tensor, routes: torch.Tensor | None) -> tuple[float, float]:
    """(loss tokens the trainer routed itself for want of a recorded routing, their share of the loss tokens): the
    forward that gives token c's log-prob is column c - 1."""
    tokens = float(loss_mask.sum())
    if routes is None:
        return tokens, 1.0 if tokens else 0.0
    missing = torch.zeros_like(loss_mask, dtype=torch.bool)
    missing[:, 1:] = ~(routes[:, :-1] >= 0).flatten(2).all(-1)
    lost = float((loss_mask.bool() & missing).sum())
    return lost, lost / tokens if tokens else 0.0


# --- megatron-core's TopKRouter (slime_env.trainers.megatron_trainer) ------------------------------------------------
class MegatronReplay:
    """Stands in for megatron-core's `RouterReplay` on one `TopKRouter` (its `topk_routing_with_score_function` calls
    `router_replay.get_replay_topk`): its own top-k, with the recorded experts where `routes` [tokens, top_k] has them,
    and the scores gathered at those experts (slime's `scores.gather(1, top_indices)`: the router keeps its
    gradient). Without routes it routes as before."""

    def __init__(self) -> None:
        self.routes: torch.Tensor | None = None

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        values, index = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.routes is None:
            return values, index
        if self.routes.shape[0] != scores.shape[0]:
            raise InvalidInput(f"routing replay: {self.routes.shape[0]} routed positions for a forward of "
                               f"{scores.shape[0]} tokens (the batch and its routes diverged)")
        have = (self.routes >= 0).all(-1, keepdim=True)
        index = torch.where(have, self.routes.to(device=index.device, dtype=index.dtype), index)
        return scores.gather(1, index), index


def megatron_routers(model: Any) -> list[tuple[int, Any]]:
    """(global layer index, TopKRouter) of a megatron GPTModel's MoE layers, replay installed (idempotent)."""
    out = []
    for module in model.modules():
        if hasattr(module, "router_replay") and hasattr(module, "layer_number") and hasattr(module, "topk"):
            if not isinstance(module.router_replay, MegatronReplay):
                module.router_replay = MegatronReplay()
            out.append((int(module.layer_number) - 1, module))
    return out


def megatron_use_routes(model: Any, routes: torch.Tensor | None) -> None:
    """`routes` [tokens as the model is fed them, layers, top_k] (-1: route itself) or None for the next forward(s)."""
    for layer, router in megatron_routers(model):
        router.router_replay.routes = None if routes is None else routes[:, layer]
