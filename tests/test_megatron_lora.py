"""LoRA on the Megatron trainer (`trainer.lora` with `backend: megatron`, `slime_env.trainers.megatron.lora`), on CPU:
a TP=2 step equals `TorchTrainer`'s peft step from the same adapter, the exported adapter is PEFT's (peft loads it and
gives Megatron's log-probs; `export --merge` too), the base never moves, checkpoints resume; what is not built
(dropout, a module the trainer does not know) is refused by name. On Qwen3-MoE the experts' fused weights and the
router are adapted in peft's own layout (`target_parameters`), under expert parallelism too.

megatron-core runs on CPU through the stand-in described in tests/test_megatron.py (`cpu_compat`)."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'slime_env[megatron]')")
pytest.importorskip("peft")

from helpers import run_ranks, tiny, trajectories  # noqa: E402

from slime_env.trainers.batch import pack  # noqa: E402
from slime_env.trainers.lora import LoRAOptions, adapter_of, wrap  # noqa: E402
from slime_env.trainers.torch_trainer import TorchTrainer, TrainerConfig  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SINGLE = ["q_proj", "o_proj", "up_proj", "down_proj"]  # one projection of each fused layer: PEFT's own parametrisation
LORA = dict(rank=4, alpha=8)


def random_adapter(family: str, targets, folder, *, shared: bool = False, seed: int = 0):
    """A PEFT adapter of `tiny(family)` with random A and B (so every gradient path is non-zero); `shared`: q/k/v and
    gate/up share one A, as a fused megatron layer's adapter does."""
    torch.manual_seed(seed)
    model = wrap(tiny(family), LoRAOptions(**LORA, target_modules=targets))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.normal_(0.0, 0.3 if ".lora_A" in name else 0.1)
    adapter = adapter_of(model, "policy")
    if shared:
        for k in list(adapter.tensors):
            for part, first in (("k_proj", "q_proj"), ("v_proj", "q_proj"), ("up_proj", "gate_proj")):
                if f".{part}.lora_A" in k:
                    adapter.tensors[k] = adapter.tensors[k.replace(part, first)].clone()
    return adapter.save(folder)


def masked_logprobs(model, batch, lora_options=None) -> torch.Tensor:
    trainer = TorchTrainer(model, TrainerConfig(lora=lora_options), pad_id=0)
    with torch.no_grad():
        return trainer.logprobs(trainer.model, batch)[batch.loss_mask.bool()]


