"""SFT and on-policy distillation on the Megatron trainer on a GPU (megatron's distributed optimizer: `sft_step` sets
and restores the learning rate of the torch optimizers inside it); the served teacher's scoring on the GPU engine.

Run on a GPU machine: `python -m pytest tests/gpu -q` (skipped without CUDA; never in CI).
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from slime_env.trainers.batch import pack  # noqa: E402
from slime_env.trainers.torch_trainer import TrainerConfig  # noqa: E402

from helpers import tiny, trajectories  # noqa: E402


def test_megatron_sft_steps_lower_the_nll_and_opd_pulls_toward_the_teacher():
    from slime_env.trainers.megatron_trainer import MegatronTrainer

    hf, teacher_hf = tiny("qwen2", seed=1), tiny("qwen2", seed=2)
    trainer = MegatronTrainer(copy.deepcopy(hf), TrainerConfig(backend="megatron", lr=1e-6), pad_id=0)
    lrs = [g["lr"] for g in trainer.backend.param_groups()]
    trajs = trajectories(16, seed=3)
    first = trainer.sft_step(trajs, lr=3e-3)
    losses = [trainer.sft_step(trajs, lr=3e-3)["sft/loss"] for _ in range(20)]
    assert losses[-1] < 0.7 * first["sft/loss"], (first, losses)
    assert [g["lr"] for g in trainer.backend.param_groups()] == lrs and trainer.step_count == 0

    student = MegatronTrainer(copy.deepcopy(hf), TrainerConfig(backend="megatron", lr=3e-3, opd_coef=1.0), pad_id=0)
    batch = pack(trajs, group_size=1, pad_id=0)
    with torch.no_grad():
        t_lp = torch.nn.functional.log_softmax(teacher_hf.cuda()(batch.input_ids.cuda(),
                                                                 attention_mask=batch.attention_mask.cuda(),
                                                                 position_ids=batch.position_ids.cuda()).logits.float(),
                                               -1)
        t_lp = t_lp[:, :-1].gather(-1, batch.input_ids.cuda()[:, 1:, None]).squeeze(-1).cpu()
    distilled = [replace(t, reward=1.0, metadata={"teacher_logprobs": t_lp[i, -len(t.response_ids):].tolist()})
                 for i, t in enumerate(trajs)]
    kls = [student.step(distilled, 1)["train/opd/reverse_kl"] for _ in range(15)]
    assert abs(kls[-1]) < 0.6 * abs(kls[0]), kls
