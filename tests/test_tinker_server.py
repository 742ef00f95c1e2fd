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
    """(service client, backend, URL) of a server on `trainer` over a tiny random model."""
    from tinker_support import ServerThread

    from slime_env.trainers.tinker import TinkerBackend
    from slime_env.trainers.tinker.models import load_tokenizer, random_model

    os.environ.setdefault("TINKER_API_KEY", "tml-local")
    tok = load_tokenizer("qwen3")
    backend = TinkerBackend(MODEL, random_model(tok, hidden=32, layers=1), tok, root, trainer=trainer,
                            max_context_length=256)
    with ServerThread(backend) as url:
        yield tinker.ServiceClient(base_url=url), backend, url


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with _serving(tmp_path_factory.mktemp("ckpt")) as started:
        yield started


@pytest.fixture(scope="module")
def served(server):
    service, backend, _ = server
    return service, service.create_lora_training_client(base_model=MODEL, rank=4).result(), backend.tokenizer, backend


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
    with _serving(tmp_path, trainer) as (service, backend, _):
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


def _post(url: str, route: str, body) -> tuple[int, dict]:
    import httpx

    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{url}/api/v1/{route}", content=raw, headers={"Content-Type": "application/json"}, timeout=30)
    return r.status_code, r.json()


def _result(url: str, answer: dict) -> dict:
    """The outcome of a future the server answered with."""
    while True:
        _, out = _post(url, "retrieve_future", {"request_id": answer["request_id"]})
        if out.get("type") != "try_again":
            return out


def test_malformed_bodies_are_400s_in_the_sdks_shape_naming_the_field(server, served):
    """Not JSON, a JSON array, a field of the wrong type: a 400 `{"error", "category": "user", "detail"}` naming the
    route or the field, for each route (before: aiohttp's 500 "Server got itself in trouble", and `lora_config:
    "rank8"` / `sampling_params: [1]` failed their futures as server errors)."""
    service, _, url = server
    session = service.holder.get_session_id()
    ok = {"sampling_session_id": None, "base_model": MODEL, "prompt": {"chunks": [{"tokens": [1, 2, 3]}]},
          "num_samples": 1, "sampling_params": {"max_tokens": 2}}
    for route, body, message in [
            ("create_model", b"{not json", r"create_model: the body is not valid JSON"),
            ("asample", b"{not json", r"asample: the body is not valid JSON"),
            ("optim_step", b"[1, 2]", r"optim_step: the body must be a JSON object, got list"),
            ("retrieve_future", b"[]", r"retrieve_future: the body must be a JSON object, got list"),
            ("retrieve_future", {"request_id": 7}, r"request_id must be a string, got 7"),
            ("asample", {**ok, "num_samples": "two"}, r"num_samples must be an integer, got 'two'"),
            ("asample", {**ok, "sampling_params": [1]}, r"sampling_params must be an object, got \[1\]"),
            ("asample", {**ok, "sampling_params": {"temperature": "hot"}},
             r"sampling_params.temperature must be a number, got 'hot'"),
            ("create_model", {"session_id": session, "model_seq_id": 90, "base_model": MODEL,
                              "lora_config": "rank8"}, r"lora_config must be an object, got 'rank8'")]:
        status, out = _post(url, route, body)
        assert status == 400 and out["category"] == "user", (route, body, status, out)
        assert __import__("re").search(message, out["error"]) and out["detail"] == out["error"], (route, out)


def test_sampling_honours_max_context_length(served):
    """A prompt over `--max-context-length` (256 here) is the SDK's BadRequestError naming the limit, before any
    work (before: it was sampled); `max_tokens` is cut to the room the prompt leaves."""
    service, trainer, _, _ = served
    sampler = service.create_sampling_client(base_model=MODEL)
    with pytest.raises(tinker.BadRequestError, match=r"prompt: 300 tokens leave no room in max_context_length 256"):
        sampler.sample(tinker.ModelInput.from_ints([5] * 300), 1, tinker.SamplingParams(max_tokens=2)).result()
    res = sampler.sample(tinker.ModelInput.from_ints([5] * 250), 1,
                         tinker.SamplingParams(max_tokens=50, stop=[])).result()
    assert len(res.sequences[0].tokens) == 6


def test_weights_saved_again_under_a_name_are_the_ones_sampled(served):
    """`save_weights_for_sampler("same-name")`, sample, train, save under the same name, sample: the second sample's
    prompt log-probs are the trainer's after training (before: the engine cache, keyed by path, kept serving the
    first save's weights)."""
    import numpy as np

    service, trainer, tok, _ = served
    ids = tok.encode("the same name, saved twice")
    datum = _datum(ids, weights=[1.0] * (len(ids) - 1))

    def sampled(path: str) -> np.ndarray:
        res = service.create_sampling_client(model_path=path).sample(
            tinker.ModelInput.from_ints(ids), 1, tinker.SamplingParams(max_tokens=1), include_prompt_logprobs=True)
        return np.array(res.result().prompt_logprobs[1:])

    for step in range(2):
        path = trainer.save_weights_for_sampler("same-name").result().path
        want = trainer.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        np.testing.assert_allclose(sampled(path), want, atol=1e-4, err_msg=f"save {step}")
        for _ in range(2):
            trainer.forward_backward([datum], "cross_entropy").result()
            trainer.optim_step(tinker.AdamParams(learning_rate=5e-2)).result()


