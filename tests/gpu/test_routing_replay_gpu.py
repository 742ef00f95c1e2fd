"""MoE routing replay (R3) on one GPU (run on the GPU machine): a bf16 engine on CUDA and an fp32 / bf16 trainer route a
Qwen3-MoE shape differently; with `routing_replay: rollout` the trainer's top-k equals the engine's at every replayed
forward, the k3 KL between train and rollout log-probs falls, and a Megatron step with replay runs.

    python -m pytest tests/gpu/test_routing_replay_gpu.py -q
    python bench/routing_replay.py --device cuda --shape a3b-slice --episodes 64 --new-tokens 128
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))


@pytest.mark.parametrize("shape", ["small", "a3b-slice"])
def test_replay_removes_the_routing_mismatch_on_cuda(shape):
    import routing_replay as bench
    from slime_env.trainers.torch_trainer import TorchTrainer, TrainerConfig

    model = bench.random_model(shape, 0)
    engine = copy.deepcopy(model).to(device="cuda", dtype=torch.bfloat16)
    trajs = bench.rollouts(engine, 16, 64, model.config.vocab_size, 0)
    del engine
    model = model.cuda()
    off = TorchTrainer(model, TrainerConfig(routing_replay="rollout"), pad_id=0)
    off.routing_shape = None
    without = bench.measure(off, trajs, 4)
    with_r3 = bench.measure(TorchTrainer(model, TrainerConfig(routing_replay="rollout"), pad_id=0), trajs, 4)
    print(shape, "without", without, "with", with_r3)
    assert without["decisions_differ"] > 0
    assert with_r3["decisions_differ"] == 0 and with_r3["tokens_differ"] == 0
    assert with_r3["k3_kl"] < without["k3_kl"]


def test_megatron_step_with_replay_on_cuda():
    pytest.importorskip("megatron.core")
    import routing_replay as bench
    from slime_env.trainers.megatron import init_parallel
    from slime_env.trainers.megatron_trainer import MegatronTrainer
    from slime_env.trainers.torch_trainer import TrainerConfig

    init_parallel(1)
    model = bench.random_model("small", 0)
    trajs = bench.rollouts(copy.deepcopy(model).to(device="cuda", dtype=torch.bfloat16), 8, 32,
                           model.config.vocab_size, 0)
    trainer = MegatronTrainer(model, TrainerConfig(backend="megatron", routing_replay="rollout", lr=1e-5,
                                                   dtype="float32"), pad_id=0)
    metrics = trainer.step(trajs, group_size=2)
    assert metrics["train/routing_replay_rerouted_tokens"] == 0 and metrics["train/grad_norm"] > 0
