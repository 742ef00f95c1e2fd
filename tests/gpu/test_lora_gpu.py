"""LoRA on a GPU: adapter-only sync into the embedded GPU engine (the paged engine, bf16) gives the trainer's policy;
a LoRA trainer holds less GPU memory than full fine-tuning; adapter sync bytes and time against full weights.

Run on a GPU machine: `python -P -m pytest tests/gpu/test_lora_gpu.py -q -s` (skipped without CUDA; never in CI).
"""

from __future__ import annotations

import asyncio
import gc
import json
import time

import pytest
import torch

pytest.importorskip("peft")

from slime_env.trainers.torch_trainer import TorchTrainer, TrainerConfig  # noqa: E402

from helpers import trajectories  # noqa: E402

LORA = {"rank": 16, "alpha": 32, "target_modules": "all-linear"}


def _load(model_folder, dtype=torch.float32):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(model_folder, dtype=dtype).cuda(),
            AutoTokenizer.from_pretrained(model_folder))


def test_adapter_sync_into_the_gpu_engine_matches_the_trainer(model_folder):
    from slime_env.agents import TransformersPolicy

    model, tok = _load(model_folder)
    engine_model, _ = _load(model_folder, torch.bfloat16)
    policy = TransformersPolicy(engine_model, tok, seed=0)
    trainer = TorchTrainer(model, TrainerConfig(lr=1e-2, micro_batch_size=8, lora=dict(LORA)), pad_id=0)
    prompt = tok.encode("The capital of France is", add_special_tokens=False)

    async def main():
        out = []
        for v in ("1", "2"):
            trainer.step(trajectories(16, seed=int(v), vocab=1000), group_size=4)
            await trainer.sync(policy, version=v)
            out.append(await policy.generate(prompt, {"max_new_tokens": 8, "temperature": 0}))
        return out

    gens = asyncio.run(main())
    assert [g.adapter for g in gens] == ["policy@1", "policy@2"] and gens[-1].weight_version == "2"
    ids = torch.tensor([prompt + list(gens[-1].token_ids)], device="cuda")
    with torch.no_grad():
        lp = torch.log_softmax(trainer.model(input_ids=ids).logits[0, len(prompt) - 1:-1].float(), -1)
    want = lp.gather(-1, torch.tensor(gens[-1].token_ids, device="cuda")[:, None]).squeeze(-1).cpu()
    assert torch.allclose(torch.tensor(gens[-1].logprobs), want, atol=0.1)  # bf16 engine vs fp32 trainer
    policy.close()


def test_lora_trainer_memory_and_sync_cost_against_full_fine_tuning(model_folder, tmp_path):
    from slime_env.trainers.weight_sync import InPlace

    class Sink:  # the engine side's cost is not what this measures
        async def update_weights(self, weights, version):
            pass

        async def load_adapter(self, adapter, version):
            pass

    results = {}
    for mode in ("full", "lora"):
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        model, _ = _load(model_folder)
        trainer = TorchTrainer(model, TrainerConfig(lr=1e-4, micro_batch_size=8,
                                                    lora=dict(LORA) if mode == "lora" else None), pad_id=0)
        trainer.step(trajectories(16, seed=1, vocab=1000), group_size=4)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        channel = InPlace(Sink())
        t0 = time.perf_counter()
        stats = asyncio.run(channel.push_adapter(trainer.adapter(), "1") if mode == "lora"
                            else channel.push(trainer.weights(), "1"))
        torch.cuda.synchronize()
        results[mode] = {"trainer_peak_mb": peak / 2**20, "sync_mb": stats["sync/bytes"] / 2**20,
                         "sync_ms": (time.perf_counter() - t0) * 1e3}
        del trainer, model
    print(json.dumps(results, indent=1))
    assert results["lora"]["trainer_peak_mb"] < results["full"]["trainer_peak_mb"]
    assert results["lora"]["sync_mb"] < 0.25 * results["full"]["sync_mb"]


