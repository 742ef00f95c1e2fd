"""Trainers at scale on a GPU: the Qwen3-MoE Megatron model against Hugging Face in bf16, a 32k-token trajectory
under activation recompute, an FSDP2 step, context-parallel attention through varlen flash and cuDNN; on two GPUs,
TP=2 with sequence parallelism, CP=2, EP=2 and FSDP2 over two.

Run on a GPU machine: `python -m pytest tests/gpu -q` (skipped without CUDA; never in CI).
"""

from __future__ import annotations

import copy
import json
import os
import sys

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from helpers import run_group, tiny, trajectories  # noqa: E402
from slime_env.trainers.batch import pack  # noqa: E402
from slime_env.trainers.torch_trainer import TorchTrainer, TrainerConfig  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def moe_hf():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=8,
                         num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False,
                         max_position_embeddings=4096)
    return Qwen3MoeForCausalLM(cfg).eval()


def test_qwen3_moe_bf16_logprobs_match_hf_and_a_step_trains():
    """The megatron MoE model (alltoall dispatcher, router in fp32) in bf16 scores the same tokens as transformers'
    Qwen3-MoE in fp32 on the GPU, about as closely as transformers' own bf16 does; a step moves the experts."""
    from slime_env.trainers.megatron_trainer import MegatronTrainer

    hf = moe_hf()
    trajs = trajectories(16, seed=1, vocab=4096)
    batch = pack(trajs, group_size=4, pad_id=0)
    mask = batch.loss_mask.bool()
    gpu = copy.deepcopy(hf).to("cuda")
    ref = TorchTrainer(gpu, TrainerConfig(micro_batch_size=16), pad_id=0)
    with torch.no_grad():
        ref32 = ref.logprobs(gpu, batch)[mask].cpu()
        ref16 = ref.logprobs(gpu.to(torch.bfloat16), batch)[mask].cpu()
    del gpu, ref
    trainer = MegatronTrainer(hf, TrainerConfig(backend="megatron", lr=1e-4), pad_id=0)
    with torch.no_grad():
        ours = trainer.logprobs(trainer.model, batch)[mask].cpu()
    hf_gap, our_gap = (ref16 - ref32).abs().mean().item(), (ours - ref32).abs().mean().item()
    print(f"mean |log-prob - fp32 HF|: HF bf16 {hf_gap:.4f}, megatron bf16 {our_gap:.4f}")
    assert our_gap < max(2 * hf_gap, 0.02)
    before = trainer.weights()["model.layers.0.mlp.experts.gate_up_proj"].clone()
    metrics = trainer.step(trajs, group_size=4)
    assert torch.isfinite(torch.tensor(metrics["train/grad_norm"])) and metrics["train/grad_norm"] > 0
    assert not torch.equal(trainer.weights()["model.layers.0.mlp.experts.gate_up_proj"], before)


