"""The pipeline on one GPU (run on the GPU machine): `slime-env train` with a `serve-engine` on the trainer's GPU,
weights by CUDA IPC (`weight_sync: auto` picks `tensor` there: NCCL refuses two ranks on one GPU; the NCCL path
needs a second GPU and runs in the two-GPU issue). The model is a small random Llama in SmolLM2's vocabulary, saved
to a folder both roles load."""

from __future__ import annotations

import asyncio
import hashlib
import os

import pytest
import torch

from trainers.train_loop import TrainConfig, train


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = os.environ.get("SLIME_ENV_GPU_TOKENIZER")
    if folder:
        tok = AutoTokenizer.from_pretrained(folder)
    else:
        from slime_env.offline_tokenizers import smollm2

        tok = smollm2()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("model")
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_train_with_a_serve_engine_on_the_same_gpu_syncs_by_cuda_ipc(tmp_path, model_folder):
    seen = []

    async def check(step, engines, trainer):
        assert type(engines.channel()).__name__ == "FromTensor"
        engine = engines.pool.up()[0]
        got = await engine.get_weights_checksum()
        assert got["weight_version"] == str(step)
        for name, t in trainer.weights().items():  # the engine runs in bf16: the trainer's weights cast to it
            if name in got["checksums"]:
                want = hashlib.sha256(t.detach().to(torch.bfloat16).float().contiguous().cpu().numpy()
                                      .tobytes()).hexdigest()
                assert got["checksums"][name] == want, name
        seen.append(step)

    cfg = TrainConfig.from_dict({
        "run_dir": str(tmp_path / "run"), "model": model_folder, "env": "ArithmeticRetry-v0",
        "env_kwargs": {"digits": [2, 1], "ops": "+-", "max_attempts": 2}, "max_turns": 2,
        "train_data": {"generator": "envs.math.retry_env:arithmetic_tasks", "digits": [2, 1], "ops": "+-",
                       "size": 64, "seed": 11, "split": "train"},
        "steps": 2, "prompts_per_step": 4, "n_samples_per_prompt": 4, "max_new_tokens": 16, "eval_every": 100,
        "max_concurrency": 16, "device": "cuda",
        "trainer": {"estimator": "grpo", "lr": 1e-3, "micro_batch_size": 16},
        "engine": {"kind": "serve", "count": 1, "device": "cuda", "dtype": "bfloat16"},
    })
    asyncio.run(train(cfg, on_step=check, log=lambda _: None))
    assert seen == [1, 2]
