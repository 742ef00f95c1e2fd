"""`slime-env serve-tinker` driven by the real `tinker` SDK: a training client's forward_backward / optim_step are
the `--backend` trainer's (torch, fsdp, megatron: same loss, same adapter as calling it directly), tinker-cookbook's
SFT loop (unchanged) lowers the loss, and bad input comes back as the SDK's errors, naming what was wrong."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

tinker = pytest.importorskip("tinker")
pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[1]
MODEL = "Qwen/Qwen3-8B"


@contextlib.contextmanager
def _serving(root, trainer: str = "torch"):
    """(service client, backend) of a server on `trainer` over a tiny random model."""
    from tinker_support import ServerThread

    from slime_env.trainers.tinker import TinkerBackend
    from slime_env.trainers.tinker.models import load_tokenizer, random_model

    os.environ.setdefault("TINKER_API_KEY", "tml-local")
    tok = load_tokenizer("qwen3")
    backend = TinkerBackend(MODEL, random_model(tok, hidden=32, layers=1), tok, root, trainer=trainer,
                            max_context_length=256)
    with ServerThread(backend) as url:
        yield tinker.ServiceClient(base_url=url), backend


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with _serving(tmp_path_factory.mktemp("ckpt")) as (service, backend):
        yield service, service.create_lora_training_client(base_model=MODEL, rank=4).result(), backend.tokenizer, \
            backend


def _datum(ids, **inputs):
    return tinker.Datum(model_input=tinker.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": ids[1:], **inputs})


def test_losses_forward_and_sampling_with_logprobs(served):
    service, trainer, tok, _ = served
    ids = tok.encode("The quick brown fox jumps over the lazy dog.")
    n = len(ids) - 1
    out = trainer.forward([_datum(ids, weights=[1.0] * n)], "cross_entropy").result()
    logprobs = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert logprobs.shape == (n,) and out.metrics["loss:sum"] == pytest.approx(-logprobs.sum(), rel=1e-4)
    rl = _datum(ids, logprobs=logprobs.tolist(), advantages=[0.5] * n)
    # on-policy (ratio 1, weights unchanged until optim_step): IS and PPO are -sum(A), CISPO and DRO -sum(logp * A)
    for loss, config, value in [("importance_sampling", None, -0.5 * n), ("ppo", None, -0.5 * n),
                                ("cispo", None, -0.5 * logprobs.sum()), ("dro", {"beta": 0.1}, -0.5 * logprobs.sum())]:
        res = trainer.forward_backward([rl], loss, loss_fn_config=config).result()
        assert res.metrics["loss:sum"] == pytest.approx(value, rel=1e-3), loss
    trainer.optim_step(tinker.AdamParams(learning_rate=1e-3)).result()
    sampler = trainer.save_weights_and_get_sampling_client("s0")
    res = sampler.sample(tinker.ModelInput.from_ints(ids[:6]), 2, tinker.SamplingParams(max_tokens=4, seed=1),
                         include_prompt_logprobs=True).result()
    assert len(res.sequences) == 2 and all(len(s.tokens) == len(s.logprobs) for s in res.sequences)
    assert res.prompt_logprobs[0] is None and len(res.prompt_logprobs) == 6


@pytest.mark.parametrize("trainer", ["torch", "fsdp", "megatron"])
def test_a_step_through_the_server_is_the_trainers_step(trainer, tmp_path):
    """The SDK -> server -> TrainingClient path against the `--backend` trainer's split step called directly
    (`TorchTrainer`, `FSDPTrainer` over one rank, `MegatronTrainer` TP=1 PP=1), from the same seed: two accumulating
    forward_backward calls (two losses), an optim_step with every Adam parameter set, and a second step give the same
    losses and gradient norm, and the sampler weights the server saves are the same adapter."""
    import copy

    from slime_env.agents.lora_adapter import LoRAAdapter
    from slime_env.trainers.split_step import AdamParams, Datum
    from slime_env.trainers.tinker.backend import ATTN, LORA_ALPHA, MLP
    from slime_env.trainers.tinker.losses import loss_for
    from slime_env.trainers.torch_trainer import TorchTrainer, TrainerConfig

    if trainer == "megatron":
        pytest.importorskip("megatron.core", reason="megatron-core is not installed")
        from slime_env.trainers.megatron_trainer import MegatronTrainer as Trainer
    elif trainer == "fsdp":
        from slime_env.trainers.fsdp_trainer import FSDPTrainer as Trainer
    else:
        Trainer = TorchTrainer
    with _serving(tmp_path, trainer) as (service, backend):
        tok = backend.tokenizer
        a, b = tok.encode("one step through the server"), tok.encode("and the same step, direct")
        wa = [1.0, 0.5] + [1.0] * (len(a) - 3)
        qb, adv = [-11.0] * (len(b) - 1), [0.5, -1.0] + [0.25] * (len(b) - 3)
        adam = {"learning_rate": 1e-2, "beta1": 0.8, "beta2": 0.9, "eps": 1e-8, "weight_decay": 0.1,
                "grad_clip_norm": 0.05}

        client = service.create_lora_training_client(base_model=MODEL, rank=4, seed=11).result()
        got = [client.forward_backward([_datum(a, weights=wa)], "cross_entropy").result().metrics["loss:sum"],
               client.forward_backward([_datum(b, logprobs=qb, advantages=adv)], "ppo").result().metrics["loss:sum"]]
        norm = client.optim_step(tinker.AdamParams(**adam)).result().metrics["grad_norm"]
        # a second step: Adam's first update is lr * g / |g| whatever the betas or the clipping, its second is not
        got.append(client.forward_backward([_datum(a, weights=wa)], "cross_entropy").result().metrics["loss:sum"])
        client.optim_step(tinker.AdamParams(**adam)).result()
        path = client.save_weights_for_sampler("same").result().path
        # the trainer's checkpoint (adapter, optimizer) comes back as a new client computing the same forward
        state = client.save_state("same").result().path
        restored = service.create_training_client_from_state_with_optimizer(state).result()
        assert restored.forward([_datum(a, weights=wa)], "cross_entropy").result().metrics["loss:sum"] == \
            pytest.approx(client.forward([_datum(a, weights=wa)], "cross_entropy").result().metrics["loss:sum"],
                          rel=1e-5)

        torch.manual_seed(11)
        lora = {"rank": 4, "alpha": LORA_ALPHA, "target_modules": list(ATTN + MLP)}
        direct = Trainer(copy.deepcopy(backend.base), TrainerConfig(backend=trainer, lora=lora), pad_id=backend.pad_id)
    initial = direct.adapter()

    def datum(ids, **inputs):
        t = torch.tensor(ids)
        return Datum(t[:-1], t[1:], {k: torch.tensor(v) for k, v in inputs.items()})

    want = [direct.forward_backward([datum(a, weights=wa)], loss_for("cross_entropy", {})[0])[1],
            direct.forward_backward([datum(b, logprobs=qb, advantages=adv)], loss_for("ppo", {})[0])[1]]
    want_norm = direct.optim_step(AdamParams(**adam))["grad_norm"]
    want.append(direct.forward_backward([datum(a, weights=wa)], loss_for("cross_entropy", {})[0])[1])
    direct.optim_step(AdamParams(**adam))
    assert got == pytest.approx(want, rel=1e-5) and norm == pytest.approx(want_norm, rel=1e-4)
    assert norm > adam["grad_clip_norm"]  # the clipping acted
    model_id, _, name = path.removeprefix("tinker://").split("/")
    served_adapter = LoRAAdapter.load(backend.root / model_id / "sampler_weights" / name).tensors
    expected = direct.adapter().tensors
    assert served_adapter.keys() == expected.keys()
    assert any(not torch.equal(initial.tensors[k], expected[k]) for k in expected)  # the step moved the adapter
    for k in expected:
        torch.testing.assert_close(served_adapter[k], expected[k], rtol=1e-4, atol=1e-6)


def test_unknown_backends_are_refused_by_name(tmp_path):
    """A backend that does not exist is refused (several ranks: tests/test_tinker_ranks.py)."""
    from slime_env.errors import InvalidInput
    from slime_env.trainers.tinker import TinkerBackend

    with pytest.raises(InvalidInput, match=r"--backend 'jax': one of \['torch', 'megatron', 'fsdp'\]"):
        TinkerBackend(MODEL, None, None, tmp_path, trainer="jax")


def test_sampler_weights_reach_the_engine_through_the_weight_channel(served):
    """Each saved sampler's adapter is pushed into an embedded engine (two engines here, three sets of weights: each
    reload pushes the right one): its prompt log-probs are the trainer's log-probs at save time."""
    import numpy as np

    service, trainer, tok, _ = served
    ids = tok.encode("weights for the sampler, pushed as an adapter")
    datum = _datum(ids, weights=[1.0] * (len(ids) - 1))
    paths, want = [], []
    for step in range(2):
        trainer.forward_backward([datum], "cross_entropy").result()
        trainer.optim_step(tinker.AdamParams(learning_rate=5e-2)).result()
        paths.append(trainer.save_weights_for_sampler(f"push{step}").result().path)
        want.append(trainer.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy())
    fresh = service.create_lora_training_client(base_model=MODEL, rank=2).result()  # B = 0: the base function
    base = fresh.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert not np.allclose(want[0], want[1], atol=1e-3) and not np.allclose(want[0], base, atol=1e-3)

    def prompt_logprobs(**where) -> np.ndarray:
        res = service.create_sampling_client(**where).sample(
            tinker.ModelInput.from_ints(ids), 1, tinker.SamplingParams(max_tokens=1), include_prompt_logprobs=True)
        return np.array(res.result().prompt_logprobs[1:])

    for where, expected in [({"model_path": paths[0]}, want[0]), ({"model_path": paths[1]}, want[1]),
                            ({"base_model": MODEL}, base), ({"model_path": paths[0]}, want[0])]:
        np.testing.assert_allclose(prompt_logprobs(**where), expected, atol=1e-4, err_msg=str(where))