def test_a_32k_token_trajectory_steps_under_full_recompute_with_the_same_gradient():
    """One 32,768-token trajectory (SmolLM2-135M's shape): the step with full recompute uses less memory than
    without and gives the same gradient norm and loss (bf16: to rounding)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.megatron_mfu import trajectories as long_trajectories
    from slime_env.trainers.megatron_trainer import MegatronTrainer

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=32768,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg)
    trajs = long_trajectories([32768, 32768], cfg.vocab_size)  # two: a group with a reward spread
    results = {}
    for recompute in ("none", "full"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        trainer = MegatronTrainer(hf, TrainerConfig(backend="megatron", lr=1e-5, recompute=recompute,
                                                    max_tokens_per_micro_batch=32768), pad_id=0)
        m = trainer.step(trajs, group_size=2)
        results[recompute] = (m["train/grad_norm"], m["train/loss"], torch.cuda.max_memory_allocated() / 2**30)
        del trainer
    print({k: f"grad_norm {g:.5f} loss {lo:.6f} peak {gb:.1f} GB" for k, (g, lo, gb) in results.items()})
    assert results["full"][2] < results["none"][2]
    assert results["full"][0] == pytest.approx(results["none"][0], rel=2e-2)
    assert results["full"][1] == pytest.approx(results["none"][1], rel=2e-2, abs=1e-3)


def test_fsdp2_step_on_one_gpu_matches_the_torch_trainer():
    """`FSDPTrainer` on one GPU (fp32 parameters, bf16 compute) scores like `TorchTrainer` on the same model in fp32
    (to bf16 rounding); a step trains."""
    from slime_env.trainers.fsdp_trainer import FSDPTrainer

    hf = tiny("qwen3")
    trajs = trajectories(16, seed=3)
    batch = pack(trajs, group_size=4, pad_id=0)
    mask = batch.loss_mask.bool()
    ref = tiny("qwen3").to("cuda")
    with torch.no_grad():
        ref_lp = TorchTrainer(ref, TrainerConfig(), pad_id=0).logprobs(ref, batch)[mask].cpu()
    trainer = FSDPTrainer(hf, TrainerConfig(backend="fsdp", lr=1e-3, micro_batch_size=4), pad_id=0)
    with torch.no_grad():
        lp = trainer.logprobs(trainer.model, batch)[mask].cpu()
    assert (lp - ref_lp).abs().mean() < 0.05
    m = trainer.step(trajs, group_size=4)
    assert m["train/grad_norm"] > 0


def test_context_parallel_attention_through_the_varlen_kernel_equals_full_attention():
    """Each CP rank's query chunks attend to their causal prefixes through varlen flash attention (bf16, query
    segments shorter than their keys: the kernel must align the causal mask at the ends) and give full causal
    attention at the rank's tokens, as closely as bf16 allows (the fp32 CPU test checks the layout exactly)."""
    from megatron.core.transformer.enums import AttnMaskType

    from slime_env.trainers.megatron import SDPAttention, context_parallel as ctx, init_parallel, transformer_config

    init_parallel(1)
    cfg = tiny("llama").config
    attn = SDPAttention(transformer_config(cfg, dtype=torch.bfloat16), 1, AttnMaskType.causal, "self")
    lengths = [3000, 17, 1, 4096, 900]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    for cp in (2, 4):
        _, cu_p, _ = ctx.pad_sequences(torch.zeros(sum(lengths), dtype=torch.long), cu, cp, 0)
        total = int(cu_p[-1])
        torch.manual_seed(cp)
        q, k, v = (torch.randn(total, n, attn.head_dim, device="cuda", dtype=torch.bfloat16)
                   for n in (attn.heads, attn.kv_heads, attn.kv_heads))
        ref = attn._varlen_causal_attn(q.float(), k.float(), v.float(), cu_p, cu_p, 0, 0)  # per-sequence SDPA, fp32
        shards = [ctx.shard_index(cu_p, r, cp).cuda() for r in range(cp)]
        for r, mine in enumerate(shards):
            layout = ctx.prefix_layout(cu_p.cuda(), r, cp)
            gk, gv = (torch.cat([x[s] for s in shards])[layout.kv_index] for x in (k, v))
            out = attn._varlen_causal_attn(q[mine], gk, gv, layout.cu_q, layout.cu_k, layout.max_q, layout.max_k)
            assert (out.float() - ref[mine]).abs().max() < 0.02, (cp, r)


