"""Advantage estimators, losses, KL, importance weights and reductions against hand-computed values; a
masked token contributes nothing to the loss or the gradient."""

from __future__ import annotations

import math

import pytest
import torch

from slime_env.trainers import algorithms as alg

R = torch.tensor([1.0, 0.0, 0.0, 1.0])
S = 1 / math.sqrt(2)


def test_grpo_and_dr_grpo():
    assert torch.allclose(alg.grpo_advantages(R, 2), torch.tensor([S, -S, -S, S]), atol=1e-5)
    assert torch.allclose(alg.dr_grpo_advantages(R, 2), torch.tensor([0.5, -0.5, -0.5, 0.5]))
    same = alg.grpo_advantages(torch.tensor([1.0, 1.0, 0.0, 0.0]), 2)
    assert torch.allclose(same, torch.zeros(4))  # all-equal groups carry no signal
    with pytest.raises(ValueError, match="groups of 3"):
        alg.grpo_advantages(R, 3)


def test_reinforce_plus_plus():
    # centred [0.5, -0.5, -0.5, 0.5], batch std 0.5 -> +-1
    assert torch.allclose(alg.reinforce_plus_plus_advantages(R), torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    r = torch.tensor([1.0, 0.0, 3.0, 3.0])  # baseline: group means 0.5 and 3 -> [0.5, -0.5, 0, 0] / 0.3536
    expect = torch.tensor([0.5, -0.5, 0.0, 0.0]) / torch.tensor([0.5, -0.5, 0.0, 0.0]).std(unbiased=False)
    assert torch.allclose(alg.reinforce_plus_plus_advantages(r, 2), expect, atol=1e-5)


def test_token_returns_from_turn_rewards():
    turn_rewards = torch.tensor([[0.5, 0.0, 1.0]])
    turn_of = torch.tensor([[0, 0, 1, 2, 2]])
    mask = torch.tensor([[1, 0, 1, 1, 0]])
    assert torch.allclose(alg.token_returns(turn_rewards, turn_of, mask), torch.tensor([[1.5, 0.0, 1.0, 1.0, 0.0]]))


def test_gae():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.2, 0.5, 0.7]])
    mask = torch.ones(1, 3)
    adv, ret = alg.gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    assert torch.allclose(ret, torch.tensor([[1.0, 1.0, 1.0]]), atol=1e-6)  # lam=1: Monte-Carlo returns
    assert torch.allclose(adv, torch.tensor([[0.8, 0.5, 0.3]]), atol=1e-6)
    adv0, _ = alg.gae_advantages(rewards, values, mask, gamma=1.0, lam=0.0)  # lam=0: one-step TD errors
    assert torch.allclose(adv0, torch.tensor([[0.3, 0.2, 0.3]]), atol=1e-6)
    # a masked (env) token in the middle is skipped: the next value is the next generated token's
    gapped, _ = alg.gae_advantages(torch.tensor([[0.0, 9.0, 1.0]]), torch.tensor([[0.2, 9.0, 0.7]]),
                                   torch.tensor([[1.0, 0.0, 1.0]]), gamma=1.0, lam=1.0)
    assert torch.allclose(gapped, torch.tensor([[0.8, 0.0, 0.3]]), atol=1e-6)


def test_clipped_policy_loss_dapo_and_dual_clip():
    mask = torch.ones(1, 1)
    up = torch.tensor([[math.log(1.5)]])  # ratio 1.5
    loss, stats = alg.policy_loss(up, torch.zeros(1, 1), torch.tensor([2.0]), mask)
    assert loss.item() == pytest.approx(-2.0 * 1.28)  # clipped at 1 + clip_high
    assert stats["clip_frac"].item() == 1.0
    down = torch.tensor([[math.log(0.5)]])
    loss, _ = alg.policy_loss(down, torch.zeros(1, 1), torch.tensor([-2.0]), mask)
    assert loss.item() == pytest.approx(2.0 * 0.8)  # pessimistic: clipped at 1 - clip_low
    big = torch.tensor([[math.log(5.0)]])
    loss, _ = alg.policy_loss(big, torch.zeros(1, 1), torch.tensor([-1.0]), mask)
    assert loss.item() == pytest.approx(5.0)
    loss, _ = alg.policy_loss(big, torch.zeros(1, 1), torch.tensor([-1.0]), mask, dual_clip=3.0)
    assert loss.item() == pytest.approx(3.0)


