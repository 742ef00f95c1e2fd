"""PPO with a value model (`estimator: ppo`): per-token rewards, GAE targets, the clipped value loss, and
`TorchTrainer` learning both the critic and the policy on a tiny model (CPU, seconds)."""

from __future__ import annotations

import pytest
import torch

from helpers import tiny, trajectories
from trainers import algorithms as alg
from trainers.batch import pack
from trainers.torch_trainer import TorchTrainer, TrainerConfig


def test_token_rewards_sit_on_each_turns_last_generated_token():
    mask = torch.tensor([[0, 1, 1, 0, 1, 1, 0], [0, 0, 1, 1, 1, 0, 0]], dtype=torch.float32)
    turns = torch.tensor([[0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0]])
    per_turn = alg.token_rewards(torch.tensor([[0.5, 1.0], [2.0, 0.0]]), turns, mask)
    assert per_turn.tolist() == [[0, 0, 0.5, 0, 0, 1.0, 0], [0, 0, 0, 0, 2.0, 0, 0]]
    outcome = alg.token_rewards(torch.tensor([[3.0], [2.0]]), turns, mask)
    assert outcome.tolist() == [[0, 0, 0, 0, 0, 3.0, 0], [0, 0, 0, 0, 2.0, 0, 0]]


def test_value_loss_clips_like_ppo_and_whiten_ignores_masked_entries():
    old, ret, mask = torch.tensor([[0.0, 0.0]]), torch.tensor([[1.0, 1.0]]), torch.tensor([[1.0, 0.0]])
    v = torch.tensor([[0.5, 9.0]], requires_grad=True)
    # clipped: V_old + clip(0.5, +-0.2) = 0.2 -> (0.2 - 1)^2 = 0.64 > (0.5 - 1)^2 = 0.25; masked entry ignored
    loss = alg.value_loss(v, old, ret, mask, clip=0.2)
    assert loss.item() == pytest.approx(0.5 * 0.64)
    loss.backward()
    assert v.grad.tolist() == [[0.0, 0.0]]  # the clipped branch carries no gradient to V
    assert alg.value_loss(v, old, ret, mask, clip=None).item() == pytest.approx(0.5 * 0.25)
    w = alg.whiten(torch.tensor([[1.0, 3.0, 100.0]]), torch.tensor([[1.0, 1.0, 0.0]]))
    assert w[0, :2].tolist() == pytest.approx([-1.0, 1.0], abs=1e-4) and w[0, 2] == 0


def test_pack_for_ppo_carries_token_rewards_and_no_outcome_advantages():
    batch = pack(trajectories(4), group_size=2, pad_id=0, estimator="ppo")
    assert torch.count_nonzero(batch.advantages) == 0
    for i in range(4):  # the outcome reward on the row's last generated token
        last = batch.loss_mask[i].nonzero()[-1].item()
        assert batch.token_rewards[i, last] == batch.rewards[i]
        assert batch.token_rewards[i].sum() == batch.rewards[i]


def test_ppo_learns_values_and_moves_the_policy_toward_rewarded_replies():
    model = tiny("qwen2")
    trajs = trajectories(8, seed=11)  # rewards alternate 0, 1
    trainer = TorchTrainer(model, TrainerConfig(estimator="ppo", lr=3e-4, critic_lr=3e-3, micro_batch_size=4,
                                                value_clip=None), pad_id=0)
    batch = pack(trajs, group_size=4, pad_id=0, estimator="ppo")
    mask = batch.loss_mask

    def mean_logp(rows):
        with torch.no_grad():
            lp = trainer.logprobs(model, batch)
        return float((lp[rows] * mask[rows]).sum() / mask[rows].sum())

    good, bad = batch.rewards > 0, batch.rewards == 0
    gap0 = mean_logp(good) - mean_logp(bad)
    first = trainer.step(trajs, group_size=4)
    for _ in range(14):
        last = trainer.step(trajs, group_size=4)
    assert first["train/value_loss"] > 0 and last["train/value_loss"] < 0.5 * first["train/value_loss"]
    assert last["train/critic_grad_norm"] > 0
    assert mean_logp(good) - mean_logp(bad) > gap0 + 0.1  # probability moved toward the rewarded replies


def test_ppo_config_errors_name_the_problem():
    with pytest.raises(ValueError, match="megatron backend does not have yet"):
        TrainerConfig(estimator="ppo", backend="megatron")
    with pytest.raises(ValueError, match=r"gamma \(1.5\)"):
        TrainerConfig(estimator="ppo", gamma=1.5)