def test_context_parallel_attention_through_cudnn_gives_full_attention_and_its_gradients():
    """On Hopper a CP rank's long query chunks go to cuDNN as two calls (the keys before the chunk without a mask,
    its own keys causal) joined by their log-sum-exps, the short chunks between them to one varlen flash call; the
    output and the gradients of q, k and v equal fp32 full causal attention's at the rank's tokens, as closely as the
    all-flash path's do (head_dim 128, GQA 4:1)."""
    from megatron.core.transformer.enums import AttnMaskType
    from transformers import LlamaConfig

    from slime_env.trainers.megatron import SDPAttention, attention, context_parallel as ctx, init_parallel
    from slime_env.trainers.megatron import transformer_config

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("cuDNN attention is used on Hopper or newer")
    init_parallel(1)
    cfg = LlamaConfig(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, intermediate_size=64,
                      num_hidden_layers=1, vocab_size=64)
    attn = SDPAttention(transformer_config(cfg, dtype=torch.bfloat16), 1, AttnMaskType.causal, "self")
    flash = SDPAttention(transformer_config(cfg, dtype=torch.bfloat16), 1, AttnMaskType.causal, "self", kernel="flash")
    attn._cudnn_min = 512  # chunks of >= 512 query rows through cuDNN (the default is 8k)
    lengths = [6000, 17, 1, 4096, 900, 3000]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    for cp in (2, 4):
        _, cu_p, _ = ctx.pad_sequences(torch.zeros(sum(lengths), dtype=torch.long), cu, cp, 0)
        torch.manual_seed(cp)
        q, k, v, g = (torch.randn(int(cu_p[-1]), n, attn.head_dim, device="cuda", dtype=torch.bfloat16)
                      for n in (attn.heads, attn.kv_heads, attn.kv_heads, attn.heads))
        shards = [ctx.shard_index(cu_p, r, cp).cuda() for r in range(cp)]
        for r, mine in enumerate(shards):
            ref = [x.float().requires_grad_() for x in (q, k, v)]
            out = attn._varlen_causal_attn(*ref, cu_p, cu_p, 0, 0)[mine]  # per-sequence SDPA, fp32
            (out * g[mine].float()).sum().backward()
            want = (out.detach(), ref[0].grad[mine], ref[1].grad, ref[2].grad)
            errors = {}
            for name, kernel in (("cudnn", attn), ("flash", flash)):
                layout = ctx.prefix_layout(cu_p.cuda(), r, cp)
                qr, kk, vv = (x.detach().requires_grad_() for x in (q[mine], k, v))
                gk, gv = (torch.cat([x[s] for s in shards])[layout.kv_index] for x in (kk, vv))
                got = kernel._prefix_attn(qr, gk, gv, layout)
                (got.float() * g[mine].float()).sum().backward()
                errors[name] = [float((a.float() - b).norm() / b.norm()) for a, b in
                                zip((got.detach(), qr.grad, kk.grad, vv.grad), want)]
            runs = attention._prefix_cache["runs"]
            assert sum(isinstance(x, attention._CudnnPrefixRun) for x in runs) >= 2
            assert any(isinstance(x, attention._FlashPrefixRun) for x in runs)
            print(f"cp {cp} rank {r}: relative error of out, dq, dk, dv: cudnn {errors['cudnn']}, "
                  f"flash {errors['flash']}")
            for mine_err, flash_err in zip(errors["cudnn"], errors["flash"]):
                assert mine_err < 0.02 and mine_err < 2 * flash_err + 1e-3, errors


def test_context_parallel_attention_kept_through_recompute_gives_the_same_gradients():
    """`recompute_attention: false` under CP: the gradient-free forward keeps each run's output (cuDNN for the long
    chunks, one varlen flash call for the short ones), the recompute's forward takes it without running a kernel,
    and the backward gives the gradients the plain CP attention gives (the same kernels' backward on the same
    outputs; up to the backward kernels' own run-to-run differences: they accumulate dq with atomics)."""
    from megatron.core.transformer.enums import AttnMaskType
    from transformers import LlamaConfig

    from slime_env.trainers.megatron import SDPAttention, attention, context_parallel as ctx, init_parallel
    from slime_env.trainers.megatron import transformer_config

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("cuDNN attention is used on Hopper or newer")
    init_parallel(1)
    cfg = LlamaConfig(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, intermediate_size=64,
                      num_hidden_layers=1, vocab_size=64)
    attn = SDPAttention(transformer_config(cfg, dtype=torch.bfloat16), 1, AttnMaskType.causal, "self", keep=True)
    attn._cudnn_min = 512
    lengths = [6000, 17, 1, 4096, 900]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    _, cu_p, _ = ctx.pad_sequences(torch.zeros(sum(lengths), dtype=torch.long), cu, 2, 0)
    torch.manual_seed(0)
    q, k, v, g = (torch.randn(int(cu_p[-1]), n, attn.head_dim, device="cuda", dtype=torch.bfloat16)
                  for n in (attn.heads, attn.kv_heads, attn.kv_heads, attn.heads))
    shards = [ctx.shard_index(cu_p, r, 2).cuda() for r in range(2)]
    layout = ctx.prefix_layout(cu_p.cuda(), 1, 2)
    grads = []
    for keep in (False, True):
        qr, kk, vv = (x.detach().requires_grad_() for x in (q[shards[1]], k, v))
        gk, gv = (torch.cat([x[s] for s in shards])[layout.kv_index] for x in (kk, vv))
        if keep:
            attn._keeping = True
            with torch.no_grad():
                first = attn._kept_attention(qr, gk, gv, layout, lambda: attn._prefix_plan(qr, gk, layout))
            before = attention.SDPAttention.kept_calls
            out = attn._kept_attention(qr, gk, gv, layout, lambda: pytest.fail("the recompute ran the kernels"))
            assert torch.equal(out.detach(), first) and not attn._kept
            attn._keeping = False
            assert attention.SDPAttention.kept_calls == before
            assert any(isinstance(r, attention._CudnnPrefixRun) for r in attention._prefix_cache["runs"])
        else:
            out = attn._prefix_attn(qr, gk, gv, layout)
        (out.float() * g[shards[1]].float()).sum().backward()
        grads.append((out.detach(), qr.grad, kk.grad, vv.grad))
    errors = [float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(*grads)]
    print(f"kept vs plain: relative difference of out, dq, dk, dv {errors}")
    assert errors[0] == 0 and max(errors) < 1e-3, errors