def test_gspo_uses_the_sequence_ratio():
    logp = torch.tensor([[math.log(2.0), 0.0, 0.0]])  # token ratios 2, 1, 1; sequence ratio 2^(1/3)
    loss, stats = alg.policy_loss(logp, torch.zeros(1, 3), torch.tensor([1.0]), torch.ones(1, 3),
                                  ratio_level="sequence", clip_high=10.0)
    assert stats["ratio_mean"].item() == pytest.approx(2 ** (1 / 3), rel=1e-5)
    assert loss.item() == pytest.approx(-(2 ** (1 / 3)), rel=1e-5)


def test_kl_estimators_and_tis():
    logp, ref = torch.tensor([math.log(2.0)]), torch.tensor([0.0])
    assert alg.kl_divergence(logp, ref, "k1").item() == pytest.approx(math.log(2))
    assert alg.kl_divergence(logp, ref, "k2").item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert alg.kl_divergence(logp, ref, "k3").item() == pytest.approx(0.5 - 1 + math.log(2))
    assert alg.kl_divergence(torch.tensor([30.0]), torch.tensor([0.0]), "low_var_kl").item() == 10.0
    w = alg.truncated_is_weights(torch.tensor([[math.log(3.0), 0.0, 0.0]]), torch.zeros(1, 3),
                                 torch.tensor([[1.0, 1.0, 0.0]]))
    assert torch.allclose(w, torch.tensor([[2.0, 1.0, 0.0]]))  # capped at 2, zero where masked


def test_reductions():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert alg.masked_mean(x, m).item() == pytest.approx(10 / 4)
    assert alg.seq_mean_token_sum(x, m).item() == pytest.approx((6 + 4) / 2)
    assert alg.seq_mean_token_mean(x, m).item() == pytest.approx((2 + 4) / 2)


@pytest.mark.parametrize("reduction", sorted(alg.REDUCTIONS))
@pytest.mark.parametrize("kind", ["token", "sequence"])
def test_masked_tokens_change_neither_loss_nor_gradient(reduction, kind):
    torch.manual_seed(0)
    tokens = torch.randint(0, 11, (2, 6))
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [1, 1, 0, 0, 0, 0]], dtype=torch.float32)
    adv = torch.tensor([0.7, -1.3])
    rollout = torch.randn(2, 6) * 0.1 - 2.0

    def loss_of(logits):
        logp = alg.token_logprobs(logits, tokens)
        old = logp.detach() + 0.05 * torch.randn(2, 6, generator=torch.Generator().manual_seed(1))
        pg, _ = alg.policy_loss(logp, old, adv, mask, ratio_level=kind, reduction=reduction,
                                is_weights=alg.truncated_is_weights(old, rollout, mask))
        kl = alg.REDUCTIONS[reduction](alg.kl_divergence(logp, rollout, "low_var_kl"), mask)
        ent = alg.REDUCTIONS[reduction](alg.entropy_from_logits(logits), mask)
        return pg + 0.1 * kl - 0.01 * ent

    logits = torch.randn(2, 6, 11, requires_grad=True)
    loss = loss_of(logits)
    loss.backward()
    grad = logits.grad.clone()
    assert torch.all(grad[mask == 0] == 0) and torch.any(grad[mask == 1] != 0)
    changed = logits.detach().clone()
    changed[mask == 0] += 5.0 * torch.randn_like(changed[mask == 0])
    changed.requires_grad_(True)
    loss2 = loss_of(changed)
    loss2.backward()
    assert loss2.item() == pytest.approx(loss.item(), abs=1e-6)
    assert torch.allclose(changed.grad[mask == 1], grad[mask == 1], atol=1e-6)


def test_role_baselines_follow_each_game_and_role_separately():
    from slime_env.trainers.algorithms import RoleBaselines

    rae = RoleBaselines(decay=0.5)
    adv = rae.advantages(torch.tensor([1.0, -1.0, 1.0, 0.0]),
                         [("ttt", "x"), ("ttt", "o"), ("ttt", "x"), None])
    # x: b = 0.5 * 0 + 0.5 * 1 = 0.5 -> A = 0.5; then b = 0.5 * 0.5 + 0.5 * 1 = 0.75 -> A = 0.25
    assert adv.tolist() == [0.5, -0.5, 0.25, 0.0]
    assert rae.values == {"ttt/x": 0.75, "ttt/o": -0.5}
    copy = RoleBaselines()
    copy.load_state_dict(rae.state_dict())
    assert copy.values == rae.values and copy.decay == 0.5