def test_bad_input_is_refused_by_name(served):
    service, trainer, tok, _ = served
    ids = tok.encode("hello there, general kenobi")
    n = len(ids) - 1
    with pytest.raises(tinker.RequestFailedError, match="unknown loss_fn 'nope'"):
        trainer.forward_backward([_datum(ids, weights=[1.0] * n)], "nope").result()
    with pytest.raises(tinker.RequestFailedError, match=r"loss_fn_inputs\['weights'\] has shape \[3\]"):
        trainer.forward_backward([_datum(ids, weights=[1.0] * 3)], "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError, match="lacks 'advantages'"):
        trainer.forward_backward([_datum(ids, logprobs=[0.0] * n)], "ppo").result()
    with pytest.raises(tinker.RequestFailedError, match="'meta-llama/Llama-3.1-8B' is not served here"):
        service.create_lora_training_client(base_model="meta-llama/Llama-3.1-8B", rank=4).result()
    missing = "tinker://nobody/sampler_weights/nothing"
    with pytest.raises(tinker.NotFoundError, match="does not exist on this server"):
        service.create_sampling_client(model_path=missing).sample(
            tinker.ModelInput.from_ints(ids[:3]), 1, tinker.SamplingParams(max_tokens=2)).result()
    with pytest.raises(tinker.RequestFailedError, match="does not exist"):
        trainer.load_state("tinker://nobody/weights/nothing").result()


def test_state_round_trip_with_optimizer(served):
    service, trainer, tok, _ = served
    ids = tok.encode("save me and load me back")
    datum = _datum(ids, weights=[1.0] * (len(ids) - 1))
    trainer.forward_backward([datum], "cross_entropy").result()
    trainer.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
    path = trainer.save_state("round").result().path
    before = trainer.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    restored = service.create_training_client_from_state_with_optimizer(path).result()
    assert restored.forward([datum], "cross_entropy").result().metrics["loss:sum"] == pytest.approx(before, rel=1e-5)


@pytest.mark.parametrize("trainer", ["torch", "megatron"])
def test_cookbook_sft_recipe_loss_falls(trainer, tmp_path):
    """tinker_cookbook.supervised.train.main, unchanged, for a few steps against the server on `trainer` (a
    subprocess: the cookbook configures logging and the Hugging Face cache for its whole process)."""
    if trainer == "megatron":
        pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    code = ("import sys, json; sys.path.insert(0, 'examples'); import tinker_cookbook_sft as m; from pathlib import "
            f"Path; print(json.dumps(m.run(5, Path({str(tmp_path)!r}), lr=1e-2, batch_size=4, backend={trainer!r})))")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "TINKER_API_KEY": "tml-local"}
    proc = subprocess.run([sys.executable, "-P", "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    nll = [r["train_mean_nll"] for r in rows]
    assert len(nll) == 5 and nll[-1] < nll[0] - 0.05, nll
