"""The Megatron-core trainer on CPU (megatron-core with gloo, fp32, tiny shapes): converters, parity with
Hugging Face models and with `TorchTrainer`, the RoPE patch, THD packing, config errors.

A stand-in, said plainly: megatron-core allocates on `torch.cuda.current_device()` in its sequence-parallel
collectives, MoE router and recompute (and saves CUDA RNG state there); on this CPU-only machine
`trainers/megatron/cpu_compat.py` answers the CPU device and an empty CUDA RNG state, so those paths run with gloo.
The real CUDA paths (bf16, megatron's distributed optimizer, the all-to-all dispatcher, grouped GEMM, DP/TP/EP/SP on
two GPUs) are in tests/gpu/.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'slime_env[megatron]')")

from helpers import SHAPE, run_dist_check, same_weights, tiny, trajectories  # noqa: E402

from slime_env.trainers.batch import pack  # noqa: E402
from slime_env.trainers.torch_trainer import TorchTrainer, TrainerConfig  # noqa: E402


@pytest.fixture(scope="module")
def parallel():
    from slime_env.trainers.megatron import init_parallel

    return init_parallel(1)


@pytest.mark.parametrize("family,grouped", [("llama", True), ("qwen2", True), ("qwen3", True), ("qwen3_moe", True),
                                            ("qwen3_moe", False)])
def test_converters_round_trip_exactly(family, grouped, parallel):
    """HF -> megatron -> HF is exact; the megatron names are the model's own (MoE: `GroupedExperts`' stacked
    weights, or `SequentialMLP`'s per-expert ones)."""
    from slime_env.trainers.megatron import build_gpt, hf_to_mcore, mcore_to_hf, moe

    hf = tiny(family)
    state = hf.state_dict()
    mc = hf_to_mcore(state, hf.config)
    model = build_gpt(hf.config, grouped_experts=grouped)
    own = {k for k in model.state_dict() if not k.endswith("_extra_state")}
    named = moe.to_grouped(mc) if grouped else mc
    assert own == set(named), (own ^ set(named))
    assert moe.from_grouped(named).keys() == mc.keys()
    back = mcore_to_hf([moe.from_grouped(named)], hf.config)
    expected = {k for k in state if not (hf.config.tie_word_embeddings and k == "lm_head.weight")}
    assert set(back) == expected
    for k in back:
        assert torch.equal(back[k], state[k]), k


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tp_shards_concatenate_back_to_the_full_weights(family):
    from slime_env.trainers.megatron import hf_to_mcore, mcore_to_hf

    hf = tiny(family)
    state = hf.state_dict()
    shards = [hf_to_mcore(state, hf.config, tp_rank=r, tp_size=2) for r in range(2)]
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert shards[0][qkv].shape[0] * 2 == hf_to_mcore(state, hf.config)[qkv].shape[0]
    # rank 0 holds KV group 0: its query heads, then its key, then its value
    heads = hf.config.num_attention_heads
    d = getattr(hf.config, "head_dim", None) or hf.config.hidden_size // heads
    q0 = state["model.layers.0.self_attn.q_proj.weight"][: heads // 2 * d]
    assert torch.equal(shards[0][qkv][: heads // 2 * d], q0)
    back = mcore_to_hf(shards, hf.config)
    for k in back:
        assert torch.equal(back[k], state[k]), k


def test_tp_size_that_does_not_divide_the_heads_is_refused():
    from transformers import LlamaConfig

    from slime_env.trainers.megatron import transformer_config

    smollm2_shape = LlamaConfig(**{**SHAPE, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576})
    with pytest.raises(ValueError, match=r"tensor-parallel size 2 does not divide the attention heads \(9\)"):
        transformer_config(smollm2_shape, tp=2)


def test_moe_experts_on_disk_layout_and_expert_parallel_shares(parallel, tmp_path):
    """The per-expert layout of HF files (what save_pretrained writes and SGLang loads) converts to the same
    megatron weights as transformers' fused in-memory one; EP shares renumber the experts and put them back."""
    from safetensors.torch import load_file

    from slime_env.trainers.megatron import hf_to_mcore, moe

    hf = tiny("qwen3_moe")
    hf.save_pretrained(tmp_path)
    on_disk = load_file(str(tmp_path / "model.safetensors"))
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in on_disk and "model.layers.1.mlp.gate_proj.weight" in on_disk
    fused, per_expert = hf_to_mcore(hf.state_dict(), hf.config), hf_to_mcore(on_disk, hf.config)
    assert fused.keys() == per_expert.keys() and all(torch.equal(fused[k], per_expert[k]) for k in fused)
    assert moe.per_expert_layout(hf.state_dict(), hf.config).keys() == on_disk.keys()
    shares = [moe.local_experts(fused, 4, r, 2) for r in range(2)]
    name = "decoder.layers.2.mlp.experts.local_experts.{}.linear_fc1.weight"
    assert name.format(2) not in shares[1] and torch.equal(shares[1][name.format(0)], fused[name.format(2)])
    back = moe.global_experts(shares)
    assert back.keys() == {k for k in fused if moe.is_expert_param(k)}
    assert all(torch.equal(back[k], fused[k]) for k in back)
    del on_disk["model.layers.2.mlp.experts.1.down_proj.weight"]
    with pytest.raises(KeyError, match="experts.1.down_proj.weight"):
        hf_to_mcore(on_disk, hf.config)


def test_parallel_sizes_that_do_not_fit_the_model_are_refused_before_anything_is_built():
    from slime_env.trainers.megatron import transformer_config

    moe_cfg, dense = tiny("qwen3_moe").config, tiny("llama").config
    with pytest.raises(ValueError, match=r"expert-parallel size 3 does not divide the 4 experts"):
        transformer_config(moe_cfg, ep=3)
    with pytest.raises(ValueError, match=r"expert-parallel size 2 needs an MoE model; llama is dense"):
        transformer_config(dense, ep=2)
    with pytest.raises(ValueError, match=r"sequence_parallel .* needs tp > 1"):
        transformer_config(dense, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"an MoE model with tp=2 needs sequence_parallel"):
        transformer_config(moe_cfg, tp=2)
    with pytest.raises(ValueError, match=r"recompute 'some'"):
        transformer_config(dense, recompute="some")
    with pytest.raises(ValueError, match=r"pipeline-parallel size 3 does not divide the 2 layers of llama"):
        transformer_config(dense, pp=3)
    for bad, match in ((dict(ep=2), r"ep=2 needs backend: megatron"),
                       (dict(backend="megatron", sequence_parallel=True), r"sequence_parallel .* needs tp > 1"),
                       (dict(backend="fsdp", recompute="selective"), r"takes 'none' or 'full'"),
                       (dict(backend="fsdp", tp=2), r"tp=2 needs backend: megatron"),
                       (dict(backend="torch", cp=2), r"cp=2 needs backend: megatron"),
                       (dict(backend="megatron", cp=0), r"cp \(0\),.* must be >= 1"),
                       (dict(backend="fsdp", pp=2), r"pp=2 needs backend: megatron"),
                       (dict(backend="megatron", pp=2, estimator="ppo"), r"the critic is not pipelined"),
                       (dict(backend="megatron", recompute_method="block"), r"block is megatron's full recompute"),
                       (dict(backend="megatron", recompute="full", recompute_method="layers"), r"uniform or block"),
                       (dict(backend="megatron", recompute="selective", recompute_attention=False, cp=2),
                        r"recompute_attention: false .* \(got backend megatron, recompute selective\)")):
        with pytest.raises(ValueError, match=match):
            TrainerConfig(**bad)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_activation_recompute_gives_the_same_step(family, parallel):
    """Selective recompute re-runs the core attention and full recompute every layer inside the backward (their
    forward counts double); `recompute_method: block` recomputes only the first `recompute_layers` layers;
    `recompute_attention: false` keeps each recomputed layer's attention output from the forward (nothing kept is
    left after the step). The loss, the gradient norm and the weights after a step equal those without recompute."""
    from slime_env.trainers.megatron.attention import SDPAttention
    from slime_env.trainers.megatron_trainer import MegatronTrainer

    hf = tiny(family)
    trajs = trajectories(8, seed=3)
    results = {}
    runs = {"none": {}, "selective": {}, "full": {}, "block": dict(recompute_method="block"),
            "kept": dict(recompute_attention=False)}
    for name, extra in runs.items():
        trainer = MegatronTrainer(hf, TrainerConfig(backend="megatron", lr=1e-3, max_tokens_per_micro_batch=48,
                                                    recompute=name if name in ("none", "selective") else "full",
                                                    **extra), pad_id=0)
        calls = {}
        for i, layer in enumerate(trainer.model.decoder.layers):
            for what, module in (("attention", layer.self_attention.core_attention), ("mlp", layer.mlp)):
                calls[what, i] = 0
                module.register_forward_hook(lambda *_, key=(what, i): calls.__setitem__(key, calls[key] + 1))
        kept_before = SDPAttention.kept_calls
        metrics = trainer.step(trajs, group_size=4)
        calls["kept"] = SDPAttention.kept_calls - kept_before
        assert not any(m._kept for m in trainer.model.modules() if isinstance(m, SDPAttention))
        results[name] = (metrics, trainer.weights(), calls)
    m0, w0, c0 = results["none"]
    once = c0["attention", 0]
    assert m0["train/grad_norm"] > 0 and once > 0 and set(c0.values()) - {0} == {once} and c0["kept"] == 0
    doubled = {k: 2 * v for k, v in c0.items()}
    assert results["selective"][2] == c0 | {k: 2 * v for k, v in c0.items() if k[0] == "attention"}
    assert results["full"][2] == doubled
    assert results["block"][2] == c0 | {("attention", 0): 2 * once, ("mlp", 0): 2 * once}  # the others: not recomputed
    layers = len({k[1] for k in c0 if k != "kept"})  # every layer's recompute took the kept output, not the kernel
    assert results["kept"][2] == doubled | {"kept": once * layers}
    for m, w, _ in (results[k] for k in ("selective", "full", "block", "kept")):
        assert m["train/grad_norm"] == pytest.approx(m0["train/grad_norm"], rel=1e-6)
        assert m["train/loss"] == pytest.approx(m0["train/loss"], rel=1e-6, abs=1e-8)
        assert all(torch.allclose(w[k], w0[k], atol=1e-7, rtol=0) for k in w0)


def test_moe_trainer_log_probs_match_the_hf_model_and_its_checkpoint_loads_in_transformers(parallel, tmp_path):
    """A Qwen3-MoE MegatronTrainer: packed log-probs equal `TorchTrainer`'s on the HF model; after a step its
    saved folder (experts per tensor, as HF writes them) loads in transformers with exactly the trainer's weights."""
    from transformers import AutoModelForCausalLM

    from slime_env.trainers.megatron_trainer import MegatronTrainer

    hf = tiny("qwen3_moe")
    trajs = trajectories(8, seed=5)
    batch = pack(trajs, group_size=4, pad_id=0)
    trainer = MegatronTrainer(hf, TrainerConfig(backend="megatron", lr=1e-3, max_tokens_per_micro_batch=64), pad_id=0)
    with torch.no_grad():
        ours = trainer.logprobs(trainer.model, batch)
        ref = TorchTrainer(hf, TrainerConfig(), pad_id=0).logprobs(hf, batch)
    mask = batch.loss_mask.bool()
    assert torch.allclose(ours[mask], ref[mask], atol=1e-5, rtol=0)
    trainer.step(trajs, group_size=4)
    trainer.save(tmp_path / "ckpt")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "model", dtype=torch.float32).state_dict()
    weights = trainer.weights()
    assert loaded.keys() == weights.keys()
    assert all(torch.equal(loaded[k], weights[k]) for k in weights)
    assert not torch.equal(weights["model.layers.0.mlp.experts.gate_up_proj"],
                           hf.state_dict()["model.layers.0.mlp.experts.gate_up_proj"])


def test_unsupported_model_type_is_named():
    from transformers import GPT2Config

    from slime_env.trainers.megatron import model_family

    with pytest.raises(ValueError, match="'gpt2' is not supported"):
        model_family(GPT2Config())


def _packed_params(cu: torch.Tensor, longest: int):
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                           max_seqlen_kv=longest)


@pytest.mark.parametrize("family,grouped", [("llama", True), ("qwen2", True), ("qwen3", True), ("qwen3_moe", True),
                                            ("qwen3_moe", False), ("qwen3_moe_raw", True)])
def test_fp32_logits_equal_the_hf_model_bshd_and_thd(family, grouped, parallel):
    from slime_env.trainers.megatron import build_gpt, hf_to_mcore, moe
    from slime_env.trainers.megatron.optimizer import copy_params as _copy_params

    hf = tiny(family)
    model = build_gpt(hf.config, grouped_experts=grouped)
    mc = hf_to_mcore(hf.state_dict(), hf.config)
    _copy_params(model, moe.to_grouped(mc) if grouped else mc)  # every parameter, or a KeyError
    ids = torch.randint(0, SHAPE["vocab_size"], (3, 12), generator=torch.Generator().manual_seed(1))
    lengths = [5, 12, 9]
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        bshd = model(input_ids=ids, position_ids=None, attention_mask=None)
        assert torch.allclose(bshd, ref, atol=1e-5, rtol=0)
        flat = torch.cat([ids[i, :n] for i, n in enumerate(lengths)]).unsqueeze(0)
        cu = torch.tensor([0, 5, 17, 26], dtype=torch.int32)
        thd = model(input_ids=flat, position_ids=None, attention_mask=None, packed_seq_params=_packed_params(cu, 12))[0]
    for i, n in enumerate(lengths):  # each packed sequence sees only itself, from position 0
        assert torch.allclose(thd[cu[i]:cu[i + 1]], ref[i, :n], atol=1e-5, rtol=0)


def test_vectorised_thd_rope_equals_megatrons_own():
    from megatron.core.models.common.embeddings import rope_utils

    from slime_env.trainers.megatron.rope import apply_rotary_pos_emb_thd, packed_positions

    cu = torch.tensor([0, 3, 3, 10, 16], dtype=torch.int32)  # an empty sequence too
    assert packed_positions(cu, 16).tolist() == [0, 1, 2] + list(range(7)) + list(range(6))
    t = torch.randn(16, 4, 8)
    inv = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    freqs = torch.outer(torch.arange(32).float(), inv)
    freqs = torch.cat([freqs, freqs], -1)[:, None, None, :]

    ours = apply_rotary_pos_emb_thd(t, cu, freqs)
    assert torch.equal(ours, _megatron_thd_rope(t, cu, freqs, _FakeGroup(0, 1)))
    # and the patched entry point megatron's attention calls routes to ours
    from slime_env.trainers.megatron import install_rope_patch

    install_rope_patch()
    assert torch.equal(rope_utils._apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=_FakeGroup(0, 1)), ours)


