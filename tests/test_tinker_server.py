"""`slime-env serve-tinker` driven by the real `tinker` SDK: tinker-cookbook's SFT loop (unchanged) lowers the loss,
and bad input comes back as the SDK's errors, naming what was wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[1]
MODEL = "Qwen/Qwen3-8B"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tinker_support import ServerThread

    from slime_env.trainers.tinker import TinkerBackend
    from slime_env.trainers.tinker.models import load_tokenizer, random_model

    os.environ.setdefault("TINKER_API_KEY", "tml-local")
    tok = load_tokenizer("qwen3")
    backend = TinkerBackend(MODEL, random_model(tok, hidden=32, layers=1), tok, tmp_path_factory.mktemp("ckpt"),
                            max_context_length=256)
    with ServerThread(backend) as url:
        service = tinker.ServiceClient(base_url=url)
        yield service, service.create_lora_training_client(base_model=MODEL, rank=4).result(), tok


def _datum(ids, **inputs):
    return tinker.Datum(model_input=tinker.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": ids[1:], **inputs})


def test_losses_forward_and_sampling_with_logprobs(served):
    service, trainer, tok = served
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


def test_bad_input_is_refused_by_name(served):
    service, trainer, tok = served
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
    service, trainer, tok = served
    ids = tok.encode("save me and load me back")
    datum = _datum(ids, weights=[1.0] * (len(ids) - 1))
    trainer.forward_backward([datum], "cross_entropy").result()
    trainer.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
    path = trainer.save_state("round").result().path
    before = trainer.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    restored = service.create_training_client_from_state_with_optimizer(path).result()
    assert restored.forward([datum], "cross_entropy").result().metrics["loss:sum"] == pytest.approx(before, rel=1e-5)


def test_cookbook_sft_recipe_loss_falls(tmp_path):
    """tinker_cookbook.supervised.train.main, unchanged, for a few steps against the server (a subprocess: the
    cookbook configures logging and the Hugging Face cache for its whole process)."""
    code = ("import sys, json; sys.path.insert(0, 'examples'); import tinker_cookbook_sft as m; from pathlib import "
            f"Path; print(json.dumps(m.run(5, Path({str(tmp_path)!r}), lr=1e-2, batch_size=4)))")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "TINKER_API_KEY": "tml-local"}
    proc = subprocess.run([sys.executable, "-P", "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    nll = [r["train_mean_nll"] for r in rows]
    assert len(nll) == 5 and nll[-1] < nll[0] - 0.05, nll
