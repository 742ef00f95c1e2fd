"""PPO with a value model (`estimator: ppo`): per-token rewards, GAE targets, the clipped value loss, and
`TorchTrainer` learning both the critic and the policy on a tiny model (CPU, seconds)."""

from __future__ import annotations

import pytest
import torch
from helpers import SHAPE, tiny, trajectories
from slime_env.trainers import algorithms as alg
from slime_env.trainers.batch import pack
from slime_env.trainers.torch_trainer import TorchTrainer, TrainerConfig


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
    with pytest.raises(ValueError, match=r"gamma \(1.5\)"):
        TrainerConfig(estimator="ppo", gamma=1.5)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_megatron_critic_equals_the_torch_critic_and_learns(family):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from slime_env.trainers.megatron import init_parallel
    from slime_env.trainers.megatron_trainer import MegatronTrainer

    init_parallel(1)
    model = tiny(family)
    cfg = dict(estimator="ppo", lr=3e-4, critic_lr=3e-3, micro_batch_size=4, value_clip=None)
    torch_trainer = TorchTrainer(model, TrainerConfig(**cfg), pad_id=0)
    mega = MegatronTrainer(model, TrainerConfig(**cfg, backend="megatron", max_tokens_per_micro_batch=48), pad_id=0)
    head = torch.randn(1, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the same (non-zero) head on both critics
        torch_trainer.critic.head.weight.copy_(head)
        mega.critic.head.weight.copy_(head)
    trajs = trajectories(8, seed=4)
    batch = pack(trajs, group_size=4, pad_id=0, estimator="ppo")
    mask = batch.loss_mask.bool()
    with torch.no_grad():
        ours, ref = mega.values(batch), torch_trainer.values(batch)
    assert ref[mask].abs().max() > 0.1 and torch.allclose(ours[mask], ref[mask], atol=1e-4, rtol=1e-4)
    first = mega.step(trajs, group_size=4)
    for _ in range(9):
        last = mega.step(trajs, group_size=4)
    assert last["train/value_loss"] < 0.5 * first["train/value_loss"] and last["train/critic_grad_norm"] > 0


@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_ppo_checkpoints_resume_the_critic(backend, tmp_path):
    if backend == "megatron":
        pytest.importorskip("megatron.core", reason="megatron-core is not installed")
        from slime_env.trainers.megatron import init_parallel
        from slime_env.trainers.megatron_trainer import MegatronTrainer as Trainer

        init_parallel(1)
    else:
        Trainer = TorchTrainer
    cfg = TrainerConfig(estimator="ppo", backend=backend, lr=3e-4, critic_lr=3e-3, micro_batch_size=4)
    trainer = Trainer(tiny("llama"), cfg, pad_id=0)
    trajs = trajectories(8, seed=4)
    for _ in range(3):
        trainer.step(trajs, group_size=4)
    trainer.save(tmp_path / "ckpt")
    fresh = Trainer(tiny("llama"), cfg, pad_id=0)
    fresh.load(tmp_path / "ckpt")
    batch = pack(trajs, group_size=4, pad_id=0, estimator="ppo")
    with torch.no_grad():
        before, after = trainer.values(batch), fresh.values(batch)
    assert before.abs().max() > 0 and torch.equal(before, after)
    assert trainer.step(trajs, group_size=4)["train/value_loss"] == pytest.approx(
        fresh.step(trajs, group_size=4)["train/value_loss"], rel=1e-5)
