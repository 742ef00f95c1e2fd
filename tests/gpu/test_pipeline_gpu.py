"""The pipeline on one GPU (run on the GPU machine): `slime-env train` with a `serve-engine` on the trainer's GPU,
weights by CUDA IPC (`weight_sync: auto` picks `tensor` there: NCCL refuses two ranks on one GPU; the NCCL path
needs a second GPU and runs in the two-GPU issue). The model is a small random Llama in SmolLM2's vocabulary, saved
to a folder both roles load."""

from __future__ import annotations

import asyncio
import hashlib

import torch

from trainers.train_loop import TrainConfig, train


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