def _megatron_thd_rope(t, cu, freqs, group):
    """megatron-core 0.16's own unfused THD RoPE (the function our patch replaces), called directly."""
    import importlib

    import megatron.core.models.common.embeddings.rope_utils as ru

    fresh = importlib.util.spec_from_file_location("_mc_rope_fresh", ru.__file__)
    module = importlib.util.module_from_spec(fresh)
    fresh.loader.exec_module(module)
    return module._apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=group)


def test_unpadded_batch_and_token_budget_micro_batches():
    from slime_env.trainers.distributed import balanced_ranges, token_budget_slices

    batch = pack(trajectories(4), group_size=2, pad_id=0)
    u = batch.unpadded()
    lengths = batch.attention_mask.sum(-1)
    assert u["cu_seqlens"].tolist() == [0] + torch.cumsum(lengths, 0).tolist()
    for i in range(4):  # each packed row is the row's real tokens, its loss mask and positions from 0
        a, b = u["cu_seqlens"][i], u["cu_seqlens"][i + 1]
        keep = batch.attention_mask[i].bool()
        assert torch.equal(u["input_ids"][a:b], batch.input_ids[i][keep])
        assert torch.equal(u["loss_mask"][a:b], batch.loss_mask[i][keep])
        assert u["position_ids"][a:b].tolist() == list(range(int(b - a)))
    assert token_budget_slices([5, 5, 5, 12, 1], 0, 5, 10) == [slice(0, 2), slice(2, 3), slice(3, 4), slice(4, 5)]
    assert balanced_ranges([4, 4, 4, 4], 2) == [(0, 2), (2, 4)]
    assert balanced_ranges([10, 1, 1, 1], 2) == [(0, 1), (1, 4)]