@pytest.mark.two_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_fsdp2_lora_over_two_gpus_matches_the_torch_trainer(tmp_path):
    """FSDP2 + LoRA over two GPUs (NCCL, bf16 compute, fp32 adapter shards, a KL term against the adapter switched
    off) against `TorchTrainer` + LoRA in fp32 on the same batch: loss and gradient norm within bf16 rounding, the
    base weights unchanged, the optimizer holding the adapter alone, the checkpoint round trip exact (the fp32 CPU
    test, tests/test_fsdp_lora.py, checks parity exactly)."""
    from helpers import run_dist_check

    one = run_dist_check(tmp_path, 1, 1, "--backend", "torch", "--lora", "--failed", "4")
    two = run_dist_check(tmp_path, 2, 1, "--backend", "fsdp", "--lora", "--failed", "4")
    print(f"FSDP2+LoRA on 2 GPUs: loss {two['loss']:.6f} vs {one['loss']:.6f}, grad norm {two['grad_norm']:.5f} vs "
          f"{one['grad_norm']:.5f}")
    assert two["loss"] == pytest.approx(one["loss"], rel=5e-2, abs=1e-3)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=5e-2) and two["grad_norm"] > 0
    assert two["base_moved"] == [] and two["optimizer_params"] == one["optimizer_params"]
    rt = two["round_trip"]
    assert rt["adapter"] and rt["optimizer"] and rt["step"] == 1


@pytest.mark.parametrize("rank", [8, 4])
def test_megatron_moe_expert_lora_through_grouped_mm_equals_the_per_expert_loop(monkeypatch, rank):
    """Megatron LoRA on Qwen3-MoE's experts (bf16, one GPU): with rank 8 both experts' adapters run through
    `torch._grouped_mm` (three grouped GEMMs per base one: 6 per layer against 2 with the adapters off), with rank 4
    the unaligned down_proj adapter falls back to the per-expert loop (4 against 2); either way the log-probs and one
    step's loss and gradient norm are the per-expert loop's (the CPU path the CPU tests check against peft)."""
    pytest.importorskip("megatron.core")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("torch._grouped_mm's cuBLAS path needs compute capability 9.0+")
    from helpers import tiny

    from slime_env.trainers.batch import pack
    from slime_env.trainers.megatron import grouped_experts
    from slime_env.trainers.megatron.lora import adapters_off
    from slime_env.trainers.megatron_trainer import MegatronTrainer

    trajs = trajectories(8, seed=3)
    batch = pack(trajs, group_size=4, pad_id=0)
    mask = batch.loss_mask.bool()

    def trainer():
        torch.manual_seed(0)  # the same initial adapter, then the same random B (so the branch is not zero)
        t = MegatronTrainer(tiny("qwen3_moe"), TrainerConfig(backend="megatron", dtype="bfloat16", lr=1e-2,
                                                             moe_aux_loss_coeff=0.0,
                                                             lora=dict(rank=rank, alpha=2 * rank)), pad_id=0)
        torch.manual_seed(1)
        with torch.no_grad():
            for name, p in t.model.named_parameters():
                if name.endswith(".lora_B"):
                    p.normal_(0.0, 0.05)
        return t

    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    fast = trainer()
    with torch.no_grad():
        with adapters_off(fast.model):
            fast.logprobs(fast.model, batch)
        base_calls = len(calls)
        calls.clear()
        fast_lp = fast.logprobs(fast.model, batch)[mask].float().cpu()
    assert base_calls > 0 and len(calls) == base_calls * (3 if rank % 8 == 0 else 2)
    fast_m = fast.step(trajs, group_size=4)

    monkeypatch.setattr(grouped_experts, "grouped_mm_available", lambda x: False)
    loop = trainer()
    with torch.no_grad():
        loop_lp = loop.logprobs(loop.model, batch)[mask].float().cpu()
    loop_m = loop.step(trajs, group_size=4)
    assert torch.allclose(fast_lp, loop_lp, atol=3e-2)  # bf16: summation order differs
    assert fast_m["train/loss"] == pytest.approx(loop_m["train/loss"], rel=2e-2, abs=1e-3)
    assert fast_m["train/grad_norm"] == pytest.approx(loop_m["train/grad_norm"], rel=2e-2)
