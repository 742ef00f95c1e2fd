"""The Megatron trainer and the engine on real GPUs: bf16 parity with Hugging Face on SmolLM2-135M's real
weights, a GRPO step that changes the colocated engine after `sync`, save/load, DP=2 and TP=2 on two GPUs.

Run on a GPU machine: `python -m pytest tests/gpu -q` (skipped without CUDA; never in CI).
"""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from slime_env.trainers.batch import pack  # noqa: E402
from slime_env.trainers.torch_trainer import TorchTrainer, TrainerConfig  # noqa: E402


@pytest.fixture(scope="module")
def smollm2():
    from slime_env.agents import load_default_model

    model, tok = load_default_model("cpu", torch.float32)
    return model, tok


def real_batch(tok, n=8):
    """Chat-formatted SmolLM2 sequences (real text, real template), responses masked in."""
    from slime_env import Task
    from slime_env.ledger import Span
    from slime_env.trajectory import Trajectory

    out = []
    for i in range(n):
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": f"What is {i} + {i + 3}?"}],
                                                    add_generation_prompt=True, tokenize=False))
        response = tok.encode(f"{i} + {i + 3} = {2 * i + 3}. The answer is {2 * i + 3}.<|im_end|>")
        out.append(Trajectory(task=Task(prompt="p"), prompt_ids=list(prompt), response_ids=response,
                              loss_mask=[1] * len(response), rollout_logprobs=[0.0] * len(response),
                              spans=[Span(0, "generated", 0, len(response))], turn_rewards=[float(i % 2)],
                              reward=float(i % 2), status="completed"))
    return out


def test_bf16_logprobs_match_hf_on_smollm2_real_weights(smollm2):
    from slime_env.trainers.megatron_trainer import MegatronTrainer

    model, tok = smollm2
    trajs = real_batch(tok)
    batch = pack(trajs, group_size=4, pad_id=tok.pad_token_id)
    mask = batch.loss_mask.bool()
    torch.backends.cuda.matmul.allow_tf32 = False
    gpu32 = copy.deepcopy(model).to("cuda")
    hf = TorchTrainer(gpu32, TrainerConfig(micro_batch_size=8), pad_id=tok.pad_token_id)
    with torch.no_grad():
        ref32 = hf.logprobs(gpu32, batch)[mask].cpu()
        ref16 = hf.logprobs(gpu32.to(torch.bfloat16), batch)[mask].cpu()
    del gpu32, hf
    fp32 = MegatronTrainer(model, TrainerConfig(backend="megatron", dtype="float32"), pad_id=tok.pad_token_id)
    with torch.no_grad():
        ours32 = fp32.logprobs(fp32.model, batch)[mask].cpu()
    del fp32
    bf16 = MegatronTrainer(model, TrainerConfig(backend="megatron", dtype="bfloat16"), pad_id=tok.pad_token_id)
    with torch.no_grad():
        ours16 = bf16.logprobs(bf16.model, batch)[mask].cpu()
    fp32_err = (ours32 - ref32).abs().max().item()
    bf16_err, hf_bf16_err = (ours16 - ref32).abs().mean().item(), (ref16 - ref32).abs().mean().item()
    print(f"fp32 max |diff| {fp32_err:.2e}; bf16 mean |diff| to fp32: megatron {bf16_err:.4f}, HF {hf_bf16_err:.4f}")
    assert fp32_err < 1e-4
    assert bf16_err < max(2 * hf_bf16_err, 0.02)  # bf16 error of the same order as HF's own bf16 run


