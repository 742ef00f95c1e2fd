"""`serve-tinker --sampler-url`: a real `slime-env serve-engine` subprocess (SGLang's API) samples for the `tinker`
SDK's sampling clients. Its log-probs are the trainer's for the same tokens (so the saved adapter reached the server
through the weight-sync channel), several sampler paths share it (least recently used idle adapters evicted), the base
model samples without one, and a path that does not exist is refused in the SDK's error shape."""

from __future__ import annotations

import os

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("peft")

MODEL = "Qwen/Qwen3-8B"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(service client, training client, tokenizer, backend): serve-tinker sampling through serve-engine, both on the
    same tiny random model (serve-engine loads it from a folder)."""
    from helpers import serve_engine
    from tinker_support import ServerThread

    from slime_env.trainers.tinker import TinkerBackend
    from slime_env.trainers.tinker.models import load_tokenizer, random_model

    os.environ.setdefault("TINKER_API_KEY", "tml-local")
    tok = load_tokenizer("qwen3")
    model = random_model(tok, hidden=32, layers=1)
    folder = tmp_path_factory.mktemp("model")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    with serve_engine("--model", str(folder), "--device", "cpu", "--threads", "1", "--batch-window-ms", "0") as url:
        backend = TinkerBackend(MODEL, model, tok, tmp_path_factory.mktemp("ckpt"), max_context_length=256,
                                sampler_url=url)
        with ServerThread(backend) as tinker_url:
            service = tinker.ServiceClient(base_url=tinker_url)
            yield service, service.create_lora_training_client(base_model=MODEL, rank=4).result(), tok, backend


def _datum(ids):
    return tinker.Datum(model_input=tinker.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})


def _train_step(trainer, ids):
    trainer.forward_backward([_datum(ids)], "cross_entropy").result()
    trainer.optim_step(tinker.AdamParams(learning_rate=5e-2)).result()


def _forward(trainer, ids) -> np.ndarray:
    return trainer.forward([_datum(ids)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


def _prompt_logprobs(sampler, ids) -> np.ndarray:
    res = sampler.sample(tinker.ModelInput.from_ints(ids), 1, tinker.SamplingParams(max_tokens=1),
                         include_prompt_logprobs=True).result()
    return np.array(res.prompt_logprobs[1:])


def test_samples_and_prompt_logprobs_are_the_trainers(served):
    service, trainer, tok, backend = served
    ids = tok.encode("The quick brown fox jumps over the lazy dog.")
    base = _forward(trainer, ids)
    _train_step(trainer, ids)
    trained = _forward(trainer, ids)
    assert not np.allclose(base, trained, atol=1e-3)  # the adapter changes the function
    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompt = ids[:6]
    res = sampler.sample(tinker.ModelInput.from_ints(prompt), 2, tinker.SamplingParams(max_tokens=5, seed=3),
                         include_prompt_logprobs=True).result()
    assert res.prompt_logprobs[0] is None
    np.testing.assert_allclose(res.prompt_logprobs[1:], trained[:5], atol=1e-4)
    for seq in res.sequences:
        assert len(seq.tokens) == len(seq.logprobs) >= 1
        want = _forward(trainer, prompt + list(seq.tokens))[len(prompt) - 1:]
        np.testing.assert_allclose(seq.logprobs, want, atol=1e-4)
    assert backend.server_sampler.merged  # serve-engine said it merges: one adapter generated at a time


def test_sampler_paths_share_the_server_and_the_base_samples_the_base(served):
    service, trainer, tok, backend = served
    ids = tok.encode("weights for the sampler, pushed to the engine server")
    fresh = service.create_lora_training_client(base_model=MODEL, rank=2).result()  # B = 0: the base function
    base = _forward(fresh, ids)
    paths, want = [], []
    for step in range(3):
        _train_step(trainer, ids)
        paths.append(trainer.save_weights_for_sampler(f"path{step}").result().path)
        want.append(_forward(trainer, ids))
    backend.server_sampler.kept = 2  # three paths and the base over two slots: evictions, then loads again
    clients = [service.create_sampling_client(model_path=p).result() for p in paths]
    for i in [0, 1, 0, 2, 1]:
        np.testing.assert_allclose(_prompt_logprobs(clients[i], ids), want[i], atol=1e-4, err_msg=paths[i])
    np.testing.assert_allclose(_prompt_logprobs(service.create_sampling_client(base_model=MODEL).result(), ids), base,
                               atol=1e-4)
    np.testing.assert_allclose(_prompt_logprobs(clients[0], ids), want[0], atol=1e-4)
    # interleaved requests for two adapters: on a merging server each waits for the other's to finish
    futures = [(i, clients[i].sample(tinker.ModelInput.from_ints(ids), 1, tinker.SamplingParams(max_tokens=3),
                                     include_prompt_logprobs=True)) for i in [0, 2, 0, 2, 1]]
    for i, future in futures:
        np.testing.assert_allclose(future.result().prompt_logprobs[1:], want[i], atol=1e-4, err_msg=paths[i])
    loaded = backend.server_sampler.policy.loras  # what the client loaded and did not unload on the server
    assert len(loaded) <= 2 and len(set(backend.server_sampler.names.values())) >= 4  # 3 paths + the base


def test_a_sampler_path_that_does_not_exist_is_refused(served):
    service, _, tok, _ = served
    with pytest.raises(tinker.NotFoundError, match="does not exist on this server"):
        service.create_sampling_client(model_path="tinker://nobody/sampler_weights/nothing").result().sample(
            tinker.ModelInput.from_ints(tok.encode("hi there")), 1, tinker.SamplingParams(max_tokens=2)).result()


def test_unknown_kinds_are_refused_by_name(tmp_path):
    from slime_env.errors import InvalidInput
    from slime_env.trainers.tinker.sampler import ServerSampler

    with pytest.raises(InvalidInput, match=r"--sampler-kind 'tgi': one of \['sglang', 'vllm'\]"):
        ServerSampler("http://127.0.0.1:1", "tgi", None, tmp_path)


def test_cli_refuses_an_unknown_sampler_kind_before_loading_weights():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-P", "-m", "slime_env", "serve-tinker", "--model", MODEL, "--sampler-url",
                          "http://127.0.0.1:1", "--sampler-kind", "tgi"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "--sampler-kind 'tgi': one of ['sglang', 'vllm']" in out.stderr


def test_vllm_sampler_names_each_paths_adapter_and_evicts_the_least_recently_used_idle_one(tmp_path):
    """`--sampler-kind vllm` over `FakeVLLM` (tests/vllm_support.py: a test double written from vLLM's source, as no
    vLLM server runs on this CPU host): each sampler path's adapter is loaded once as `tinker@<version>`, its requests
    name it in `model` and sample under it, the base names none, and with two slots a third adapter unloads the least
    recently used one without requests running (not the one a request holds)."""
    import asyncio

    import torch
    from helpers import LocalServer
    from vllm_support import FakeVLLM

    from slime_env.agents.lora_adapter import LoRAAdapter
    from slime_env.agents.weight_layout import WeightLayout
    from slime_env.errors import InvalidInput
    from slime_env.trainers.tinker.sampler import ServerSampler

    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    folders = {}
    for i, path in enumerate("abc"):
        g = torch.Generator().manual_seed(i)
        folders[path] = LoRAAdapter("x", {key.format("A"): torch.randn(2, 8, generator=g),
                                          key.format("B"): (i + 1) * torch.randn(8, 2, generator=g)},
                                    {"r": 2, "lora_alpha": 4, "peft_type": "LORA", "target_modules": ["q_proj"]}
                                    ).save(tmp_path / path)

    def greedy(fake, last, lora):
        out = []
        for _ in range(3):
            last, _ = fake.next_token(last, lora)
            out.append(last)
        return out

    async def main():
        fake = FakeVLLM(lora=True)
        async with LocalServer(fake.app()) as srv:
            sampler = ServerSampler(srv.url, "vllm", WeightLayout(), tmp_path / "pushed", kept=2)
            params = {"max_new_tokens": 3, "temperature": 0.0}
            got = {}
            try:
                for path in ["a", "b", "a"]:
                    async with sampler.sampling(path, folders[path]) as view:
                        got[path] = list((await view.generate([1, 2, 3], params)).token_ids)
                async with sampler.sampling("b", folders["b"]) as held:  # b busy: c must evict a, not b
                    async with sampler.sampling("c", folders["c"]) as view:
                        got["c"] = list((await view.generate([1, 2, 3], params)).token_ids)
                    assert list((await held.generate([1, 2, 3], params)).token_ids) == got["b"]
                async with sampler.sampling("base", None) as view:
                    got["base"] = list((await view.generate([1, 2, 3], params)).token_ids)
                with pytest.raises(InvalidInput, match="include_prompt_logprobs is not served by a vLLM sampler"):
                    await view.score([1, 2, 3])
                return fake, got, dict(sampler.names)
            finally:
                await sampler.close()

    fake, got, names = asyncio.run(main())
    assert names == {"a": "tinker@1", "b": "tinker@2", "c": "tinker@3"}
    assert fake.calls == ["load:tinker@1", "load:tinker@2", "unload:tinker@1", "load:tinker@3"]
    assert fake.models_asked == ["tinker@1", "tinker@2", "tinker@1", "tinker@3", "tinker@2", None]
    assert got["b"] == greedy(fake, 3, "tinker@2") and got["c"] == greedy(fake, 3, "tinker@3")
    assert got["base"] == greedy(fake, 3, None) and len({tuple(v) for v in got.values()}) == 4
