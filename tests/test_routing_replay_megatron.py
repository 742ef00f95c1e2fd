"""Routing replay (R3), Megatron trainer on CPU (gloo, fp32): `routing_replay: rollout` replays the engine's routed
experts in megatron-core's TopKRouter; its log-probs equal the torch trainer's replayed ones, a recomputed layer
replays the same experts, and unsupported layouts are refused."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'slime_env[megatron]')")

from helpers import tiny  # noqa: E402
from test_routing_replay_trainer import rollouts  # noqa: E402

from slime_env.errors import InvalidInput  # noqa: E402
from slime_env.trainers.batch import pack  # noqa: E402
from slime_env.trainers.torch_trainer import TorchTrainer, TrainerConfig  # noqa: E402


@pytest.fixture(scope="module")
def parallel():
    from slime_env.trainers.megatron import init_parallel

    return init_parallel(1)


def test_megatron_replay_matches_the_torch_trainers(parallel):
    from slime_env.trainers.megatron_trainer import MegatronTrainer

    hf = tiny("qwen3_moe")
    trajs = rollouts(copy.deepcopy(hf).to(torch.bfloat16), lose_second_turn=(1,))  # a bf16 engine's routing
    batch = pack(trajs, group_size=2, pad_id=0, routing=True)
    torch_on = TorchTrainer(copy.deepcopy(hf), TrainerConfig(routing_replay="rollout"), pad_id=0)
    torch_off = TorchTrainer(copy.deepcopy(hf), TrainerConfig(), pad_id=0)
    mega_on = MegatronTrainer(hf, TrainerConfig(backend="megatron", routing_replay="rollout", lr=1e-3), pad_id=0)
    mega_off = MegatronTrainer(hf, TrainerConfig(backend="megatron", lr=1e-3), pad_id=0)
    mask = batch.loss_mask.bool()
    with torch.no_grad():
        t_on, t_off = torch_on.logprobs(torch_on.model, batch)[mask], torch_off.logprobs(torch_off.model, batch)[mask]
        m_on = mega_on.logprobs(mega_on.model, batch)[mask].cpu()
        m_off = mega_off.logprobs(mega_off.model, batch)[mask].cpu()
    assert torch.allclose(m_off, t_off, atol=2e-4)
    assert torch.allclose(m_on, t_on, atol=2e-4)
    # full recompute re-runs every layer in the backward: it must replay the same experts (same step as without)
    results = {}
    for recompute in ("none", "full"):
        tr = MegatronTrainer(hf, TrainerConfig(backend="megatron", routing_replay="rollout", lr=1e-3,
                                               recompute=recompute), pad_id=0)
        results[recompute] = tr.step(trajs, group_size=2)
    assert results["full"]["train/grad_norm"] == pytest.approx(results["none"]["train/grad_norm"], rel=1e-5)
    assert results["none"]["train/routing_replay_rerouted_tokens"] == trajs[1].spans[2].end - trajs[1].spans[2].start


def test_megatron_replay_refuses_what_it_cannot_replay(parallel):
    from slime_env.trainers.megatron_trainer import MegatronTrainer

    with pytest.raises(InvalidInput, match="not a MoE model"):
        MegatronTrainer(tiny("llama"), TrainerConfig(backend="megatron", routing_replay="rollout"), pad_id=0)