def test_rae_in_pack_is_keyed_by_env_and_role(smollm2_tok):
    from slime_env import ScriptedPolicy, get_renderer, run_multi_agent_episode
    from slime_env.envs.games import TicTacToeEnv
    from slime_env.trainers.algorithms import RoleBaselines
    from slime_env.trainers.batch import pack
    import asyncio

    trajs = asyncio.run(run_multi_agent_episode(TicTacToeEnv(), ScriptedPolicy(smollm2_tok, ["<move>5</move>"]),
                                                "play", renderer=get_renderer(smollm2_tok)))
    rae = RoleBaselines(decay=0.0)  # baseline = the last reward: every advantage is 0 on the first sight
    batch = pack([trajs["x"], trajs["o"]], group_size=1, pad_id=0, estimator="rae", role_baselines=rae)
    assert set(rae.values) == {"/x", "/o"} and batch.advantages.abs().sum() == 0
    with pytest.raises(ValueError, match="needs role_baselines"):
        pack([trajs["x"]], group_size=1, pad_id=0, estimator="rae")


def test_token_logprobs_and_entropy_equal_a_whole_log_softmax_slice_by_slice(monkeypatch):
    """token_logprobs (logit - logsumexp, a slice of positions at a time, its own backward) and the graph-free entropy
    give what a whole log_softmax gives, on strided logits (logits[:, :-1], as the trainer passes them) cut into
    several slices, in float32 and bfloat16."""
    monkeypatch.setitem(alg.SLICE_ELEMENTS, "cpu", 3 * 97)  # three positions per slice: 7 positions, 3 slices a row
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        full = (torch.randn(2, 8, 97) * 3).to(dtype).requires_grad_()
        logits, tokens, weights = full[:, :-1], torch.randint(0, 97, (2, 7)), torch.randn(2, 7)
        want = torch.gather(torch.log_softmax(logits.float(), -1), -1, tokens.unsqueeze(-1)).squeeze(-1)
        (want_grad,) = torch.autograd.grad((want * weights).sum(), full)
        got = alg.token_logprobs(logits, tokens)
        (got_grad,) = torch.autograd.grad((got * weights).sum(), full)
        assert got.dtype == torch.float32 and got_grad.dtype == dtype
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(got_grad.float(), want_grad.float(), rtol=0, atol=1e-5 if dtype == torch.float32
                                   else 2e-2)
        with torch.no_grad():
            logp = torch.log_softmax(logits.float(), -1)
            torch.testing.assert_close(alg.entropy_from_logits(logits), -(logp.exp() * logp).sum(-1))


def test_micro_batches_stop_at_the_token_budget_and_the_step_is_the_same():
    """padded_slices: at most `rows` rows and at most `budget` padded tokens (rows x the longest), a longer row alone;
    the torch trainer's step over those micro-batches equals the step over one micro-batch of every row."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    from helpers import trajectories
    from slime_env.trainers.distributed import padded_slices
    from slime_env.trainers.torch_trainer import TorchTrainer, TrainerConfig

    assert padded_slices([10, 50, 10, 10], 0, 4, 8, 100) == [slice(0, 2), slice(2, 4)]
    assert padded_slices([200, 10, 10], 0, 3, 8, 100) == [slice(0, 1), slice(1, 3)]
    assert padded_slices([5, 5, 300, 5], 0, 4, 8, 100) == [slice(0, 2), slice(2, 3), slice(3, 4)]
    assert padded_slices([10] * 5, 0, 5, 2, 1000) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    trajs = trajectories(8, seed=3, vocab=96)
    runs = {}
    for budget in (1 << 20, 40):
        trainer = TorchTrainer(copy.deepcopy(model), TrainerConfig(lr=1e-3, micro_batch_size=8,
                                                                   max_tokens_per_micro_batch=budget), pad_id=0)
        calls = []
        slices = trainer.backend.micro_slices
        trainer.backend.micro_slices = lambda batch: calls.append(slices(batch)) or calls[-1]
        metrics = trainer.step(trajs, group_size=4)
        runs[budget] = (len(calls[-1]), metrics, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()})
    (one, whole, w_whole), (many, sliced, w_sliced) = runs[1 << 20], runs[40]
    assert one == 1 and many > 2
    assert sliced["train/loss"] == pytest.approx(whole["train/loss"], rel=1e-5, abs=1e-7)
    assert sliced["train/grad_norm"] == pytest.approx(whole["train/grad_norm"], rel=1e-5)
    assert max((w_whole[k] - w_sliced[k]).abs().max().item() for k in w_whole) < 1e-4  # Adam: lr 1e-3 x sign
