"""LoRA on the FSDP2 trainer (`trainer: {backend: fsdp, lora: ...}`) on CPU with gloo: two ranks give the one-process
`TorchTrainer` LoRA step, only the adapter trains and checkpoints; the reference is the base with the adapter off;
its checkpoints are PEFT's (peft, `TorchTrainer` and `slime-env export --merge` read them); the run config switch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

peft = pytest.importorskip("peft")

from helpers import run_dist_check, same_weights, tiny, trajectories  # noqa: E402
from slime_env.trainers.torch_trainer import TorchTrainer, TrainerConfig  # noqa: E402

LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]}


def fsdp_lora(model=None, **kw):
    from slime_env.trainers.fsdp_trainer import FSDPTrainer

    cfg = TrainerConfig(backend="fsdp", lr=5e-2, micro_batch_size=4, lora=dict(LORA), **kw)
    return FSDPTrainer(tiny("llama") if model is None else model, cfg, pad_id=0)


def test_fsdp2_lora_over_two_ranks_equals_the_torch_trainer_and_checkpoints_round_trip(tmp_path):
    """Two gloo ranks (4 failed trajectories: idle passes on rank 1) against `TorchTrainer` + LoRA in one process, one
    GRPO step with a KL term: equal loss, gradient norm, adapter and merged weights; the base weights never move; the
    optimizer holds the adapter alone; save -> load into a fresh 2-rank trainer gives back the adapter, every rank's
    optimizer shard and the step, from an adapter-only checkpoint."""
    one = run_dist_check(tmp_path, 1, 1, "--backend", "torch", "--lora", "--failed", "4")
    two = run_dist_check(tmp_path, 2, 1, "--backend", "fsdp", "--lora", "--failed", "4")
    assert two["parallel"]["world"] == 2
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5) and one["grad_norm"] > 0
    same_weights(two["adapter_sums"], one["adapter_sums"])
    same_weights(two["weight_sums"], one["weight_sums"])  # merged: the adapter folded into the base
    assert any(v != 0 for k, v in one["adapter_sums"].items() if "lora_B" in k)  # B starts at zero: it moved
    assert one["base_moved"] == two["base_moved"] == []
    assert two["optimizer_params"] == one["optimizer_params"] and len(one["optimizer_params"]) == 2 * 3 * 3
    assert all(".lora_" in n for n in two["optimizer_params"])
    rt = two["round_trip"]
    assert rt["adapter"] and rt["optimizer"] and rt["step"] == 1
    assert rt["files"] == ["adapter", "config.json", "trainer_rank0.pt", "trainer_rank1.pt"]  # no base weights


def test_fsdp_lora_reference_is_the_base_and_bf16_compute_trains_the_adapter():
    """No second copy for the KL term: the reference log-probs are the base model's (the adapter off) before and
    after steps that move the policy. With bfloat16 compute the adapter's gradients still arrive in float32 for its
    float32 shards, though the step's first forward (the reference's) runs with no parameter requiring a gradient."""
    from slime_env.trainers.batch import pack

    trainer = fsdp_lora(kl_coef=0.1)
    assert trainer.ref_model is None
    trajs = trajectories(8, seed=1)
    batch = pack(trajs, group_size=4, pad_id=0)
    ref0 = trainer.backend.reference_logprobs(batch)
    plain = TorchTrainer(tiny("llama"), TrainerConfig(micro_batch_size=4), pad_id=0)
    assert torch.allclose(plain.backend.frozen_logprobs(plain.model, batch), ref0, atol=1e-5)
    for _ in range(2):
        metrics = trainer.step(trajs, group_size=4)
    assert metrics["train/kl"] > 0
    assert torch.allclose(trainer.backend.reference_logprobs(batch), ref0)
    assert not torch.allclose(trainer.backend.frozen_logprobs(trainer.model, batch), ref0)

    bf16 = fsdp_lora(kl_coef=0.1, dtype="bfloat16")
    assert bf16.step(trajs, group_size=4)["train/grad_norm"] > 0
    moments = [s["exp_avg"] for s in bf16.optimizer.state_dict()["state"].values()]
    assert moments and all(m.dtype == torch.float32 for m in moments)


def test_fsdp_lora_checkpoint_is_peft_format_that_peft_torch_and_export_merge_read(tmp_path):
    """One process, `recompute: full` (checkpointed decoder layers keep their parameter names): an FSDP LoRA
    checkpoint holds `adapter/` (PEFT's format) and no base weights; `peft` loads it onto the base and gives the
    trainer's function; `TorchTrainer` + LoRA resumes the same adapter; `slime-env export --merge` writes HF weights
    with the same function; a full-weight checkpoint is refused by name."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = tmp_path / "base"
    tiny("llama").save_pretrained(base)
    trainer = fsdp_lora(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), recompute="full")
    trainer.step(trajectories(8, seed=3), group_size=4)
    ckpt = trainer.save(tmp_path / "ckpt")
    assert not (ckpt / "model").exists()
    assert sorted(p.name for p in (ckpt / "adapter").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    ids = torch.tensor([[5, 9, 17, 33, 2, 61]])
    with torch.no_grad():
        want = trainer.model(input_ids=ids).logits

    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                       str(ckpt / "adapter")).eval()
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, want, atol=1e-5)
    torch_trainer = TorchTrainer(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                 TrainerConfig(lora=dict(LORA)), pad_id=0)
    torch_trainer.load(ckpt)  # the adapter; the optimizer shards are FSDP's own
    a, b = trainer.adapter(), torch_trainer.adapter()
    assert a.tensors.keys() == b.tensors.keys() and all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)
    assert a.config == b.config

    out = subprocess.run([sys.executable, "-m", "slime_env", "export", str(ckpt), "--out", str(tmp_path / "merged"),
                          "--merge"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert not any("lora" in k for k in merged.state_dict())
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, want, atol=1e-4)

    full = TorchTrainer(tiny("llama"), TrainerConfig(), pad_id=0).save(tmp_path / "full")
    with pytest.raises(FileNotFoundError, match="resumes from an adapter checkpoint"):
        fsdp_lora().load(full)


def test_train_loop_with_the_lora_example_on_the_fsdp_backend(tmp_path):
    """examples/lora_train.yaml with `trainer.backend: fsdp`, shrunk to two steps on the CPU: FSDP2 trains the adapter
    (KL against the base), every sync sends the adapter alone into the embedded engine, each generate call records
    its adapter, the checkpoint is the adapter in PEFT's format."""
    import asyncio
    import json
    import os

    import yaml
    from slime_env.trainers.run import TrainConfig, train

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    raw = yaml.safe_load(open(os.path.join(root, "examples", "lora_train.yaml")))
    raw.update(run_dir=str(tmp_path / "run"), steps=2, prompts_per_step=2, n_samples_per_prompt=2, eval_every=2,
               max_new_tokens=8, save_every=2, device="cpu")
    raw["trainer"].update(backend="fsdp", micro_batch_size=4, entropy_coef=0.01)  # a gradient whatever the rewards
    raw["trainer"]["lora"].update(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
    raw["eval_data"]["reasoning_gym"]["size"] = 2
    summary = asyncio.run(train(TrainConfig.from_dict(raw), log=lambda _: None))
    rows = [json.loads(line) for line in open(summary["metrics"])]
    trained = [r for r in rows if "train/reward_mean" in r]
    assert len(trained) == 2 and all(r["train/grad_norm"] > 0 for r in trained)
    synced = [r for r in rows if "sync/bytes" in r]
    assert synced and all(0 < r["sync/bytes"] < 2e6 for r in synced)  # the adapter, not the 135M model's 540 MB
    ckpt = tmp_path / "run" / "checkpoints" / "step_2"
    assert (ckpt / "adapter" / "adapter_model.safetensors").exists() and not (ckpt / "model").exists()
    samples = [json.loads(line) for line in open(tmp_path / "run" / "samples.jsonl")]
    md = [t for s in samples if s["step"] == 2 for t in s["trajectories"]][0]["metadata"]
    assert md["adapters"] == [f"policy@{v}" for v in md["weight_versions"]] and md["weight_versions"][0] == "1"
