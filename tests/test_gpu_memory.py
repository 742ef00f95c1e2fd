"""The GPU-memory fit check (trainers/run/gpu_memory.py): configs that fit and configs that cannot, at an 8B
model's parameter count on an H200, refused before anything loads with the numbers and the fields to change."""

from __future__ import annotations

import pytest
from slime_env.errors import InvalidInput
from slime_env.trainers.run import gpu_memory as gm
from slime_env.trainers.run.config import TrainConfig

H200 = 143771 * 2**20  # nvidia-smi's memory.total of an H200 (MiB)
QWEN3_8B = 8_190_735_360  # parameters of Qwen3-8B (untied LM head), as the meta-device count gives them


def _cfg(gpus: int = 4, tp: int = 2, mode: str = "off", offload: bool = True, colocated: bool = True, **trainer):
    """bench/grpo_e2e.py's layouts: megatron ranks as child processes, one serve-engine per GPU (colocated) or on
    GPUs of their own (split)."""
    engine_gpus = list(range(gpus)) if colocated else list(range(tp, gpus))
    return TrainConfig.from_dict({
        "model": "unused", "device": "cuda",
        "trainer": {"backend": "megatron", "tp": tp, "offload": offload, **trainer},
        "engine": {"kind": "serve", "count": len(engine_gpus), "gpus": engine_gpus},
        "cluster": {"backend": "process", "trainer": {"gpus_per_node": gpus if colocated else tp}},
        "async": {"mode": mode}})


def _peak(cfg) -> float:
    return max(n.peak for n in gm.estimate(cfg, QWEN3_8B, H200)) / gm.GB


def test_the_issue_53_layouts_at_8b_fit_an_h200():
    # colocated, synchronous, offload: the engines release their memory while the trainer steps
    cfg = _cfg()
    gm.check_fit(cfg, gpu_bytes=H200, params=QWEN3_8B)
    need = gm.estimate(cfg, QWEN3_8B, H200)[0]
    # stepping: 8.2 bf16 weights + 16.4 fp32 gradients + 24.6 optimizer (12 B / 4 shards) + the contexts
    assert 50 < need.stepping / gm.GB < 52
    assert need.generating > need.stepping  # the engine's weights and pool, the trainer's weights alone
    # split: two training GPUs, two engines' GPUs
    needs = gm.estimate(_cfg(colocated=False, offload=False), QWEN3_8B, H200)
    assert [n.gpu for n in needs] == [0, 1, 2, 3]
    assert needs[0].stepping == needs[1].stepping and needs[2].parts[0].startswith("engine (serve)")
    # an engine's pool is its share of what is free when it starts
    assert needs[2].peak / gm.GB == pytest.approx(0.9 + 16.4 + 0.4 * (H200 / gm.GB - 0.9 - 16.4), abs=0.1)


def test_a_run_that_cannot_fit_is_refused_with_the_numbers_and_the_fields_to_change():
    # one H200, the trainer and an engine holding its pool throughout (an async mode): 147 GB of trainer state alone
    cfg = _cfg(gpus=1, tp=1, mode="overlap", offload=False)
    assert _peak(cfg) > H200 / gm.GB
    with pytest.raises(InvalidInput) as e:
        gm.check_fit(cfg, "run.yaml", gpu_bytes=H200, params=QWEN3_8B)
    msg = str(e.value)
    assert msg.startswith("run.yaml: the run cannot fit GPU 0: while the trainer steps it must hold at least")
    for part in ("8.19 B parameters", "16.4 weights + 32.8 gradients + 98.3 optimizer", "K/V pool",
                 "cluster.trainer.gpus_per_node", "async.mode: off with trainer.offload: true", "trainer.lora",
                 "engine.mem_fraction"):
        assert part in msg, (part, msg)
    # what the message offers, each taken alone: 4 ranks (TP 2, the optimizer over DP 2) fit; LoRA fits
    gm.check_fit(_cfg(gpus=4, tp=2, mode="overlap", offload=False), gpu_bytes=H200, params=QWEN3_8B)
    gm.check_fit(_cfg(gpus=1, tp=1, mode="overlap", offload=False, lora={"rank": 16}), gpu_bytes=H200,
                 params=QWEN3_8B)