def test_save_state_keeps_an_existing_checkpoint_unless_overwrite(served):
    """The SDK's `save_state(name)` defaults to `overwrite=False`: an existing name is refused by name, and kept;
    `overwrite=True` replaces it (before: overwritten silently)."""
    _, trainer, _, backend = served
    path = trainer.save_state("kept").result().path
    folder = backend.root / path.removeprefix("tinker://").replace("/weights/", "/weights/", 1)
    stamp = (folder / "tinker.json").stat().st_mtime_ns
    with pytest.raises(tinker.RequestFailedError, match=r"checkpoint 'tinker://.*/weights/kept' exists already"):
        trainer.save_state("kept").result()
    assert (folder / "tinker.json").stat().st_mtime_ns == stamp
    assert trainer.save_state("kept", overwrite=True).result().path == path


def test_an_optimizer_the_backend_cannot_run_is_refused_at_creation(served):
    """`optimizer_config` is fixed at creation in the SDK: a Dimuon config is refused then, by name (before: accepted,
    and refused at the first optim_step)."""
    service, _, _, _ = served
    with pytest.raises(tinker.BadRequestError, match=r"optimizer_config 'dimuon': this server's trainers run AdamW"):
        service.create_lora_training_client(base_model=MODEL, rank=2,
                                            optimizer=tinker.DimuonOptimizerConfig()).result()


def test_a_finished_session_trains_no_more_and_frees_its_clients(server):
    """After `POST /sessions/{id}/finish` (the SDK's `ServiceClient.close`): the session's optim_step is refused by
    name, create_model in it or in a session never created is refused, and its training clients are gone from the
    server (before: optim_step ran, create_model succeeded, clients were never freed)."""
    _, backend, url = server
    service = tinker.ServiceClient(base_url=url)
    client = service.create_lora_training_client(base_model=MODEL, rank=2).result()
    model_id, session = client.model_id, service.holder.get_session_id()
    assert model_id in backend.models
    service.close("success").result()
    step = _result(url, _post(url, "optim_step", {"model_id": model_id, "adam_params": {"learning_rate": 1e-3}})[1])
    assert step["category"] == "user" and f"its session {session!r} is finished" in step["error"], step
    assert not [m for m in backend.models if m.startswith(session)]  # freed, on the worker, before that step ran
    for sid, message in [(session, "is finished"), ("session-never", "is not a session of this server")]:
        status, out = _post(url, "create_model", {"session_id": sid, "model_seq_id": 5, "base_model": MODEL,
                                                  "lora_config": {"rank": 2}})
        assert status == 400 and message in out["error"], out


def test_compute_logprobs_scores_only_the_last_n_prompt_tokens(served):
    """`compute_logprobs(prompt, prompt_logprobs_last_n=n)`: the first len(prompt) - n entries are None and the last n
    are the whole prompt's scoring of those tokens (before: the server scored the whole prompt and the SDK raised "may
    predate this feature"); an n of len(prompt) or more is the SDK's BadRequestError naming the bound."""
    import numpy as np

    service, _, tok, _ = served
    sampler = service.create_sampling_client(base_model=MODEL).result()
    ids = tok.encode("score only the end of this prompt, please")
    prompt = tinker.ModelInput.from_ints(ids)
    full = sampler.compute_logprobs(prompt).result()
    last = sampler.compute_logprobs(prompt, prompt_logprobs_last_n=3).result()
    assert len(last) == len(ids) and last[:-3] == [None] * (len(ids) - 3), last
    np.testing.assert_allclose(last[-3:], full[-3:], atol=1e-5)
    res = sampler.sample(prompt, 1, tinker.SamplingParams(max_tokens=2), include_prompt_logprobs=True,
                         prompt_logprobs_last_n=len(ids) - 1).result()  # every token that has a log-prob
    np.testing.assert_allclose(res.prompt_logprobs[1:], full[1:], atol=1e-5)
    bound = rf"prompt_logprobs_last_n {len(ids)}: between 1 and {len(ids) - 1}"
    with pytest.raises(tinker.BadRequestError, match=bound):
        sampler.compute_logprobs(prompt, prompt_logprobs_last_n=len(ids)).result()


def test_checkpoints_saved_with_a_ttl_expire_and_are_removed(served, monkeypatch):
    """`save_weights_for_sampler(name, ttl_seconds=)` and `save_state(name, ttl_seconds=)`: once the TTL has passed
    the checkpoint's folder is removed and loading or sampling it is the SDK's NotFoundError naming the expiry, even
    from a sampling client made before; a checkpoint saved without a TTL stays (before: ttl_seconds was ignored)."""
    import time

    service, trainer, tok, backend = served
    prompt, params = tinker.ModelInput.from_ints(tok.encode("expire me")), tinker.SamplingParams(max_tokens=2)
    sampler_path = trainer.save_weights_for_sampler("short-lived", ttl_seconds=3600).result().path
    state_path = trainer.save_state("short-lived", ttl_seconds=3600).result().path
    kept = trainer.save_weights_for_sampler("kept").result().path
    early = service.create_sampling_client(model_path=sampler_path).result()
    early.sample(prompt, 1, params).result()
    folders = [backend.root / p.removeprefix("tinker://") for p in (sampler_path, state_path)]
    assert all(f.is_dir() for f in folders)
    now = time.time()
    monkeypatch.setattr(backend, "clock", lambda: now + 3601, raising=False)
    for load in (lambda: service.create_sampling_client(model_path=sampler_path).result(),
                 lambda: early.sample(prompt, 1, params).result(),
                 lambda: service.create_training_client_from_state(state_path).result()):
        with pytest.raises(tinker.NotFoundError, match=r"'tinker://.*/short-lived' expired .* \(ttl_seconds 3600\)"):
            load()
    assert not any(f.exists() for f in folders)
    service.create_sampling_client(model_path=kept).result().sample(prompt, 1, params).result()
    with pytest.raises(tinker.BadRequestError, match=r"ttl_seconds must be >= 1, got 0"):
        trainer.save_state("never", ttl_seconds=0).result()