def _torchrun(tmp_path, *flags: str) -> dict:
    out = tmp_path / f"{'_'.join(f.strip('-') for f in flags)}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           os.path.join(ROOT, "tests", "dist_check.py"), *flags, "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = run_group(cmd, cwd=ROOT, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.two_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_tp2_sequence_parallel_cp2_ep2_and_fsdp2(tmp_path):
    """TP=2 with sequence parallelism, CP=2, Qwen3-MoE with EP=2 (alltoall dispatcher over NCCL) and FSDP2 over two GPUs
    each give finite, nonzero gradients and weights every rank agrees on (bf16: parity with one GPU is to rounding,
    which the fp32 CPU tests check exactly)."""
    for flags in (("--tp", "2", "--sp"), ("--cp", "2"), ("--moe", "--ep", "2", "--failed", "4"), ("--backend", "fsdp")):
        run = _torchrun(tmp_path, *flags)
        assert run["grad_norm"] > 0 and run["grad_norm"] == run["grad_norm"], flags


@pytest.mark.two_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_pp2_cp2_ep2_on_two_gpus_equal_one_gpu_on_the_same_batch(tmp_path):
    """PP=2 (1F1B), CP=2 and Qwen3-MoE with EP=2 over two GPUs against one GPU on the same batch: the log-probs
    before and after the step, the loss and the gradient norm agree within bf16 tolerance (the fp32 CPU twins in
    tests/test_megatron.py check them exactly)."""
    from helpers import run_dist_check

    dense = ("--layers", "4")
    moe = ("--layers", "4", "--moe", "--failed", "4")
    one = {dense: run_dist_check(tmp_path, 1, 1, *dense), moe: run_dist_check(tmp_path, 1, 1, *moe)}
    for name, ref, run in (("PP=2", dense, run_dist_check(tmp_path, 2, 1, *dense, "--pp", "2")),
                           ("CP=2", dense, run_dist_check(tmp_path, 2, 1, *dense, cp=2)),
                           ("EP=2", moe, run_dist_check(tmp_path, 2, 1, *moe, ep=2))):
        base = one[ref]
        diffs = {k: (torch.tensor(run[k]) - torch.tensor(base[k])).abs() for k in ("logprobs", "logprobs_after")}
        print(f"{name}: log-prob mean |diff| before {diffs['logprobs'].mean():.2e}, after "
              f"{diffs['logprobs_after'].mean():.2e}; grad norm {run['grad_norm']:.5f} vs one GPU "
              f"{base['grad_norm']:.5f}; loss {run['loss']:.6f} vs {base['loss']:.6f}")
        assert diffs["logprobs"].mean() < 2e-2 and diffs["logprobs_after"].mean() < 2e-2, name
        assert run["grad_norm"] == pytest.approx(base["grad_norm"], rel=5e-2), name
        assert run["loss"] == pytest.approx(base["loss"], rel=5e-2, abs=1e-3), name