@pytest.mark.parametrize("head_chunk", [None, 7], ids=["full-head", "chunked-head"])
def test_packed_logprobs_equal_torch_trainers_and_masked_gradients_match(parallel, head_chunk):
    """Also with the LM head in chunks of 7 tokens (`lm_head_chunk_tokens`): the same log-probs and gradients."""
    from slime_env.trainers.megatron import mcore_to_hf
    from slime_env.trainers.megatron_trainer import MegatronTrainer

    hf = tiny("llama")
    trajs = trajectories(8, seed=3)
    cfg = dict(lr=1e-3, micro_batch_size=3, kl_coef=0.05, entropy_coef=0.01)
    torch_trainer = TorchTrainer(hf, TrainerConfig(**cfg), pad_id=0)
    mega = MegatronTrainer(hf, TrainerConfig(**cfg, backend="megatron", max_tokens_per_micro_batch=40,
                                             lm_head_chunk_tokens=head_chunk), pad_id=0)
    batch = pack(trajs, group_size=4, pad_id=0)
    with torch.no_grad():
        ref = torch_trainer.logprobs(hf, batch)
        ours = mega.logprobs(mega.model, batch)
    mask = batch.loss_mask.bool()
    assert torch.allclose(ours[mask], ref[mask], atol=1e-5, rtol=0)
    assert (ours[~mask] == 0).all()
    assert len(mega.backend.micro_slices(batch)) > 1  # the token budget really splits the batch

    grads = {}

    def capture(trainer, names):
        def step():
            grads[names] = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()}
            return 0.0
        return step

    torch_trainer.backend.optimizer_step = capture(torch_trainer, "torch")
    mega.backend.optimizer_step = capture(mega, "mega")
    torch_trainer.step(trajs, group_size=4)
    mega.step(trajs, group_size=4)
    as_hf = mcore_to_hf([grads["mega"]], hf.config)
    for name, g in as_hf.items():
        ref_g = grads["torch"][name]
        assert torch.allclose(g, ref_g, atol=1e-6 + 1e-4 * ref_g.abs().max().item(), rtol=1e-4), name
    assert any(g.abs().sum() > 0 for g in as_hf.values())