def test_grpo_step_changes_the_colocated_engine_after_sync(smollm2, tmp_path):
    from slime_env.agents import TransformersPolicy
    from slime_env.trainers.megatron_trainer import MegatronTrainer

    model, tok = smollm2
    engine_model = type(model)(model.config).to("cuda", torch.bfloat16).eval()
    engine_model.load_state_dict(model.state_dict())
    engine = TransformersPolicy(engine_model, tok, max_batch_size=8)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                                add_generation_prompt=True, tokenize=False))
    greedy = {"temperature": 0.0, "max_new_tokens": 12}

    async def generate():
        return await engine.generate(prompt, greedy)

    before = asyncio.run(generate())
    trainer = MegatronTrainer(model, TrainerConfig(backend="megatron", lr=3e-4), pad_id=tok.pad_token_id)
    trajs = real_batch(tok, 8)
    metrics = trainer.step(trajs, group_size=4)
    assert metrics["train/grad_norm"] > 0
    asyncio.run(trainer.sync(engine, version="1"))
    after = asyncio.run(generate())
    assert engine.weight_version == "1"
    hf = trainer.hf_state_dict()
    assert torch.equal(engine_model.model.norm.weight, hf["model.norm.weight"].to(torch.bfloat16))
    assert before.logprobs != after.logprobs  # the engine now samples from the trained weights
    trainer.save(tmp_path / "ckpt")
    fresh = MegatronTrainer(model, TrainerConfig(backend="megatron", lr=3e-4), pad_id=tok.pad_token_id)
    fresh.load(tmp_path / "ckpt")
    batch = pack(trajs, group_size=4, pad_id=tok.pad_token_id)
    with torch.no_grad():
        assert torch.equal(fresh.logprobs(fresh.model, batch), trainer.logprobs(trainer.model, batch))
    assert fresh.step_count == 1
    engine.close()


@pytest.mark.two_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_dp2_equals_one_gpu_and_tp2_logprobs_match(tmp_path):
    from test_megatron import run_dist_check

    one, dp2, tp2 = (run_dist_check(tmp_path, n, tp) for n, tp in ((1, 1), (2, 1), (2, 2)))
    assert dp2["parallel"]["dp"] == 2 and tp2["parallel"]["tp"] == 2
    # DP: the same parameters on both ranks after the step; the gradient norm of the global batch
    assert dp2["param_sums"][0] == dp2["param_sums"][1]
    assert dp2["grad_norm"] == pytest.approx(one["grad_norm"], rel=2e-2)
    assert dp2["loss"] == pytest.approx(one["loss"], rel=2e-2, abs=1e-3)
    # TP: the packed log-probs equal the one-GPU model's (bf16: reductions split across ranks)
    a, b = torch.tensor(tp2["logprobs"]), torch.tensor(one["logprobs"])
    print(f"TP=2 log-prob mean |diff| {(a - b).abs().mean():.2e}, max {(a - b).abs().max():.2e}; "
          f"grad norm DP=2 {dp2['grad_norm']:.5f} vs one GPU {one['grad_norm']:.5f}")
    assert (a - b).abs().mean() < 2e-2
    assert tp2["grad_norm"] == pytest.approx(one["grad_norm"], rel=5e-2)


def test_cuda_ipc_weights_reach_another_process(tmp_path):
    """`update_weights_from_tensor`'s payload: a CUDA tensor crosses to another process as an IPC handle."""
    import os
    import subprocess
    import sys

    from slime_env.agents.weight_transfer import serialize_named_tensors

    weight = torch.randn(4096, device="cuda")
    (tmp_path / "payload").write_text(serialize_named_tensors([("w", weight)]))
    code = ("import sys; from slime_env.agents.weight_transfer import deserialize_named_tensors as d; "
            "[(n, x)] = d(open(sys.argv[1]).read()); print(n, x.device.type, float(x.double().sum()))")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "payload")], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    name, device, total = out.stdout.split()[-3:]
    assert (name, device) == ("w", "cuda") and float(total) == pytest.approx(float(weight.double().sum()), rel=1e-9)


