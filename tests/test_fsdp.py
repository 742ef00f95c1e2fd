"""`FSDPTrainer` (backend: fsdp) on CPU with gloo: FSDP2 over two processes gives the single-process
`TorchTrainer` step, with idle passes and activation checkpointing; checkpoints round-trip; the YAML switch."""

from __future__ import annotations

import pytest
import torch
from helpers import run_dist_check, same_weights, tiny, trajectories
from slime_env.trainers.torch_trainer import TorchTrainer, TrainerConfig


def test_fsdp2_over_two_ranks_equals_the_single_process_torch_trainer(tmp_path):
    """Two gloo ranks, each holding half of every parameter and half the rows: the loss, gradient norm and the
    weights after the step equal `TorchTrainer`'s in one process. With 4 failed trajectories rank 1's last
    micro-batches have no loss tokens (idle passes keep the parameter gathers in step); with `recompute: full`
    every decoder layer is re-run in the backward."""
    one = run_dist_check(tmp_path, 1, 1, "--backend", "torch", "--failed", "4")
    plain = run_dist_check(tmp_path, 2, 1, "--backend", "fsdp", "--failed", "4")
    recomputed = run_dist_check(tmp_path, 2, 1, "--backend", "fsdp", "--failed", "4", "--recompute", "full")
    for run in (plain, recomputed):
        assert run["parallel"]["world"] == 2
        assert run["logprobs"] == pytest.approx(one["logprobs"], abs=1e-5)
        assert run["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
        assert run["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
        same_weights(run["weight_sums"], one["weight_sums"])
    assert one["grad_norm"] > 0


def test_fsdp_trainer_in_one_process_steps_saves_loads_and_any_hf_model_works(tmp_path):
    """One process (no launcher): a step with a KL term moves the weights; save -> load into a fresh trainer gives
    the same weights, optimizer moments and step; a Qwen3-MoE (no Megatron conversion involved) trains too."""
    from slime_env.trainers.fsdp_trainer import FSDPTrainer

    hf = tiny("qwen3")
    before = {k: v.clone() for k, v in hf.state_dict().items()}
    trainer = FSDPTrainer(hf, TrainerConfig(backend="fsdp", lr=1e-3, kl_coef=0.1, micro_batch_size=3), pad_id=0)
    metrics = trainer.step(trajectories(8, seed=2), group_size=4)
    assert metrics["train/grad_norm"] > 0 and "train/kl" in metrics
    w = trainer.weights()
    assert not torch.equal(w["model.layers.0.self_attn.q_proj.weight"],
                           before["model.layers.0.self_attn.q_proj.weight"])
    trainer.save(tmp_path / "ckpt")
    fresh = FSDPTrainer(tiny("qwen3"), TrainerConfig(backend="fsdp", lr=1e-3, kl_coef=0.1), pad_id=0)
    fresh.load(tmp_path / "ckpt")
    assert fresh.step_count == 1
    assert all(torch.equal(fresh.weights()[k], w[k]) for k in w)
    m1 = trainer.optimizer.state_dict()["state"][0]["exp_avg"]
    m2 = fresh.optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(m1.to_local() if hasattr(m1, "to_local") else m1,
                       m2.to_local() if hasattr(m2, "to_local") else m2)
    reference = TorchTrainer(tiny("qwen3"), TrainerConfig(), pad_id=0)
    reference.load(tmp_path / "ckpt")  # the HF folder any trainer reads
    assert torch.equal(reference.model.state_dict()["lm_head.weight"], w["lm_head.weight"])
    moe = FSDPTrainer(tiny("qwen3_moe"), TrainerConfig(backend="fsdp", lr=1e-3), pad_id=0)
    assert moe.step(trajectories(8, seed=4), group_size=4)["train/grad_norm"] > 0


def test_fsdp_refusals_name_what_is_wrong():
    from slime_env.trainers.fsdp_trainer import FSDPTrainer

    with pytest.raises(ValueError, match="estimator ppo"):
        FSDPTrainer(tiny("llama"), TrainerConfig(backend="fsdp", estimator="ppo"), pad_id=0)
    with pytest.raises(ValueError, match=r"tp=2 needs backend: megatron"):
        TrainerConfig(backend="fsdp", tp=2)
    with pytest.raises(ValueError, match="fsdp_cpu_offload needs backend: fsdp"):
        TrainerConfig(fsdp_cpu_offload=True)


def test_train_loop_with_the_fsdp_backend_from_the_example_config(tmp_path):
    """examples/fsdp_train.yaml shrunk to one step on the CPU: rollouts, an FSDP2 step with per-layer activation
    checkpointing, the weights synced into the embedded engine, held-out evaluation, an HF checkpoint."""
    import asyncio
    import json
    import os

    import yaml
    from slime_env.trainers.run import TrainConfig, train
    from transformers import AutoModelForCausalLM

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    raw = yaml.safe_load(open(os.path.join(root, "examples", "fsdp_train.yaml")))
    raw.update(run_dir=str(tmp_path / "run"), steps=1, prompts_per_step=2, n_samples_per_prompt=2, eval_every=1,
               max_new_tokens=8, save_every=1, device="cpu")
    raw["trainer"].update(entropy_coef=0.01)  # a gradient even if every sample earns the same reward
    raw["eval_data"]["size"] = 4
    summary = asyncio.run(train(TrainConfig.from_dict(raw), log=lambda _: None))
    rows = [json.loads(line) for line in open(summary["metrics"])]
    assert [r["step"] for r in rows] == [0, 1] and "eval/accuracy" in rows[1]
    assert rows[1]["train/tokens"] > 0 and rows[1]["train/grad_norm"] > 0
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "checkpoints" / "step_1" / "model")
    assert saved.config.model_type == "llama"


def test_fsdp_full_recompute_reruns_every_decoder_layer_in_the_backward():
    """`recompute: full` wraps each decoder layer in activation checkpointing: a layer's projections run twice per
    micro-batch (forward, then again in the backward) instead of once; the step's gradient norm is unchanged."""
    from slime_env.trainers.fsdp_trainer import FSDPTrainer

    runs = {}
    for recompute in ("none", "full"):
        trainer = FSDPTrainer(tiny("llama"), TrainerConfig(backend="fsdp", lr=1e-3, recompute=recompute,
                                                           micro_batch_size=4), pad_id=0)
        # q_proj, not the whole MLP: torch stops a recompute once the tensors the backward needs are back, which
        # is before the layer's last projection finishes
        q_proj = next(m for n, m in trainer.model.named_modules()
                      if n.startswith("model.layers.0.") and n.endswith("self_attn.q_proj"))
        calls = []
        q_proj.register_forward_hook(lambda *_: calls.append(1))
        runs[recompute] = (trainer.step(trajectories(8, seed=6), group_size=4)["train/grad_norm"], len(calls))
    assert runs["none"][1] > 0 and runs["full"][1] == 2 * runs["none"][1]
    assert runs["full"][0] == pytest.approx(runs["none"][0], rel=1e-6)