@pytest.mark.parametrize("layout", ["tp", "pp"])
def test_tp2_or_pp2_step_equals_torch_trainers_and_the_adapter_is_peft_s(tmp_path, layout):
    """torchrun, two gloo ranks, TP=2 or PP=2 (tests/megatron_lora_check.py): from the same random adapter, Megatron's
    step (KL against the base with the adapter off), with and without sequence parallel under TP, gives
    TorchTrainer+peft's reference and policy log-probs, loss, KL, gradient norm and adapter after the step; only
    adapters are in the optimizer and the base weights stay; a resumed checkpoint continues identically; the all-linear
    adapter (fused qkv / gate-up split per projection) comes back out exactly as it went in, and after a step peft on
    the HF model and `export --merge` give Megatron's log-probs."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from slime_env.agents.lora_adapter import LoRAAdapter
    from slime_env.trainers.lora import export_merged

    tiny("qwen2").save_pretrained(tmp_path / "base")
    random_adapter("qwen2", SINGLE, tmp_path / "single")
    random_adapter("qwen2", "all-linear", tmp_path / "all", shared=True, seed=1)
    script = [os.path.join(ROOT, "tests", "megatron_lora_check.py"), f"--{layout}", "2", "--dir", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
           "TMPDIR": str(tmp_path)}  # torchrun's torchelastic_* folders go with the test
    proc = run_ranks(2, script, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads((tmp_path / "result.json").read_text())
    assert got["parallel"][layout] == 2
    assert got["optimizer_params"] and all(n.endswith((".lora_A", ".lora_B")) for n in got["optimizer_params"])
    assert got["optimizer_numel_is_the_adapters"]
    assert got["base_unchanged"]

    def base():
        return AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)

    trajs = trajectories(8, seed=3)
    batch = pack(trajs, group_size=4, pad_id=0)
    ref = TorchTrainer(base(), TrainerConfig(lr=1e-2, kl_coef=0.1, micro_batch_size=2,
                                             lora=dict(LORA, target_modules=SINGLE)), pad_id=0)
    ref.load(tmp_path / "single")
    mask = batch.loss_mask.bool()
    assert got["reference"] == pytest.approx(ref.backend.reference_logprobs(batch)[mask].tolist(), abs=1e-5)
    before = masked_logprobs(ref.model, batch, ref.config.lora).tolist()
    assert got["before"] == pytest.approx(before, abs=1e-5)
    assert got["before"] != pytest.approx(got["reference"], abs=1e-3)  # the adapter changes the policy
    metrics = ref.step(trajs, group_size=4)
    assert got["loss"] == pytest.approx(metrics["train/loss"], rel=1e-4, abs=1e-6)
    assert got["kl"] == pytest.approx(metrics["train/kl"], rel=1e-4, abs=1e-7) and got["kl"] > 0
    assert got["grad_norm"] == pytest.approx(metrics["train/grad_norm"], rel=1e-5)
    assert (got["sp_loss"], got["sp_kl"]) == pytest.approx((metrics["train/loss"], metrics["train/kl"]), rel=1e-4)
    assert got["sp_grad_norm"] == pytest.approx(metrics["train/grad_norm"], rel=1e-5)
    theirs = ref.adapter()
    assert LoRAAdapter.load(tmp_path / "single").tensors.keys() == theirs.tensors.keys()
    for ours in (LoRAAdapter.load(tmp_path / "ckpt" / "adapter"), LoRAAdapter.load(tmp_path / "sp_after")):
        assert ours.tensors.keys() == theirs.tensors.keys()
        for k in ours.tensors:
            assert torch.allclose(ours.tensors[k], theirs.tensors[k], atol=1e-6), k
    assert got["after"] == pytest.approx(masked_logprobs(ref.model, batch, ref.config.lora).tolist(), abs=1e-5)
    assert got["resumed_step"] == 1 and got["resumed"] == pytest.approx(got["after"], abs=1e-6)
    assert got["resumed_adapter_gap"] < 1e-6  # optimizer state came back too

    sent, back = LoRAAdapter.load(tmp_path / "all"), LoRAAdapter.load(tmp_path / "all_export")
    assert back.tensors.keys() == sent.tensors.keys() and all(torch.equal(back.tensors[k], sent.tensors[k])
                                                              for k in sent.tensors)
    config = json.loads((tmp_path / "all_after" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                       "down_proj"])
    assert (config["r"], config["lora_alpha"]) == (4, 8)
    peft_model = PeftModel.from_pretrained(base(), str(tmp_path / "all_after"), is_trainable=True).eval()
    assert masked_logprobs(peft_model, batch, LORA).tolist() == pytest.approx(got["all_after"], abs=1e-5)
    # base found by the adapter's base_model_name_or_path
    merged = export_merged(tmp_path / "ckpt", tmp_path / "merged")
    assert masked_logprobs(AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32), batch).tolist() == \
        pytest.approx(got["after"], abs=1e-5)


@pytest.fixture(scope="module")
def parallel():
    from slime_env.trainers.megatron import init_parallel

    return init_parallel(1)


def test_moe_attention_adapters_and_adapter_only_sync(parallel):
    """Qwen3-MoE: the attention is adapted, no MLP, expert or router; the exported adapter gives peft (on the HF
    model) Megatron's log-probs after a step; a sync sends the adapter alone, the merged weights are the base plus
    the adapter's deltas."""
    import asyncio

    from peft import PeftModel

    from slime_env.trainers.megatron_trainer import MegatronTrainer

    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    trainer = MegatronTrainer(tiny("qwen3_moe"), TrainerConfig(backend="megatron", dtype="float32", lr=1e-2, lora=dict(
        LORA, target_modules=targets)), pad_id=0)
    adapted = {n.rsplit(".", 1)[0] for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert adapted == {f"decoder.layers.{i}.self_attention.{x}"
                       for i in range(3) for x in ("linear_qkv", "linear_proj")}
    trajs = trajectories(8, seed=2)
    trainer.step(trajs, group_size=4)
    adapter = trainer.adapter()
    assert len(adapter.tensors) == 3 * 4 * 2
    batch = pack(trajs, group_size=4, pad_id=0)
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        peft_model = PeftModel.from_pretrained(tiny("qwen3_moe"), adapter.save(folder), is_trainable=True).eval()
        want = masked_logprobs(peft_model, batch, dict(LORA, target_modules=targets))
    with torch.no_grad():
        ours = trainer.logprobs(trainer.model, batch).cpu()[batch.loss_mask.bool()]
    assert torch.allclose(ours, want, atol=1e-5)

    class Engine:  # what an engine's weight channel receives in process (TransformersPolicy's methods)
        async def load_adapter(self, adapter, version):
            self.adapter, self.version = adapter, version

        async def update_weights(self, state, version):
            self.state = state

    engine = Engine()
    asyncio.run(trainer.sync(engine))
    assert engine.adapter.tensors.keys() == adapter.tensors.keys() and engine.version == "1"
    merged = {k: v.cpu() for k, v in trainer.weights().items()}
    base = {k: v.cpu() for k, v in trainer.hf_state_dict().items()}
    delta = adapter.deltas()["model.layers.2.self_attn.k_proj.weight"]
    assert torch.allclose(merged["model.layers.2.self_attn.k_proj.weight"],
                          base["model.layers.2.self_attn.k_proj.weight"] + delta) and delta.abs().max() > 0
    assert torch.equal(merged["model.layers.0.mlp.experts.down_proj"], base["model.layers.0.mlp.experts.down_proj"])


MOE = ["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "gate"]  # experts, router, one of each fused layer


@pytest.mark.parametrize("ep,tp", [(1, 1), (2, 1), (1, 2)])
def test_moe_expert_and_router_adapters_step_like_torch_trainers_peft(tmp_path, ep, tp):
    """Qwen3-MoE, torchrun with `ep` x `tp` gloo ranks (tests/megatron_moe_lora_check.py; TP with sequence parallel):
    from the same random PEFT adapter on the experts' fused weights, the router and attention, Megatron (each EP rank
    holding its local experts' adapters, reduced outside DP; under TP+SP each rank routing its own tokens) gives
    TorchTrainer+peft's reference and policy log-probs, loss, KL, grad norm and adapter after one step; peft loads the
    adapter gathered over EP and gives Megatron's log-probs, and so do a resumed checkpoint and its `export --merge`."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from slime_env.agents.lora_adapter import LoRAAdapter
    from slime_env.trainers.lora import export_merged

    tiny("qwen3_moe").save_pretrained(tmp_path / "base")
    random_adapter("qwen3_moe", MOE, tmp_path / "moe")
    script = [os.path.join(ROOT, "tests", "megatron_moe_lora_check.py"), "--ep", str(ep), "--tp", str(tp),
              "--dir", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
           "TMPDIR": str(tmp_path)}  # torchrun's torchelastic_* folders go with the test
    proc = run_ranks(ep * tp, script, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads((tmp_path / "result.json").read_text())
    assert (got["parallel"]["ep"], got["parallel"]["tp"]) == (ep, tp)
    c = tiny("qwen3_moe").config
    assert got["local_fc1_A"] == [c.num_experts // ep, 2 * LORA["rank"], c.hidden_size]  # peft's fused rank 2r
    assert got["local_fc2_B"] == [c.num_experts // ep, c.hidden_size, LORA["rank"]]
    assert got["expert_adapters_skip_dp"] and got["experts_in_every_ranks_norm"]
    assert all(n.endswith((".lora_A", ".lora_B")) for n in got["trainable"])
    assert {n.split(".", 3)[-1] for n in got["trainable"]} >= {"mlp.router.lora_A", "mlp.experts.fc1.lora_B",
                                                               "mlp.experts.fc2.lora_A"}

    def base():
        return AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)

    trajs = trajectories(8, seed=3)
    batch = pack(trajs, group_size=4, pad_id=0)
    ref = TorchTrainer(base(), TrainerConfig(lr=1e-2, kl_coef=0.1, micro_batch_size=2,
                                             lora=dict(LORA, target_modules=MOE)), pad_id=0)
    ref.load(tmp_path / "moe")
    mask = batch.loss_mask.bool()
    assert got["reference"] == pytest.approx(ref.backend.reference_logprobs(batch)[mask].tolist(), abs=1e-5)
    assert got["before"] == pytest.approx(masked_logprobs(ref.model, batch, ref.config.lora).tolist(), abs=1e-5)
    assert got["before"] != pytest.approx(got["reference"], abs=1e-3)
    metrics = ref.step(trajs, group_size=4)
    assert got["loss"] == pytest.approx(metrics["train/loss"], rel=1e-4, abs=1e-6)
    assert got["kl"] == pytest.approx(metrics["train/kl"], rel=1e-4) and got["kl"] > 0
    assert got["grad_norm"] == pytest.approx(metrics["train/grad_norm"], rel=1e-5)
    ours, theirs = LoRAAdapter.load(tmp_path / "moe_after"), ref.adapter()
    assert ours.tensors.keys() == theirs.tensors.keys()
    assert "base_model.model.model.layers.0.mlp.experts.base_layer.lora_B.weight" in ours.tensors  # gate_up_proj's
    for k in ours.tensors:  # Adam's first step moves an entry by lr·g / (|g| + eps): where |g| is near eps, float
        # summation order shows (TP+SP: one entry of 2048 in an expert's A off by 7e-5 of its 8e-3 move; else < 2e-5)
        assert torch.allclose(ours.tensors[k], theirs.tensors[k], atol=1e-4), k
    # after the step: that adapter's gap (relative 2e-6 of a log-prob under TP+SP)
    assert got["after"] == pytest.approx(masked_logprobs(ref.model, batch, ref.config.lora).tolist(), rel=1e-5,
                                         abs=1e-5)
    peft_model = PeftModel.from_pretrained(base(), str(tmp_path / "moe_after"), is_trainable=True).eval()
    assert masked_logprobs(peft_model, batch, dict(LORA, target_modules=MOE)).tolist() == \
        pytest.approx(got["after"], abs=1e-5)
    assert got["resumed"] == pytest.approx(got["after"], abs=1e-6)
    merged = export_merged(tmp_path / "ckpt", tmp_path / "merged")  # peft's merge_and_unload of the checkpoint
    assert masked_logprobs(AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32), batch).tolist() == \
        pytest.approx(got["after"], abs=1e-5)


def test_moe_all_linear_adapter_is_peft_s_layout_and_config(parallel, tmp_path):
    """all-linear on Qwen3-MoE: the Megatron trainer's fresh adapter has the keys, shapes and adapter_config peft
    itself writes for the torch trainer (target_parameters, the fused gate_up_proj's rank and alpha patterns); a peft
    adapter (fused attention layers' A shared) goes in and comes out bit for bit, and its merged weights are peft's
    `merge_and_unload`."""
    from peft import PeftModel

    from slime_env.agents.lora_adapter import LoRAAdapter
    from slime_env.trainers.megatron_trainer import MegatronTrainer

    trainer = MegatronTrainer(tiny("qwen3_moe"), TrainerConfig(backend="megatron", dtype="float32", lora=dict(
        LORA, target_modules="all-linear")), pad_id=0)
    ours, peft_s = trainer.adapter(), adapter_of(wrap(tiny("qwen3_moe"), LoRAOptions(**LORA)), "policy")
    assert {k: v.shape for k, v in ours.tensors.items()} == {k: v.shape for k, v in peft_s.tensors.items()}
    drop = ("base_model_name_or_path",)
    assert {k: v for k, v in ours.config.items() if k not in drop} == \
        {k: v for k, v in peft_s.config.items() if k not in drop}
    assert ours.config["target_parameters"] == ["down_proj", "gate.weight", "gate_up_proj"]
    random_adapter("qwen3_moe", "all-linear", tmp_path / "all", shared=True)
    trainer.load(tmp_path / "all")
    sent, back = LoRAAdapter.load(tmp_path / "all"), trainer.adapter()
    assert back.tensors.keys() == sent.tensors.keys()
    assert all(torch.equal(back.tensors[k], sent.tensors[k]) for k in sent.tensors)
    # the merged weights (full-weight sync, engines' merged adapters) are peft's own merge
    merged = PeftModel.from_pretrained(tiny("qwen3_moe"), str(tmp_path / "all")).merge_and_unload().state_dict()
    ours = {k: v.cpu() for k, v in trainer.weights().items()}
    assert ours.keys() == merged.keys()
    for k in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj",
              "model.layers.0.mlp.gate.weight", "model.layers.0.self_attn.v_proj.weight"):
        assert not torch.equal(merged[k], tiny("qwen3_moe").state_dict()[k]), k  # adapted
    assert torch.equal(merged["model.layers.1.mlp.up_proj.weight"], tiny("qwen3_moe").state_dict()[
        "model.layers.1.mlp.up_proj.weight"])  # a dense layer's MLP (mlp_only_layers): peft leaves it, so do we
    for k in merged:
        assert torch.allclose(ours[k], merged[k], atol=1e-6), k


def test_lora_under_activation_recompute_steps_as_without(parallel):
    """megatron's recompute is a reentrant checkpoint: with the base frozen no layer's input needs a gradient by
    itself, so the adapters inside would get none (the step raised); with the embedding's output marked, selective
    and full recompute give the step without recompute (loss, grad norm, adapter after it)."""
    from slime_env.trainers.megatron_trainer import MegatronTrainer

    trajs = trajectories(8, seed=3)
    results = {}
    for recompute in ("none", "selective", "full"):
        torch.manual_seed(0)  # the same fresh adapter each time
        trainer = MegatronTrainer(tiny("qwen3_moe"), TrainerConfig(backend="megatron", lr=1e-3, recompute=recompute,
                                                                   max_tokens_per_micro_batch=48, lora=dict(LORA)),
                                  pad_id=0)
        results[recompute] = (trainer.step(trajs, group_size=4), trainer.adapter().tensors)
    m0, a0 = results["none"]
    assert m0["train/grad_norm"] > 0
    for m, a in (results["selective"], results["full"]):
        assert m["train/grad_norm"] == pytest.approx(m0["train/grad_norm"], rel=1e-6)
        assert m["train/loss"] == pytest.approx(m0["train/loss"], rel=1e-6, abs=1e-8)
        assert all(torch.allclose(a[k], a0[k], atol=1e-7, rtol=0) for k in a0)


def test_what_the_megatron_adapters_do_not_cover_is_refused_by_name(parallel):
    from slime_env.trainers.megatron import build_gpt
    from slime_env.trainers.megatron.lora import plan
    from slime_env.trainers.run import TrainConfig

    moe, dense = tiny("qwen3_moe").config, tiny("qwen2").config
    for options, config, match in (
            (dict(target_modules=["gate_up_proj"]), moe,
             r"'gate_up_proj': the Megatron trainer adapts .* \(on qwen3_moe gate_proj / up_proj / down_proj are the "
             r"experts'"),
            (dict(target_modules=["shared_expert"]), moe, r"'shared_expert': the Megatron trainer adapts"),
            (dict(target_modules=["q_proj", "up_proj"]), moe, r"'up_proj' on qwen3_moe: the experts' gate and up rows "
                                                              r"are one weight"),
            (dict(target_modules=["gate"]), dense, r"'gate': the Megatron trainer adapts \['q_proj'"),
            (dict(target_modules=["lm_head"]), dense, r"'lm_head': the Megatron trainer adapts \['q_proj'"),
            (dict(target_modules=".*proj"), dense, r"'\.\*proj': the Megatron trainer takes 'all-linear' or a list"),
            (dict(dropout=0.1), dense, r"lora\.dropout 0\.1: the Megatron trainer's adapters have no dropout")):
        with pytest.raises(ValueError, match=match):
            plan(LoRAOptions(**LORA, **options), config)
    fused = plan(LoRAOptions(**LORA, target_modules=["v_proj", "q_proj", "up_proj"]), dense)
    assert {k: v.parts for k, v in fused.items()} == {"linear_qkv": ("q_proj", "v_proj"), "linear_fc1": ("up_proj",)}
    assert fused["linear_qkv"].scaling == 2.0
    assert plan(LoRAOptions(rank=4, alpha=8, use_rslora=True), dense)["linear_fc2"].scaling == 4.0
    # MoE: peft's names and its fused gate_up_proj (rank and alpha doubled: alpha / r kept, rsLoRA 2 alpha / sqrt(2r))
    experts = plan(LoRAOptions(**LORA), moe)
    assert {k: (v.rank, v.scaling, v.parts) for k, v in experts.items() if "linear" not in k} == {
        "experts_fc1": (8, 2.0, ("gate_proj", "up_proj")), "experts_fc2": (4, 2.0, ("down_proj",)),
        "router": (4, 2.0, ("gate",))}
    assert plan(LoRAOptions(rank=4, alpha=8, use_rslora=True), moe)["experts_fc1"].scaling == pytest.approx(16 / 8**0.5)
    with pytest.raises(ValueError, match=r"LoRA on MoE experts adapts GroupedExperts: set trainer\.moe_grouped_gemm"):
        build_gpt(moe, grouped_experts=False, lora=experts)
    TrainConfig.from_dict({"trainer": {"backend": "megatron", "tp": 2, "lora": {"rank": 8}}})  # accepted now
    TrainConfig.from_dict({"trainer": {"backend": "fsdp", "lora": {"rank": 8}}})  # and on FSDP (test_fsdp_lora.py)