@pytest.mark.two_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_ipc_weights_reach_an_engine_that_sees_the_senders_gpu_under_another_index(tmp_path):
    """A colocated trainer rank on GPU 1 pushes to the engine on its GPU, whose process sees that GPU alone, as
    cuda:0 (CUDA_VISIBLE_DEVICES): the payload names the GPU by UUID, so the tensor arrives on the same GPU."""
    import os
    import subprocess
    import sys

    from slime_env.agents.weight_transfer import serialize_named_tensors

    weight = torch.randn(4096, device="cuda:1")
    (tmp_path / "payload").write_text(serialize_named_tensors([("w", weight)]))
    code = ("import sys, torch; from slime_env.agents.weight_transfer import deserialize_named_tensors as d; "
            "[(n, x)] = d(open(sys.argv[1]).read()); "
            "print(n, x.device, torch.cuda.get_device_properties(x.device).uuid, float(x.double().sum()))")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(torch.cuda.device_count())))).split(",")
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "CUDA_VISIBLE_DEVICES": visible[1]}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "payload")], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    name, device, uuid, total = out.stdout.split()[-4:]
    assert (name, device, uuid) == ("w", "cuda:0", str(torch.cuda.get_device_properties(1).uuid))
    assert float(total) == pytest.approx(float(weight.double().sum()), rel=1e-9)


def test_megatron_ppo_learns_values_on_cuda():
    from slime_env.trainers.megatron_trainer import MegatronTrainer

    from helpers import tiny, trajectories

    trainer = MegatronTrainer(tiny("qwen2"), TrainerConfig(backend="megatron", estimator="ppo", lr=3e-4,
                                                           critic_lr=3e-3, value_clip=None), pad_id=0)
    trajs = trajectories(8, seed=4)
    first = trainer.step(trajs, group_size=4)
    for _ in range(9):
        last = trainer.step(trajs, group_size=4)
    assert last["train/value_loss"] < 0.5 * first["train/value_loss"]
    assert last["train/critic_grad_norm"] > 0 and last["train/grad_norm"] > 0


def test_offload_frees_gpu_memory_between_steps_and_changes_nothing():
    from slime_env.trainers.megatron_trainer import MegatronTrainer

    from helpers import tiny, trajectories

    trajs = trajectories(8, seed=4)
    results = {}
    for offload in (False, True):
        trainer = MegatronTrainer(tiny("qwen2", seed=1), TrainerConfig(backend="megatron", lr=3e-4, offload=offload),
                                  pad_id=0)
        trainer.step(trajs, group_size=4)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        trainer.offload()  # a no-op when the step already offloaded
        results[offload] = (held, torch.cuda.memory_allocated(), trainer.step(trajs, group_size=4),
                            {k: v.float().cpu() for k, v in trainer.hf_state_dict().items()})
        del trainer
        torch.cuda.empty_cache()
    (held_on, _, m_on, w_on), (held_off, _, m_off, w_off) = results[False], results[True]
    assert held_off < held_on  # offloaded at the end of the step: less GPU memory held between steps
    assert m_off["train/grad_norm"] == pytest.approx(m_on["train/grad_norm"], rel=1e-6)
    assert all(torch.equal(w_on[k], w_off[k]) for k in w_on)  # same training, bit for bit