def test_offload_and_the_engines_memory_fraction_count():
    # synchronous on one GPU: without offload the engine's 70 GB stays beside 147 GB of trainer state
    with pytest.raises(InvalidInput, match="trainer.offload: true"):
        gm.check_fit(_cfg(gpus=1, tp=1, offload=False), gpu_bytes=H200, params=QWEN3_8B)
    # offload: the engine keeps its context while the trainer steps (148.5 GB of 150.8: fits, activations aside)
    off = gm.estimate(_cfg(gpus=1, tp=1, offload=True), QWEN3_8B, H200)[0]
    assert off.stepping / gm.GB == pytest.approx(16.4 + 32.8 + 98.3 + 0.9 + 0.9, abs=0.2)
    # a smaller pool lowers what the engine holds while it generates
    small = TrainConfig.from_dict({**_cfg().document(), "engine": {"kind": "serve", "count": 4, "gpus": [0, 1, 2, 3],
                                                                   "mem_fraction": 0.1}})
    assert gm.estimate(small, QWEN3_8B, H200)[0].generating < gm.estimate(_cfg(), QWEN3_8B, H200)[0].generating
    with pytest.raises(InvalidInput, match="engine.mem_fraction"):
        TrainConfig.from_dict({"engine": {"kind": "serve", "mem_fraction": 1.5}})


def test_other_backends_and_where_it_does_nothing(tmp_path, monkeypatch):
    fsdp = gm.trainer_share(1000, TrainConfig.from_dict({"trainer": {"backend": "fsdp"}}).sections.trainer, 4)
    assert (fsdp.weights, fsdp.gradients, fsdp.optimizer) == (1000, 1000, 2000)  # 16 B / param over 4 ranks
    torch_share = gm.trainer_share(1000, TrainConfig.from_dict({}).sections.trainer, 1)
    assert torch_share.stepping == 16000
    # the embedded engine beside the torch trainer on one GPU: an 8B model in float32 with Adam is 131 GB
    with pytest.raises(InvalidInput, match="trainer.backend: megatron or fsdp"):
        gm.check_fit(TrainConfig.from_dict({"device": "cuda"}), gpu_bytes=H200, params=QWEN3_8B)
    # no GPU here, or a CPU run: nothing to check (no model config is read)
    monkeypatch.setattr(gm, "device_totals", lambda: {})
    gm.check_fit(TrainConfig.from_dict({"device": "cuda", "model": str(tmp_path / "missing")}))
    gm.check_fit(TrainConfig.from_dict({"device": "cpu"}), gpu_bytes=1)


def test_check_before_start_counts_the_model_from_its_config(tmp_path, monkeypatch):
    """The parameters come from the model folder's config.json on the meta device (nothing loaded)."""
    from slime_env.trainers.run.preflight import check_before_start
    from transformers import AutoConfig

    AutoConfig.for_model("qwen3", vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16).save_pretrained(tmp_path)
    params = gm.parameter_count(str(tmp_path))
    assert params == 2 * 1000 * 64 + 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64 + 2 * 16) + 64
    cfg = TrainConfig.from_dict({"model": str(tmp_path), "device": "cuda", "env": "Calculator-v0"})
    monkeypatch.setattr(gm, "device_totals", lambda: {0: 80 * 10**9})
    check_before_start(cfg)  # a tiny model on an 80 GB GPU
    monkeypatch.setattr(gm, "device_totals", lambda: {0: 5 * 10**8, 1: 80 * 10**9})  # the smallest GPU counts
    with pytest.raises(InvalidInput, match="cannot fit GPU 0"):
        check_before_start(cfg)
