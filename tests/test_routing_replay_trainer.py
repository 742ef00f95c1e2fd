"""Routing replay (R3), torch trainer: `trainer.routing_replay: rollout` replays the engine's routed experts in the
training forward of the MoE layers (router gradient kept), routes inserted tokens itself, counts lost routing, and
refuses routed experts of another model."""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from helpers import tiny  # noqa: E402
from slime_env.agents.routing_capture import RoutingCapture  # noqa: E402
from slime_env.agents.transformers_policy import TransformersPolicy  # noqa: E402
from slime_env.trainers.batch import pack  # noqa: E402
from slime_env.trainers.torch_trainer import TorchTrainer, TrainerConfig  # noqa: E402

from slime_env.errors import InvalidInput  # noqa: E402
from slime_env.ledger import TokenLedger  # noqa: E402
from slime_env.routing import RoutedExperts  # noqa: E402
from slime_env.trajectory import Trajectory  # noqa: E402
from slime_env.types import Task  # noqa: E402

PARAMS = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True}


class Tok:
    pad_token_id, eos_token_id = 0, 1

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


def rollouts(engine_model, n=4, lose_second_turn=(), seed=0):
    """Two-turn trajectories from `engine_model`: generated, inserted, generated. Rows in `lose_second_turn` lose the
    second turn's routing (an aborted / preempted request whose engine returned none)."""
    policy = TransformersPolicy(engine_model, Tok(), max_batch_size=4, seed=seed)

    async def one(i):
        led = TokenLedger([5 + i, 6, 7, 8, 9])
        g = await policy.generate(led.ids, PARAMS, session=f"s{i}")
        led.add_generated(g.token_ids, g.logprobs, 0, g.routed_experts)
        led.add_inserted([30, 31, 32], 0)
        g = await policy.generate(led.ids, PARAMS, session=f"s{i}")
        led.add_generated(g.token_ids, g.logprobs, 1, None if i in lose_second_turn else g.routed_experts)
        return Trajectory(task=Task(prompt="p", id=f"t{i}"), prompt_ids=led.prompt_ids, response_ids=led.response_ids,
                          loss_mask=led.loss_mask, rollout_logprobs=led.rollout_logprobs, spans=led.spans,
                          turn_rewards=[float(i % 2)], reward=float(i % 2), status="completed", routing=led.routing())

    async def main():
        return await asyncio.gather(*(one(i) for i in range(n)))
    try:
        return asyncio.run(main())
    finally:
        policy.close()


def trainer_routing(trainer, batch):
    """The experts the trainer's forward chose per column: [B, L, layers, top_k]."""
    cap = RoutingCapture(trainer.model)
    try:
        with torch.no_grad():
            trainer.logprobs(trainer.model, batch)
        B, L = batch.input_ids.shape
        return cap.rows(list(range(B * L))).reshape(B, L, cap.num_layers, cap.top_k)
    finally:
        cap.close()


def test_replay_uses_the_engines_experts_for_generated_tokens_and_keeps_the_router_gradient():
    model = tiny("qwen3_moe")
    engine = copy.deepcopy(model).to(torch.bfloat16)  # the realistic source of mismatch: a bf16 engine
    trajs = rollouts(engine, lose_second_turn=(2,))
    trainer = TorchTrainer(model, TrainerConfig(lr=1e-3, routing_replay="rollout", micro_batch_size=2), pad_id=0)
    batch = pack(trajs, group_size=2, pad_id=0, routing=True)
    routes = batch.routed_experts
    assert routes.shape == (*batch.input_ids.shape, 3, 2) and routes.dtype == torch.int16
    chosen = trainer_routing(trainer, batch)
    have = (routes >= 0).all(-1).all(-1)
    for layer in (0, 2):  # MoE layers: every recorded position follows the engine's experts exactly
        assert torch.equal(chosen[:, :, layer][have].sort(-1).values, routes[:, :, layer][have].long().sort(-1).values)
    # unreplayed (prompt / inserted / lost) positions route themselves: the plain forward's choice
    plain = TorchTrainer(copy.deepcopy(model), TrainerConfig(lr=1e-3), pad_id=0)
    mine = trainer_routing(plain, batch)
    mask = batch.attention_mask.bool() & ~have
    assert torch.equal(chosen[mask][:, [0, 2]].sort(-1).values, mine[mask][:, [0, 2]].sort(-1).values)
    # one RL step: the router still learns (its gate weights get a gradient through the replayed experts' probs)
    before = [g.weight.detach().clone() for g in (model.model.layers[0].mlp.gate, model.model.layers[2].mlp.gate)]
    metrics = trainer.step(trajs, group_size=2)
    after = [model.model.layers[0].mlp.gate.weight, model.model.layers[2].mlp.gate.weight]
    assert all(not torch.equal(b, a) for b, a in zip(before, after))
    # the second turn of trajectory 2 lost its routing: those loss tokens were re-routed, and the metric says so
    second = trajs[2].spans[2]
    assert second.kind == "generated" and second.turn == 1
    lost = second.end - second.start
    assert metrics["train/routing_replay_rerouted_tokens"] == lost
    assert 0 < metrics["train/routing_replay_rerouted_frac"] < 1


def test_replaying_the_trainers_own_routing_changes_nothing():
    model = tiny("qwen3_moe")
    trajs = rollouts(copy.deepcopy(model))  # an fp32 engine, unbatched prompts: the same routing as the trainer's
    on = TorchTrainer(model, TrainerConfig(routing_replay="rollout"), pad_id=0)
    off = TorchTrainer(copy.deepcopy(model), TrainerConfig(), pad_id=0)
    batch = pack(trajs, group_size=2, pad_id=0, routing=True)
    with torch.no_grad():
        a, b = on.logprobs(on.model, batch), off.logprobs(off.model, batch)
    assert torch.allclose(a, b, atol=1e-5)


def test_routed_experts_of_another_model_are_refused():
    model = tiny("qwen3_moe")
    trajs = rollouts(copy.deepcopy(model), n=2)
    trainer = TorchTrainer(model, TrainerConfig(routing_replay="rollout"), pad_id=0)
    bad = [Trajectory(**{**{f: getattr(t, f) for f in t.__dataclass_fields__},
                         "routing": type(t.routing)(t.routing.ranges, RoutedExperts.from_array(
                             np.zeros((t.routing.num_tokens, 4, 2), dtype=np.int16)))}) for t in trajs]
    with pytest.raises(InvalidInput,
                       match=r"trajectory 0 \(task t0\) routed experts have shape \[\*, 4, 2\].*3 layers"):
        trainer.step(bad, group_size=2)
    big = [Trajectory(**{**{f: getattr(t, f) for f in t.__dataclass_fields__},
                         "routing": type(t.routing)(t.routing.ranges, RoutedExperts.from_array(
                             np.full((t.routing.num_tokens, 3, 2), 7, dtype=np.int16)))}) for t in trajs]
    with pytest.raises(InvalidInput, match="expert 7 but the model has 4 experts"):
        trainer.step(big, group_size=2)
    with pytest.raises(InvalidInput, match="no MoE router"):
        TorchTrainer(tiny("llama"), TrainerConfig(routing_replay="rollout"), pad_id=0)
    with pytest.raises(ValueError, match="routing_replay 'always'"):
        TrainerConfig(routing_replay="always")