def _long_and_short():
    """Random weights at SmolLM2's shape, 4 layers (GQA: 9 query heads over 3 K/V heads), and five trajectories of
    9,000, 120, 300, 8,300 and 64 tokens (two cuDNN sequences and short ones between them under `auto`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from slime_env import Task
    from slime_env.ledger import Span
    from slime_env.trajectory import Trajectory

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                                         num_key_value_heads=3, num_hidden_layers=4, vocab_size=49152,
                                         max_position_embeddings=16384, tie_word_embeddings=True))
    g = torch.Generator().manual_seed(0)
    trajs = []
    for i, n in enumerate((9000, 120, 300, 8300, 64)):
        ids = torch.randint(100, 40000, (n,), generator=g).tolist()
        prompt, response = ids[: n // 4], ids[n // 4:]
        trajs.append(Trajectory(task=Task(prompt="p"), prompt_ids=prompt, response_ids=response,
                                loss_mask=[1] * len(response), rollout_logprobs=[-1.0] * len(response),
                                spans=[Span(0, "generated", 0, len(response))], turn_rewards=[float(i % 2)],
                                reward=float(i % 2), status="completed"))
    return model, trajs


def test_cudnn_and_flash_attention_kernels_agree_on_a_packed_batch_of_long_and_short_sequences():
    """`attention_kernel`: cuDNN (each sequence alone), flash (varlen over the pack) and auto (cuDNN for the two
    sequences of >= 8k tokens, one varlen run for each stretch of short ones) give the same log-probs and gradient
    norm up to bf16 rounding; random weights at SmolLM2's shape, 4 layers (GQA: 9 query heads over 3 K/V heads)."""
    from slime_env.trainers.megatron import attention
    from slime_env.trainers.megatron_trainer import MegatronTrainer

    model, trajs = _long_and_short()
    results = {}
    for kernel in ("flash", "cudnn", "auto"):
        attention._runs_cache.clear()
        trainer = MegatronTrainer(model, TrainerConfig(backend="megatron", dtype="bfloat16", attention_kernel=kernel,
                                                       max_tokens_per_micro_batch=20000, lr=1e-6), pad_id=0)
        batch = pack(trajs, group_size=5, pad_id=0)
        with torch.no_grad():
            lp = trainer.logprobs(trainer.model, batch)[batch.loss_mask.bool()].float().cpu()
        runs = [(b - a, c is None) for a, b, c, _ in attention._runs_cache.get("runs", [])]
        results[kernel] = (lp, trainer.step(trajs, group_size=5)["train/grad_norm"], runs)
        del trainer
        torch.cuda.empty_cache()
    lp_flash, norm_flash, runs_flash = results["flash"]
    print({k: v[2] for k, v in results.items()})
    assert not runs_flash  # flash never splits the pack
    auto_runs = results["auto"][2]  # 9000 and 8300 alone, the short ones in runs between them
    assert sorted(n for n, alone in auto_runs if alone)[0] >= 8300 and sum(alone for _, alone in auto_runs) == 2
    assert 0 < sum(n for n, alone in auto_runs if not alone) < 1000
    assert all(alone for _, alone in results["cudnn"][2])
    for kernel in ("cudnn", "auto"):
        lp, norm, _ = results[kernel]
        diff = (lp - lp_flash).abs()
        print(f"{kernel} vs flash: log-prob mean |diff| {diff.mean():.4f}, max {diff.max():.3f}; "
              f"grad norm {norm:.4f} vs {norm_flash:.4f}")
        assert diff.mean() < 0.02
        assert norm_flash > 0 and norm == pytest.approx(norm_flash, rel=0.05)


def test_kept_attention_outputs_give_the_full_recompute_step():
    """`recompute_attention: false`: under full recompute each layer's attention output and log-sum-exp are kept
    from the forward (cuDNN for the two long sequences, varlen flash for the short ones) and the backward runs the
    kernels' own backward on them; the step equals plain full recompute up to bf16 rounding, and the recompute took
    every layer's kept output instead of running the kernel again."""
    from slime_env.trainers.megatron.attention import SDPAttention
    from slime_env.trainers.megatron_trainer import MegatronTrainer

    model, trajs = _long_and_short()
    results = {}
    for keep in (False, True):
        torch.manual_seed(1)
        trainer = MegatronTrainer(model, TrainerConfig(backend="megatron", dtype="bfloat16", recompute="full",
                                                       recompute_attention=not keep, max_tokens_per_micro_batch=20000,
                                                       lr=1e-4), pad_id=0)
        before = SDPAttention.kept_calls
        metrics = trainer.step(trajs, group_size=5)
        results[keep] = (metrics, trainer.weights(), SDPAttention.kept_calls - before)
        del trainer
        torch.cuda.empty_cache()
    (m0, w0, k0), (m1, w1, k1) = results[False], results[True]
    print(f"grad norm {m1['train/grad_norm']:.6f} kept vs {m0['train/grad_norm']:.6f}; loss {m1['train/loss']:.6f} "
          f"vs {m0['train/loss']:.6f}; kept outputs {k1}")
    assert k0 == 0 and k1 == 4  # one micro-batch, four layers
    assert m0["train/grad_norm"] > 0 and m1["train/grad_norm"] == pytest.approx(m0["train/grad_norm"], rel=1e-2)
    assert m1["train/loss"] == pytest.approx(m0["train/loss"], rel=1e-3, abs=1e-4)
    moved = sum(float((w1[k].float() - w0[k].float()).abs().max()) for k in w0)
    assert moved < 1e-2, moved