def test_chunked_lm_head_equals_the_full_log_softmax_with_gradients():
    """`chunked_head_logprobs` (chunks of 5 rows of 23) against the full fp64 log-softmax: log-probs, entropies and
    the gradients of hidden states and head weight under a loss that uses both."""
    from slime_env.trainers.megatron.logprobs import chunked_head_logprobs, head_chunk_tokens

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(23, 16, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (23,), generator=g)
    w_logp, w_ent = torch.randn(23, generator=g, dtype=torch.float64), torch.randn(23, generator=g, dtype=torch.float64)

    def loss_of(logp, ent):
        return (logp * w_logp).sum() + (ent * w_ent).sum()

    logits = hidden @ weight.t()
    ref_logp = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    ref_ent = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    ref = torch.autograd.grad(loss_of(ref_logp, ref_ent), [hidden, weight])
    logp, ent = chunked_head_logprobs(hidden, weight, targets, chunk_tokens=5, with_entropy=True)
    assert torch.allclose(logp.double(), ref_logp, atol=1e-5) and torch.allclose(ent.double(), ref_ent, atol=1e-5)
    ours = torch.autograd.grad(loss_of(logp.double(), ent.double()), [hidden, weight])
    for a, b in zip(ours, ref):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
    only = chunked_head_logprobs(hidden, weight, targets, chunk_tokens=100)  # one chunk
    assert torch.allclose(only.double(), ref_logp, atol=1e-5)
    # auto: chunks of 1 GiB once a micro-batch's fp32 logits pass 16 GiB (64k tokens x Qwen3's vocabulary: ~1.7k a
    # chunk; 16k tokens: the whole head)
    assert (head_chunk_tokens(None, 16384, 151936) == 0
            and head_chunk_tokens(None, 65536, 151936) == (1 << 30) // (151936 * 4))
    assert head_chunk_tokens(0, 65536, 151936) == 0 and head_chunk_tokens(512, 10, 10) == 512


def test_megatron_step_save_load_and_sync_round_trip(parallel, tmp_path):
    import asyncio

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from slime_env.trainers.megatron_trainer import MegatronTrainer

    hf = tiny("qwen2")
    trainer = MegatronTrainer(hf, TrainerConfig(backend="megatron", lr=1e-2), pad_id=0)
    before = {k: v.clone() for k, v in trainer.hf_state_dict().items()}
    metrics = trainer.step(trajectories(4, seed=5), group_size=2)
    assert metrics["train/step"] == 1.0 and metrics["train/grad_norm"] > 0
    after = trainer.hf_state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in after)
    trainer.save(tmp_path / "ckpt")
    # an HF tool reads the checkpoint as a normal model folder
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt" / "model"), dtype=torch.float32)
    for k, v in load_file(str(tmp_path / "ckpt" / "model" / "model.safetensors")).items():
        assert torch.equal(loaded.state_dict()[k], v)
    fresh = MegatronTrainer(tiny("qwen2", seed=9), TrainerConfig(backend="megatron", lr=1e-2), pad_id=0)
    fresh.load(tmp_path / "ckpt")
    assert fresh.step_count == 1
    batch = pack(trajectories(4, seed=6), group_size=2, pad_id=0)
    with torch.no_grad():
        assert torch.equal(fresh.logprobs(fresh.model, batch), trainer.logprobs(trainer.model, batch))

    class Engine:  # what TransformersPolicy.update_weights receives
        async def update_weights(self, state, version):
            self.state, self.version = state, version

    engine = Engine()
    assert asyncio.run(trainer.sync(engine)) == "1"
    assert set(engine.state) == set(after)
    assert torch.equal(engine.state["model.norm.weight"], after["model.norm.weight"])


