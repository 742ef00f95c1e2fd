"""The split training step (`slime_env.trainers.split_step`) on `TorchTrainer`: `forward_backward` accumulates across
calls exactly, `forward` changes nothing, `optim_step` applies that call's Adam parameters and clears the gradients,
a checkpoint resumes with or without its optimizer, and bad input is refused naming the field."""

from __future__ import annotations

import pytest
import torch

from slime_env.trainers.split_step import AdamParams, Datum, SplitStepTrainer
from slime_env.trainers.torch_trainer import TorchTrainer, TrainerConfig

from helpers import tiny

LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]}


def trainer(lora: bool = True, micro_batch_size: int = 4) -> TorchTrainer:
    torch.manual_seed(3)  # the adapter's initial A matrices
    cfg = TrainerConfig(micro_batch_size=micro_batch_size, lora=dict(LORA) if lora else None)
    return TorchTrainer(tiny("llama"), cfg, pad_id=0)


def data(n: int = 4, seed: int = 0) -> list[Datum]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(1, 96, (6 + 3 * i,), generator=g)  # unequal lengths: right padding in one forward
        out.append(Datum(ids[:-1], ids[1:], {"weights": torch.rand(len(ids) - 1, generator=g)}))
    return out


def nll(logp, inputs):
    return -(inputs["weights"] * logp).sum()


def trained(t: TorchTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in t.model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("lora", [True, False])
def test_two_calls_on_halves_equal_one_call_on_the_batch(lora):
    batch, adam = data(), AdamParams(learning_rate=1e-2, weight_decay=0.1)
    one, two = trainer(lora), trainer(lora, micro_batch_size=1)  # micro-batching must not change the sum either
    assert isinstance(one, SplitStepTrainer)
    logps, total = one.forward_backward(batch, nll)
    _, a = two.forward_backward(batch[:2], nll)
    _, b = two.forward_backward(batch[2:], nll)
    assert total == pytest.approx(a + b, rel=1e-5)
    assert total == pytest.approx(sum(float(nll(lp, d.inputs)) for lp, d in zip(logps, batch)), rel=1e-5)
    before = trained(one)
    stats = [one.optim_step(adam), two.optim_step(adam)]
    assert stats[0]["grad_norm"] == pytest.approx(stats[1]["grad_norm"], rel=1e-4) and stats[0]["grad_norm"] > 0
    after_one, after_two = trained(one), trained(two)
    assert any(not torch.equal(before[k], after_one[k]) for k in before)
    for k in after_one:
        torch.testing.assert_close(after_one[k], after_two[k], rtol=1e-4, atol=1e-6)
    assert all(p.grad is None for p in one.model.parameters())  # cleared: the next call starts from zero
    assert one.step_count == 1


def test_forward_changes_nothing_and_matches_forward_backward():
    t, batch = trainer(), data(3)
    before = trained(t)
    logps = t.forward(batch)
    assert [len(lp) for lp in logps] == [len(d.tokens) for d in batch]
    assert all(p.grad is None for p in t.model.parameters())
    with_grad, _ = t.forward_backward(batch, nll)
    for a, b in zip(logps, with_grad):
        torch.testing.assert_close(a, b)
    assert all(torch.equal(before[k], v) for k, v in trained(t).items())


def test_optim_step_takes_each_calls_adam_parameters():
    batch = data(2)
    plain, clipped = trainer(), trainer()
    for t in (plain, clipped):
        t.forward_backward(batch, nll)
    start = trained(plain)
    norm = plain.optim_step(AdamParams(learning_rate=0.0, beta2=0.9))["grad_norm"]
    assert norm > 0 and all(torch.equal(start[k], v) for k, v in trained(plain).items())  # lr 0: nothing moves
    stats = clipped.optim_step(AdamParams(learning_rate=1e-3, beta2=0.9, grad_clip_norm=norm / 100))
    assert stats == {"grad_norm": pytest.approx(norm), "learning_rate": 1e-3}  # the norm before clipping
    # Adam's second moment after one step is (1 - beta2) g^2: clipped to 1/100 of the norm, 1e-4 of the plain one
    sq = [sum(float(s["exp_avg_sq"].sum()) for s in t.optimizer.state.values()) for t in (plain, clipped)]
    assert sq[1] == pytest.approx(sq[0] * 1e-4, rel=1e-3)
    group = clipped.optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"]) == (1e-3, (0.9, 0.9), 1e-12)


def test_checkpoint_resumes_with_or_without_its_optimizer(tmp_path):
    t, batch = trainer(), data(2)
    t.forward_backward(batch, nll)
    t.optim_step(AdamParams(learning_rate=1e-2))
    t.save(tmp_path / "ckpt")
    for optimizer in (True, False):
        other = trainer()
        other.load(tmp_path / "ckpt", optimizer=optimizer)
        for a, b in zip(t.forward(batch), other.forward(batch)):
            torch.testing.assert_close(a, b)
        assert other.step_count == (1 if optimizer else 0) and bool(other.optimizer.state) == optimizer


def test_bad_input_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"adam_params\.learning_rate must be a finite number >= 0, got -1"):
        AdamParams(learning_rate=-1)
    with pytest.raises(ValueError, match=r"adam_params\.beta2 must be in \[0, 1\), got 1.0"):
        AdamParams.parse({"beta2": 1.0})
    with pytest.raises(ValueError, match=r"adam_params\.momentum: unknown field"):
        AdamParams.parse({"momentum": 0.9})
    ids = torch.arange(1, 6)
    with pytest.raises(ValueError, match=r"Datum\.inputs\['weights'\] has shape \[3\]; tokens has 5"):
        Datum(ids, ids, {"weights": torch.ones(3)})
    with pytest.raises(ValueError, match=r"Datum\.targets has shape \[4\]"):
        Datum(ids, ids[:4])
    with pytest.raises(ValueError, match="data is empty"):
        trainer().forward_backward([], nll)
