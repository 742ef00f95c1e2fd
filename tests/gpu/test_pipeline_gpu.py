"""The pipeline on GPUs (run on the GPU machine): `slime-env train` with a `serve-engine` on the trainer's GPU, weights
by CUDA IPC (`weight_sync: auto` picks `tensor` there: NCCL refuses two ranks on one GPU), and with the engine on a
second GPU (`engine.gpus: [1]`), weights broadcast over NCCL. The model is a small random Llama in SmolLM2's
vocabulary, saved to a folder both roles load."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
import torch
from slime_env.trainers.run import TrainConfig, train


def test_train_with_a_serve_engine_on_the_same_gpu_syncs_by_cuda_ipc(tmp_path, model_folder):
    seen = []

    async def check(step, engines, trainer):
        assert type(engines.channel()).__name__ == "FromTensor"
        engine = engines.pool.up()[0]
        got = await engine.get_weights_checksum()
        assert got["weight_version"] == str(step)
        assert checksums_equal(got, trainer.weights()) > 0
        seen.append(step)

    asyncio.run(train(config(tmp_path, model_folder, {"kind": "serve", "count": 1, "device": "cuda",
                                                      "dtype": "bfloat16"}), on_step=check, log=lambda _: None))
    assert seen == [1, 2]


def config(tmp_path, model_folder: str, engine: dict, **trainer) -> TrainConfig:
    return TrainConfig.from_dict({
        "run_dir": str(tmp_path / "run"), "model": model_folder, "env": "ArithmeticRetry-v0",
        "env_kwargs": {"digits": [2, 1], "ops": "+-", "max_attempts": 2}, "max_turns": 2,
        "train_data": {"generator": "slime_env.envs.math.retry_env:arithmetic_tasks", "digits": [2, 1], "ops": "+-",
                       "size": 64, "seed": 11, "split": "train"},
        "steps": 2, "prompts_per_step": 4, "n_samples_per_prompt": 4, "max_new_tokens": 16, "eval_every": 100,
        "max_concurrency": 16, "device": "cuda",
        "trainer": {"estimator": "grpo", "lr": 1e-3, "micro_batch_size": 16, **trainer},
        "engine": engine,
    })


def checksums_equal(got: dict, weights: dict) -> int:
    """How many of the trainer's parameters the engine reports, each equal to the trainer's cast to bf16."""
    n = 0
    for name, t in weights.items():  # the engine runs in bf16: the trainer's weights cast to it
        if name in got["checksums"]:
            want = hashlib.sha256(t.detach().to(torch.bfloat16).float().contiguous().cpu().numpy()
                                  .tobytes()).hexdigest()
            assert got["checksums"][name] == want, name
            n += 1
    return n


@pytest.mark.two_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_engine_on_the_second_gpu_gets_weights_by_nccl_and_generates_the_trainers_greedy_policy(tmp_path,
                                                                                              model_folder):
    """Trainer on GPU 0, its serve-engine on GPU 1 (`engine.gpus: [1]`): `weight_sync: auto` broadcasts over NCCL;
    after each step the engine's weights are the trainer's (checksums) and its greedy generation is the trainer's
    own policy's: every token the argmax of the trainer's model (its weights in bf16, teacher-forced on GPU 0) up
    to bf16 ties, and its log-probs that model's — closer than the weights before the step."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_folder)
    prompt = tok("What is 47 + 8? Answer:").input_ids
    before = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.bfloat16).to("cuda:0").eval()
    seen = []

    def teacher_forced(model, ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids], device="cuda:0")).logits[0, len(prompt) - 1:-1]
        return logits.float().log_softmax(-1)

    async def check(step, engines, trainer):
        channel = engines.channel()
        assert type(channel).__name__ == "Distributed" and channel.backend == "nccl"
        engine = engines.pool.up()[0]
        got = await engine.get_weights_checksum()
        assert got["weight_version"] == str(step)
        assert checksums_equal(got, trainer.weights()) > 0
        gen = await engine.generate(prompt, {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True})
        assert gen.weight_version == str(step) and len(gen.token_ids) == 24
        policy = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.bfloat16)
        missing, unexpected = policy.load_state_dict({k: v.detach().to(torch.bfloat16) for k, v in
                                                      trainer.weights().items()}, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
        policy.tie_weights()
        policy = policy.to("cuda:0").eval()
        ids = list(gen.token_ids)
        lp = teacher_forced(policy, ids)
        chosen = lp[torch.arange(len(ids)), torch.tensor(ids)]
        gap = (lp.max(-1).values - chosen).cpu()
        engine_lp = torch.tensor(gen.logprobs)
        now = (engine_lp - chosen.cpu()).abs().mean().item()
        old = (engine_lp - teacher_forced(before, ids)[torch.arange(len(ids)), torch.tensor(ids)].cpu()).abs().mean()
        print(f"step {step}: greedy tokens argmax of the trainer's policy at {int((gap == 0).sum())}/{len(ids)} "
              f"positions exactly, largest gap {gap.max():.4f}; engine log-prob |diff| vs the trainer's "
              f"{now:.4f}, vs the weights before training {old:.4f}")
        assert gap.max() < 0.05
        assert now < 0.05 and now < old
        seen.append(step)

    # A random model earns no reward (zero advantages): the entropy bonus makes each step move the weights, by
    # enough that the engine's log-probs tell the weights before and after apart.
    cfg = config(tmp_path, model_folder, {"kind": "serve", "count": 1, "gpus": [1], "dtype": "bfloat16"},
                 lr=1e-2, entropy_coef=1.0)
    asyncio.run(train(cfg, on_step=check, log=lambda _: None))
    assert seen == [1, 2]