def test_yaml_backend_switch_and_its_errors():
    from slime_env.errors import InvalidInput
    from slime_env.trainers.run import TrainConfig

    TrainConfig.from_dict({"trainer": {"backend": "megatron", "tp": 2}})
    with pytest.raises(InvalidInput, match="backend 'deepspeed'"):
        TrainConfig.from_dict({"trainer": {"backend": "deepspeed"}})
    with pytest.raises(InvalidInput, match="tp=2 needs backend: megatron"):
        TrainConfig.from_dict({"trainer": {"tp": 2}})
    TrainConfig.from_dict({"trainer": {"backend": "megatron", "attention_kernel": "cudnn"}})
    with pytest.raises(InvalidInput, match="attention_kernel must be one of auto, flash, cudnn, got 'fa3'"):
        TrainConfig.from_dict({"trainer": {"backend": "megatron", "attention_kernel": "fa3"}})
    with pytest.raises(InvalidInput, match="attention_kernel is the megatron trainer's"):
        TrainConfig.from_dict({"trainer": {"backend": "torch", "attention_kernel": "flash"}})


def test_packed_batch_runs_put_long_sequences_alone_and_short_ones_together():
    """`auto`'s split of a packed batch: each sequence of >= min tokens alone (cuDNN's), each stretch of shorter
    ones between them one varlen run with its own offsets; empty sequences vanish; the runs tile the batch."""
    from slime_env.trainers.megatron.attention import _runs

    cu = torch.tensor([0, 10, 13, 13, 40, 45, 47, 60], dtype=torch.int32)  # lengths 10 3 0 27 5 2 13
    runs = _runs(cu, 10)
    assert [(a, b, None if c is None else c.tolist(), m) for a, b, c, m in runs] == [
        (0, 10, None, 10), (10, 13, [0, 3], 3), (13, 40, None, 27), (40, 47, [0, 5, 7], 5), (47, 60, None, 13)]
    assert _runs(cu, 10) is runs  # every layer of the forward reuses the split of the same cu_seqlens
    assert [(a, b, c.tolist()) for a, b, c, _ in _runs(cu, 100)] == [(0, 60, [0, 10, 13, 40, 45, 47, 60])]


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_dp2_tp2_and_sequence_parallel_on_cpu_equal_one_process(tmp_path):
    """torchrun with two gloo processes: DP=2 gives the one-process gradient and weights, identical on both ranks,
    with each rank's optimizer holding the state of about half the parameters (the two halves: all of them); TP=2,
    and TP=2 with sequence parallelism (an odd token count: the padding path), give the one-process log-probs,
    gradient norm and weights after the step (fp32: to rounding)."""
    one, dp2, tp2, sp2 = (run_dist_check(tmp_path, n, tp, *x) for n, tp, x in
                          ((1, 1, ()), (2, 1, ()), (2, 2, ()), (2, 2, ("--sp",))))
    assert dp2["parallel"]["dp"] == 2 and tp2["parallel"]["tp"] == 2 and tp2["parallel"]["dp"] == 1
    assert dp2["param_sums"][0] == dp2["param_sums"][1]
    same_weights(dp2["weight_sums"], one["weight_sums"])
    assert one["stepped_by"] == [one["trainable"]] and sum(dp2["stepped_by"]) == dp2["trainable"]
    assert max(dp2["stepped_by"]) < 0.6 * dp2["trainable"]
    assert dp2["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    assert dp2["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
    for run in (tp2, sp2):
        assert run["logprobs"] == pytest.approx(one["logprobs"], abs=1e-5)
        assert run["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
        same_weights(run["weight_sums"], one["weight_sums"])
    assert dp2["grad_norm"] > 0


def test_context_parallel_2_on_cpu_equals_one_process(tmp_path):
    """CP=2 (each gloo rank holds two chunks of every packed sequence; K/V all-gathered per layer), CP=2 x TP=2 with
    sequence parallelism under full recompute, and Qwen3-MoE with CP=2 x EP=2 and idle passes give the one-process
    log-probs, loss, gradient norm and weights after the step (fp32: to rounding); so does PPO's critic under CP=2
    (value loss and critic gradient norm)."""
    one = run_dist_check(tmp_path, 1)
    for run in (run_dist_check(tmp_path, 2, cp=2), run_dist_check(tmp_path, 4, 2, "--sp", "--recompute", "full", cp=2)):
        assert run["parallel"]["cp"] == 2 and run["parallel"]["dp"] == 1
        assert run["logprobs"] == pytest.approx(one["logprobs"], abs=1e-5)
        assert run["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
        assert run["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
        same_weights(run["weight_sums"], one["weight_sums"])
        assert len(set(map(tuple, run["param_sums"][::run["parallel"]["tp"]]))) == 1  # CP ranks: the same weights
    # attention kept through the recompute (`recompute_attention: false`): under CP too the recompute took kept
    # outputs (a whole number of them per layer), and the step is the one-process step under full recompute
    full_one = run_dist_check(tmp_path, 1, 1, "--recompute", "full")
    kept = run_dist_check(tmp_path, 2, 1, "--recompute", "full", "--keep-attention", cp=2)
    assert kept["kept_calls"] > 0 and kept["kept_calls"] % kept["layers"] == 0
    assert kept["grad_norm"] == pytest.approx(full_one["grad_norm"], rel=1e-5)
    assert kept["loss"] == pytest.approx(full_one["loss"], rel=1e-5, abs=1e-7)
    same_weights(kept["weight_sums"], full_one["weight_sums"])
    moe_one, moe_cp = (run_dist_check(tmp_path, n, 1, "--moe", "--failed", "4", ep=e, cp=c) for n, e, c in
                       ((1, 1, 1), (4, 2, 2)))
    assert moe_cp["parallel"]["dp"] == 2 and moe_cp["parallel"]["cp"] == 2
    assert moe_cp["logprobs"] == pytest.approx(moe_one["logprobs"], abs=1e-5)
    assert moe_cp["grad_norm"] == pytest.approx(moe_one["grad_norm"], rel=1e-5)
    same_weights(moe_cp["weight_sums"], moe_one["weight_sums"])
    ppo_one, ppo_cp = (run_dist_check(tmp_path, n, 1, "--ppo", cp=c) for n, c in ((1, 1), (2, 2)))
    for key in ("loss", "value_loss", "grad_norm", "critic_grad_norm"):
        assert ppo_cp[key] == pytest.approx(ppo_one[key], rel=1e-5, abs=1e-7), key
    assert ppo_one["value_loss"] > 0
    same_weights(ppo_cp["weight_sums"], ppo_one["weight_sums"])


def test_pipeline_parallel_2_on_cpu_equals_one_process(tmp_path):
    """PP=2 (two gloo stages of two layers each, megatron's 1F1B schedule over the packed micro-batches): a Llama
    with tied embeddings (the last stage's copy of the embedding gets the summed gradient), PP=2 x CP=2, and a
    Qwen3-MoE (the all-gather dispatcher: one fixed activation shape; failed trajectories' micro-batches still
    flow through both stages) give the one-process log-probs before and after the step, loss, gradient norm and
    weights."""
    cases = (((1, "--tied"), (2, "--tied", "--pp", "2")), ((1, "--tied"), (4, "--tied", "--pp", "2")),
             ((1, "--moe", "--failed", "4"), (2, "--moe", "--failed", "4", "--pp", "2")))
    done: dict = {}
    for (n1, *ref), (n2, *flags) in cases:
        cp = 2 if n2 == 4 else 1
        one = done.setdefault(tuple(ref), run_dist_check(tmp_path, n1, 1, "--layers", "4", *ref))
        run = run_dist_check(tmp_path, n2, 1, "--layers", "4", *flags, cp=cp)
        assert run["parallel"]["pp"] == 2 and run["parallel"]["cp"] == cp, flags
        for key in ("logprobs", "logprobs_after"):
            assert run[key] == pytest.approx(one[key], abs=1e-5), (flags, key)
        assert run["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
        assert run["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
        same_weights(run["weight_sums"], one["weight_sums"])
        assert one["logprobs_after"] != pytest.approx(one["logprobs"], abs=1e-4)  # the step moved the weights


def test_pipeline_stage_weights_split_and_renumber_back():
    """Each stage gets its layers renumbered from 0, the embedding on the first stage and the norm and head on the
    last (a tied model's last stage: a copy of the embedding); renumbering the stages back gives the whole dict."""
    from slime_env.trainers.megatron import hf_to_mcore
    from slime_env.trainers.megatron.convert import renumber_layers, stage_weights

    for family in ("llama", "qwen3"):
        hf = tiny(family)
        tied = bool(hf.config.tie_word_embeddings)
        full = hf_to_mcore(hf.state_dict(), hf.config)
        stages = [stage_weights(full, offset=i, layers=1, first=i == 0, last=i == 1, tied=tied) for i in range(2)]
        assert not any(k.startswith("decoder.layers.1.") for st in stages for k in st)
        assert "embedding.word_embeddings.weight" in stages[0] and "decoder.final_layernorm.weight" in stages[1]
        assert ("output_layer.weight" in stages[1]) and ("output_layer.weight" not in stages[0])
        if tied:
            assert torch.equal(stages[1]["output_layer.weight"], full["embedding.word_embeddings.weight"])
        back = renumber_layers(stages[0], 0) | renumber_layers(stages[1], 1)
        expect = dict(full, **({"output_layer.weight": full["embedding.word_embeddings.weight"]} if tied else {}))
        assert back.keys() == expect.keys() and all(torch.equal(back[k], expect[k]) for k in back)


def test_context_parallel_layout_attention_and_rope_equal_the_whole_sequence(parallel):
    """For every CP rank of CP=2 and CP=3: the rank's tokens are its two balanced chunks of each padded sequence,
    causal attention of its queries to the prefixes built from the all-gathered K/V equals full causal attention at
    those tokens, and its RoPE equals megatron-core's own CP THD RoPE."""
    from megatron.core.transformer.enums import AttnMaskType

    from slime_env.trainers.megatron import SDPAttention, context_parallel as ctx, transformer_config
    from slime_env.trainers.megatron.rope import apply_rotary_pos_emb_thd

    ids, cu = torch.arange(1, 24), torch.tensor([0, 5, 6, 17, 23], dtype=torch.int32)
    padded, cu_p, where = ctx.pad_sequences(ids, cu, 2, pad_id=0)
    assert cu_p.tolist() == [0, 8, 12, 24, 32] and torch.equal(padded[where], ids)
    assert ctx.shard_index(cu_p, 0, 2)[:4].tolist() == [0, 1, 6, 7]  # sequence 0 (8 tokens): chunks 0 and 3
    assert ctx.shard_index(cu_p, 1, 2)[:4].tolist() == [2, 3, 4, 5]  # chunks 1 and 2
    attn = SDPAttention(transformer_config(tiny("llama").config), 1, AttnMaskType.causal, "self")
    heads, kv, d = attn.heads, attn.kv_heads, attn.head_dim
    inv = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    freqs = torch.outer(torch.arange(64).float(), inv)
    freqs = torch.cat([freqs, freqs], -1)[:, None, None, :]
    for cp in (2, 3):
        cu_p = ctx.pad_sequences(ids, cu, cp, 0)[1]
        total = int(cu_p[-1])
        torch.manual_seed(cp)
        q, k, v = torch.randn(total, heads, d), torch.randn(total, kv, d), torch.randn(total, kv, d)
        whole = attn._varlen_causal_attn(q, k, v, cu_p, cu_p, 0, 0)
        shards = [ctx.shard_index(cu_p, r, cp) for r in range(cp)]
        assert sorted(torch.cat(shards).tolist()) == list(range(total))
        t = torch.randn(total, 4, 8)
        for r, mine in enumerate(shards):
            layout = ctx.prefix_layout(cu_p, r, cp)
            gk, gv = (torch.cat([x[s] for s in shards])[layout.kv_index] for x in (k, v))
            out = attn._varlen_causal_attn(q[mine], gk, gv, layout.cu_q, layout.cu_k, layout.max_q, layout.max_k)
            assert torch.allclose(out, whole[mine], atol=1e-5)
            group = _FakeGroup(r, cp)
            assert torch.equal(apply_rotary_pos_emb_thd(t[mine], cu_p, freqs, cp_rank=r, cp_size=cp),
                               _megatron_thd_rope(t[mine], cu_p, freqs, group))


def test_cp_prefix_runs_tile_the_layout_long_chunks_alone_split_at_their_own_keys(parallel):
    """The CP path's kernel plan on a GPU (`_prefix_runs`, planned here on CPU tensors): the runs cover a rank's query
    rows and gathered key rows in order; a chunk of at least `min_tokens` goes alone to cuDNN as the keys before it
    (no mask) and its own keys (causal); the shorter chunks between two such share one varlen call whose segment
    offsets are theirs."""
    from megatron.core.transformer.enums import AttnMaskType

    from slime_env.trainers.megatron import SDPAttention, attention, context_parallel as ctx, transformer_config

    attn = SDPAttention(transformer_config(tiny("llama").config), 1, AttnMaskType.causal, "self")
    cu = torch.tensor([0, 400, 412, 416, 816], dtype=torch.int32)  # padded for CP=2: 400, 12, 4, 400 tokens
    for r in range(2):
        layout = ctx.prefix_layout(cu, r, 2)  # chunks of 100, 100, 3, 3, 1, 1, 100, 100 query rows
        runs = attention._prefix_runs(attn, layout, 50)
        assert attention._prefix_runs(attn, layout, 50) is runs  # planned once per layout
        assert [(x.qa, x.qb) for x in runs] == [(0, 100), (100, 200), (200, 208), (208, 308), (308, 408)]
        assert [x.kb for x in runs] == layout.cu_k[[1, 2, 6, 7, 8]].tolist()
        assert runs[0].ka == 0 and all(a.kb == b.ka for a, b in zip(runs, runs[1:]))
        for x in runs[:2] + runs[3:]:  # cuDNN: the keys before the chunk without a mask, then its own, causal
            n = x.qb - x.qa
            assert isinstance(x, attention._CudnnPrefixRun) and x._pieces()[-1] == (x.kb - n, x.kb, True)
            assert x._pieces()[:-1] == ([] if x.kb - x.ka == n else [(x.ka, x.kb - n, False)])
        assert [len(x._pieces()) for x in runs[:2]] == ([1, 2] if r == 0 else [2, 2])  # rank 0's first: no keys before
        short = runs[2]
        assert isinstance(short, attention._FlashPrefixRun) and short.cu_q.tolist() == [0, 3, 6, 7, 8]
        assert short.cu_k.tolist() == (layout.cu_k[2:7] - layout.cu_k[2]).tolist()
        assert (short.max_q, short.max_k) == (3, max(layout.cu_k[3:7] - layout.cu_k[2:6]))


class _FakeGroup:
    """What megatron's THD RoPE asks of a process group (its size and this rank), without one."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def test_moe_expert_parallel_2_on_cpu_equals_one_process(tmp_path):
    """Qwen3-MoE with EP=2 (each gloo rank holds 4 of the 8 experts and half the rows; tokens reach their experts
    through megatron's dispatcher) gives the one-process log-probs, loss, gradient norm and weights after the step.
    The last 4 trajectories failed, so rank 1's last micro-batches have no loss tokens: it runs idle passes to
    keep exchanging tokens with rank 0 (without them this run hangs)."""
    one, ep2 = (run_dist_check(tmp_path, n, 1, "--moe", "--failed", "4", ep=ep) for n, ep in ((1, 1), (2, 2)))
    assert ep2["parallel"]["ep"] == 2 and ep2["parallel"]["dp"] == 2
    assert ep2["logprobs"] == pytest.approx(one["logprobs"], abs=1e-5)
    assert ep2["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
    assert ep2["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    same_weights(ep2["weight_sums"], one["weight_sums"])
    assert any(".mlp.experts.gate_up_proj" in k for k in ep2["weight_sums"]) and one["grad_norm"] > 0


def test_train_loop_with_the_megatron_backend_from_the_example_config(tmp_path):
    """examples/megatron_train.yaml, shrunk to one step on the CPU: rollouts of the multi-turn env, a Megatron
    step, sync into the engine, held-out evaluation, and a checkpoint `TorchTrainer` can load."""
    import asyncio

    import yaml

    from slime_env.agents import load_default_model
    from slime_env.trainers.run import TrainConfig, train

    raw = yaml.safe_load(open(os.path.join(ROOT, "examples", "megatron_train.yaml")))
    raw.update(run_dir=str(tmp_path / "run"), steps=1, prompts_per_step=2, n_samples_per_prompt=2, eval_every=1,
               max_new_tokens=8, save_every=1, device="cpu")
    raw["eval_data"]["size"] = 4
    summary = asyncio.run(train(TrainConfig.from_dict(raw), log=lambda _: None))
    rows = [json.loads(line) for line in open(summary["metrics"])]
    assert [r["step"] for r in rows] == [0, 1] and "eval/accuracy" in rows[1]
    assert rows[1]["train/tokens"] > 0 and rows[1]["rollout/statuses"]
    model, _ = load_default_model()
    reader = TorchTrainer(model, TrainerConfig(), pad_id=0)
    reader.load(tmp_path / "run" / "checkpoints" / "step_1")  # HF names: the torch trainer reads it
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "run" / "checkpoints" / "step_1" / "model" / "model.safetensors"))
    for name in ("model.norm.weight", "model.layers.3.mlp.down_proj.weight"):
        assert torch.equal(reader.model.state_dict()[name], saved[name])


@pytest.mark.parametrize("lora", [False, True])
def test_train_loop_trains_a_qwen3_moe_from_the_moe_example_config(tmp_path, lora):
    """examples/moe_megatron_train.yaml shrunk to the CPU: a tiny random Qwen3-MoE with SmolLM2's tokenizer, the
    embedded engine generating through transformers' own Qwen3-MoE classes, a Megatron MoE step, the weights synced
    into the engine in place (fused expert layout), and a checkpoint transformers loads (per-expert layout). With
    a `lora:` section (the example's commented line): the adapter (attention, experts, router) synced and merged into
    the engine, the checkpoint a PEFT adapter whose expert weights moved."""
    import asyncio

    import yaml
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from slime_env.agents import load_default_model
    from slime_env.trainers.run import TrainConfig, train

    _, tokenizer = load_default_model()
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                         num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    Qwen3MoeForCausalLM(cfg).save_pretrained(tmp_path / "moe")
    tokenizer.save_pretrained(tmp_path / "moe")
    raw = yaml.safe_load(open(os.path.join(ROOT, "examples", "moe_megatron_train.yaml")))
    for key in ("cluster", "engine"):
        raw.pop(key)
    # a random model earns no reward (zero advantages): the entropy bonus gives the step a gradient to apply
    raw["trainer"].update(ep=1, moe_token_dispatcher=None, max_tokens_per_micro_batch=512, entropy_coef=0.01, lr=1e-3)
    raw.update(model=str(tmp_path / "moe"), run_dir=str(tmp_path / "run"), steps=1, prompts_per_step=2,
               n_samples_per_prompt=2, eval_every=1, max_new_tokens=8, save_every=1, device="cpu")
    raw["eval_data"]["size"] = 4
    if lora:
        raw["trainer"]["lora"] = {"rank": 4, "alpha": 8}
    summary = asyncio.run(train(TrainConfig.from_dict(raw), log=lambda _: None))
    rows = [json.loads(line) for line in open(summary["metrics"])]
    assert [r["step"] for r in rows] == [0, 1] and rows[1]["train/tokens"] > 0
    if lora:
        from slime_env.agents.lora_adapter import LoRAAdapter

        adapter = LoRAAdapter.load(tmp_path / "run" / "checkpoints" / "step_1" / "adapter")
        assert adapter.config["target_parameters"] == ["down_proj", "gate.weight", "gate_up_proj"]
        assert adapter.tensors["base_model.model.model.layers.1.mlp.experts.base_layer.lora_B.weight"].abs().sum() > 0
        return
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "checkpoints" / "step_1" / "model")
    start = AutoModelForCausalLM.from_pretrained(tmp_path / "moe")
    name = "model.layers.1.mlp.experts.gate_up_proj"
    assert saved.state_dict()[name].shape == start.state_dict()[name].shape
    assert not torch.equal(saved.state_dict()[name], start.state_dict()[name])


def test_moe_load_balancing_loss_reaches_the_gradient(parallel):
    """The routers' auxiliary loss is applied in the step (megatron adds it only for modules in training mode):
    its coefficient changes the router weights' update; with the loss off, routers still learn from the policy
    loss alone."""
    from slime_env.trainers.megatron_trainer import MegatronTrainer

    trajs = trajectories(8, seed=9)
    routers = {}
    for coeff in (0.0, 10.0):
        trainer = MegatronTrainer(tiny("qwen3_moe"), TrainerConfig(backend="megatron", lr=1e-3,
                                                                   moe_aux_loss_coeff=coeff,
                                                                   max_tokens_per_micro_batch=64), pad_id=0)
        before = trainer.weights()["model.layers.0.mlp.gate.weight"].clone()
        trainer.step(trajs, group_size=4)
        routers[coeff] = trainer.weights()["model.layers.0.mlp.gate.weight"] - before
    assert routers[0.0].abs().sum() > 0
    assert not torch.allclose(routers[0.0], routers[10.0])
