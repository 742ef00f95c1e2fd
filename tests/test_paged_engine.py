"""The paged engine (the GPU path of continuous batching) on a CPU: block pool, sampler, kernels, scheduler.

Everything here runs without CUDA. The attention kernels are Triton; on a CPU they run in Triton's interpreter
(tests/triton_interpret.py) against the torch reference, and the engine runs with the reference attention. CUDA
graphs and bfloat16 kernels are checked on the GPU machine (tests/gpu/test_paged_gpu.py)."""

from __future__ import annotations

import asyncio
import math
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from paged_support import paged_policy, sessions, tiny  # noqa: E402
from slime_env.agents.kv_blocks import SCRATCH, BlockPool, OutOfBlocks, chain_digest  # noqa: E402
from slime_env.agents.sampler import SamplingBatch, sample, uniforms  # noqa: E402
from slime_env.agents.transformers_policy import TransformersPolicy  # noqa: E402

GREEDY = {"temperature": 0.0}


# --- the block pool -----------------------------------------------------------------------------------------
def test_blocks_are_reused_by_content_and_evicted_least_recently_used_first():
    pool = BlockPool(6, 4)  # blocks 1..5 usable, 0 reserved
    ids = list(range(100, 111))  # 11 tokens: two full blocks and a partial one
    a = pool.allocate(3)
    assert SCRATCH not in a and pool.num_free() == 2
    d1 = chain_digest(b"", ids[:4])
    d2 = chain_digest(d1, ids[4:8])
    pool.register(a[0], d1)
    pool.register(a[1], d2)
    blocks, digests = pool.match(ids + [7])
    assert blocks == a[:2] and digests == [d1, d2] and pool.refs[a[0]] == 2
    assert pool.match(ids, limit=1)[0] == a[:1]  # limited: the caller must keep tokens to feed
    # Same tokens after another prefix: a different chain, no match.
    assert pool.match([1] + ids)[0] == []
    pool.release(a)          # a[2] (partial, never named) reaches 0 first
    pool.release(blocks)     # then a[1]
    pool.release(a[:1])      # then a[0]
    assert pool.num_free() == 5 and pool.tokens == 8  # free, still cached
    # Never-used blocks go first, then the least recently released: a[2], then a[1] (its digest goes with it).
    assert pool.allocate(3) == [4, 5, a[2]]
    assert pool.match(ids)[0] == a[:2]
    pool.release(a[:2])  # a sequence's blocks go back tail first: its prefix outlives its tail
    assert pool.allocate(1) == [a[1]]
    assert pool.match(ids)[0] == [a[0]]  # the chain stops at the evicted block
    with pytest.raises(OutOfBlocks):
        pool.allocate(3)


def test_clear_forgets_every_digest_and_a_double_release_is_caught():
    pool = BlockPool(4, 2)
    b = pool.allocate(1)
    pool.register(b[0], chain_digest(b"", [1, 2]))
    pool.clear()
    assert pool.match([1, 2, 3])[0] == [] and pool.tokens == 0
    pool.release(b)
    with pytest.raises(AssertionError, match="released more often"):
        pool.release(b)


# --- the sampler ----------------------------------------------------------------------------------------------
def test_uniforms_depend_on_seed_and_counter_only():
    seeds, counters = [5, -7, 2**62 + 3, 5], [0, 0, 9, 1]
    u = uniforms(seeds, counters)
    assert ((u >= 0) & (u < 1)).all()
    assert u[0] != u[3]  # same seed, next token: a new draw
    # The same (seed, counter) in another batch, at another position: the same number.
    assert uniforms([9, 2**62 + 3], [4, 9])[1] == u[2]
    many = uniforms([123] * 20000, range(20000))
    assert abs(many.mean() - 0.5) < 0.01 and abs(many.var() - 1 / 12) < 0.005
    seeds = uniforms(range(20000), [0] * 20000)  # first draws of consecutive seeds: no visible pattern
    assert abs(np.corrcoef(seeds[:-1], seeds[1:])[0, 1]) < 0.03


def _batch(rows):
    return SamplingBatch.build(rows, torch.device("cpu"))


def test_sampling_follows_the_filtered_distribution_and_never_draws_zero_probability_tokens():
    logits = torch.tensor([[2.0, 1.0, float("-inf"), 0.5, 0.0, -1.0]])
    n = 6000
    for top_k, top_p in [(-1, 1.0), (3, 1.0), (-1, 0.7)]:
        x = logits[0] / 0.8
        if top_k > 0:
            x = x.masked_fill(x < torch.topk(x, top_k).values[-1], float("-inf"))
        if top_p < 1:
            sx, order = torch.sort(x, descending=True)
            pr = torch.softmax(sx, -1)
            x = x.masked_fill(torch.zeros_like(x, dtype=torch.bool).scatter(0, order, pr.cumsum(0) - pr > top_p),
                              float("-inf"))
        want = torch.softmax(x, -1)
        tokens, logps = sample(logits.expand(n, -1).contiguous(),
                               _batch([(0.8, top_p, top_k, 42, c) for c in range(n)]))
        counts = torch.bincount(tokens, minlength=6).double() / n
        assert (counts[want == 0] == 0).all()  # never outside the filtered support
        assert torch.allclose(counts, want.double(), atol=0.025)
        assert torch.allclose(logps, want.log()[tokens].float(), atol=1e-5)  # log-prob under what was sampled


def test_greedy_rows_take_the_argmax_beside_sampled_rows_and_seeds_reproduce():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    rows = [(0.0, 1.0, -1, 1, 0), (1.0, 0.9, 5, 7, 3), (0.7, 1.0, 1, 2, 0), (1.0, 1.0, -1, 7, 3)]
    tokens, logps = sample(logits, _batch(rows))
    assert int(tokens[0]) == int(logits[0].argmax()) and int(tokens[2]) == int(logits[2].argmax())  # top_k 1: greedy
    assert float(logps[0]) == pytest.approx(float(torch.log_softmax(logits[0], -1).max()), abs=1e-6)
    again, _ = sample(logits[[1, 3]], _batch([rows[1], rows[3]]))
    assert again.tolist() == tokens[[1, 3]].tolist()  # the same draw whatever else is in the batch


# --- the kernels, in Triton's interpreter (in their own process: tests/interpreted) --------------------------------
def test_triton_kernels_in_the_interpreter():
    """The Triton kernels against the torch reference, and the engine on them, in Triton's interpreter."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton", reason="Triton is not installed (it ships with CUDA builds of torch)")
    folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "interpreted")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", folder],
                         env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "passed" in out.stdout.splitlines()[-1] and "skipped" not in out.stdout.splitlines()[-1], out.stdout


# --- the engine -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok():
    from slime_env.offline_tokenizers import smollm2

    return smollm2()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_paged_engine_equals_the_models_own_forward(family, tok):
    """Greedy ids and log-probs equal the static loop (the model's own forward) for each family, with joins
    mid-decode, prefix reuse across turns, chunked prefills (a 24-token step budget) and a pool small enough
    that sequences are preempted and recomputed."""
    model = tiny(family, tok)
    static = TransformersPolicy(model, tok, max_batch_size=4, batching="static")
    want = sessions(static, stagger=False)
    static.close()
    # The small pool: 20 blocks of 8 tokens, all taken by the three prompts arriving together (3 + 7 + 10), so the
    # first decoding step must preempt.
    small = {"max_kv_tokens": 160, "block_size": 8, "max_model_len": 160}
    for options in ({}, {"max_step_tokens": 24}, small):
        paged = paged_policy(model, tok, **options)
        try:
            got = sessions(paged, stagger=options is not small)
            engine = paged._engine
            assert paged.usage["cached_tokens"] > 0 and engine.prefix.hits > 0
            if options is small:
                assert engine.preemptions > 0
            for a, b in zip(got, want):
                assert a.token_ids == b.token_ids, options
                assert list(a.logprobs) == pytest.approx(list(b.logprobs), abs=2e-4)
            assert engine.prefix.num_free() == engine.prefix.num_blocks - 1  # nothing leaked
        finally:
            paged.close()


def test_sampled_generations_reproduce_from_their_seeds_whatever_the_batch(tok):
    model = tiny("llama", tok)
    policy = paged_policy(model, tok)
    params = {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 12, "ignore_eos": True}

    async def main():
        alone = await policy.generate([5, 6, 7], {**params, "sampling_seed": 11})
        crowd = await asyncio.gather(*(policy.generate([5, 6, 7, 8 + i][: 3 + (i % 2)],
                                                       {**params, "sampling_seed": 11 if i == 2 else 100 + i})
                                       for i in range(4)))
        return alone, crowd

    try:
        alone, crowd = asyncio.run(main())
    finally:
        policy.close()
    assert crowd[2].token_ids == alone.token_ids and crowd[2].logprobs == pytest.approx(alone.logprobs, abs=1e-6)
    assert len({g.token_ids for g in crowd}) > 1


def test_weight_update_clears_the_prefix_cache_and_changes_the_output(tok):
    model = tiny("llama", tok)
    policy = paged_policy(model, tok)

    async def main():
        s = policy.for_episode("e")
        first = await s.generate(list(range(100, 140)), {**GREEDY, "max_new_tokens": 8, "ignore_eos": True})
        assert policy._engine.prefix.tokens > 0
        other = tiny("llama", tok, seed=5).state_dict()
        await policy.update_weights(other, "1")
        assert policy._engine.prefix.tokens == 0 and policy.weight_version == "1"
        second = await s.generate(list(range(100, 140)), {**GREEDY, "max_new_tokens": 8, "ignore_eos": True})
        return first, second

    try:
        first, second = asyncio.run(main())
    finally:
        policy.close()
    assert second.weight_version == "1" and second.cached_tokens == 0
    assert max(abs(a - b) for a, b in zip(first.logprobs, second.logprobs)) > 1e-2  # the new weights answered


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_fused_projections_are_the_models_parameters_and_follow_in_place_updates(family, tok):
    """One GEMM for q/k/v and one for gate/up per layer: the modules' parameters are row slices of the fused tensors
    (the state dict's names and values unchanged), so weights written into the parameters -- the in-place channel
    (`update_weights` -> `load_state`, as LoRA merges and serve-engine's tensor and disk routes load) or a broadcast
    straight into the state dict's tensors (serve-engine's `update_weights_from_distributed`) -- are what the next
    step computes with: the engine answers as one built fresh on those weights."""
    from slime_env.trainers.weight_sync import InPlace

    model = tiny(family, tok)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    policy = paged_policy(model, tok)
    runner = policy._engine.runner
    layer = model.model.layers[1]
    (qkv, bias), (gate_up, none) = runner.qkv[1], runner.gate_up[1]
    assert qkv.shape[0] == sum(p.shape[0] for p in (layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight,
                                                     layer.self_attn.v_proj.weight))
    for p, fused in ((layer.self_attn.v_proj.weight, qkv), (layer.mlp.up_proj.weight, gate_up)):
        assert p.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    assert (bias is not None) == (family == "qwen2") and none is None  # Qwen2's q/k/v biases are fused too
    state = model.state_dict()
    assert state.keys() == before.keys() and all(torch.equal(state[k], v) for k, v in before.items())
    again = paged_policy(model, tok)  # a second engine on the model: the same storage, nothing copied
    assert again._engine.runner.qkv[1][0].data_ptr() == qkv.data_ptr()
    again.close()
    prompt, params = list(range(100, 140)), {**GREEDY, "max_new_tokens": 8, "ignore_eos": True}

    def fresh(seed):
        other = paged_policy(tiny(family, tok, seed=seed), tok)
        try:
            return asyncio.run(other.generate(prompt, params))
        finally:
            other.close()

    def broadcast_into_parameters(weights):
        def receive():  # as serve-engine's: half straight into the parameters, the rest handed over in two parts
            state = model.state_dict()
            names = sorted(state)
            for name in names[:len(names) // 2]:
                state[name].copy_(weights[name])
            rest = names[len(names) // 2:]
            yield {n: weights[n] for n in rest[::2]}
            yield {n: weights[n] for n in rest[1::2]}
        return receive

    async def main():
        first = await policy.generate(prompt, params)
        await InPlace(policy).push(tiny(family, tok, seed=5).state_dict(), "1")
        loaded = await policy.generate(prompt, params)
        await policy.update_weights(broadcast_into_parameters(tiny(family, tok, seed=7).state_dict()), "2",
                                    partial=True)
        return first, loaded, await policy.generate(prompt, params)

    try:
        first, loaded, received = asyncio.run(main())
    finally:
        policy.close()
    for got, seed in ((loaded, 5), (received, 7)):
        want = fresh(seed)
        assert got.token_ids == want.token_ids and list(got.logprobs) == pytest.approx(list(want.logprobs), abs=1e-6)
        assert max(abs(a - b) for a, b in zip(first.logprobs, got.logprobs)) > 1e-2


def test_many_requests_with_random_lengths_and_aborts_leave_no_block_behind(tok):
    model = tiny("qwen2", tok)
    policy = paged_policy(model, tok, max_kv_tokens=512, block_size=8)
    rng = random.Random(3)

    async def one(i):
        ids = [rng.randrange(50, 2000) for _ in range(rng.randrange(1, 60))]
        task = asyncio.ensure_future(policy.generate(
            ids, {"temperature": 1.0, "max_new_tokens": rng.randrange(1, 40), "sampling_seed": i},
            rid=f"r{i}", session=f"s{i % 7}"))
        if i % 5 == 0:
            await asyncio.sleep(rng.random() * 0.02)
            policy.abort(f"r{i}")
        return await task

    async def main():
        return await asyncio.gather(*(one(i) for i in range(120)))

    try:
        gens = asyncio.run(main())
        engine = policy._engine
        assert all(g.finish_reason in ("stop", "length", "abort") for g in gens)
        assert any(g.finish_reason == "abort" for g in gens) and any(g.finish_reason != "abort" for g in gens)
        assert not engine._running and not engine._queue
        assert engine.prefix.num_free() == engine.prefix.num_blocks - 1
        assert all(r == 0 for r in engine.prefix.refs[1:])
    finally:
        policy.close()


def test_a_sequence_longer_than_the_model_allows_is_refused_by_name(tok):
    model = tiny("llama", tok)
    policy = paged_policy(model, tok, max_model_len=64)

    async def main():
        with pytest.raises(ValueError, match="max_model_len is 64"):
            await policy.generate(list(range(1, 80)), GREEDY)
        gen = await policy.generate(list(range(1, 60)), {**GREEDY, "max_new_tokens": 50, "ignore_eos": True})
        assert len(gen.token_ids) == 5 and gen.finish_reason == "length"  # stopped at the last position

    try:
        asyncio.run(main())
    finally:
        policy.close()


def test_release_and_resume_memory_keep_generation_exact(tok):
    """The embedded engine's cycle: released (pool, graphs and weights: every parameter's storage emptied, its bytes
    on the host), the next generation takes it all back by itself, with the same tokens."""
    model = tiny("llama", tok)
    policy = paged_policy(model, tok)
    weights = {k: v.clone() for k, v in model.state_dict().items()}

    async def gen():
        return await policy.generate(list(range(10, 50)), {**GREEDY, "max_new_tokens": 6, "ignore_eos": True})

    try:
        before = asyncio.run(gen())
        policy.release_memory()
        assert policy._engine.runner.k_cache == [] and policy._engine.prefix.tokens == 0 and policy.memory_released
        assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
        after = asyncio.run(gen())  # the engine resumes its memory by itself
        assert after.token_ids == before.token_ids and after.cached_tokens == 0 and not policy.memory_released
        assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    finally:
        policy.close()


def test_serve_engine_release_frees_the_weights_and_queues_generation_until_resumed(tok):
    """SGLang's `/release_memory_occupation` on serve-engine: the engine holds no weights and no K/V pool, a
    `/generate` waits (not refused) while `/health_generate` still answers at once (the pool's health probe must not
    mark a sleeping engine down, nor wake it), the weights are not readable; `/resume_memory_occupation` brings the
    weights back with their values and the waiting request answers as before the release."""
    from aiohttp.test_utils import TestClient, TestServer
    from slime_env.agents.engine_server import EngineServer

    model = tiny("qwen3", tok)
    policy = paged_policy(model, tok)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    body = {"input_ids": list(range(10, 40)), "sampling_params": {**GREEDY, "max_new_tokens": 6, "ignore_eos": True}}

    async def main():
        async with TestClient(TestServer(EngineServer(policy, "tiny").app())) as http:
            async def generate():
                r = await http.post("/generate", json=body)
                return (await r.json())["output_ids"]

            before = await generate()
            assert (await http.post("/release_memory_occupation", json={})).status == 200
            info = await (await http.get("/get_server_info")).json()
            assert info["memory_released"] and info["memory_calls"] == {"release": 1, "resume": 0}
            assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
            assert policy._engine.runner.k_cache == [] and policy._engine.runner.graphs == {}
            assert (await asyncio.wait_for(http.get("/health_generate"), 2)).status == 200
            r = await http.get("/get_weights_by_name", params={"name": "lm_head.weight"})
            assert r.status == 400 and "resume_memory_occupation" in await r.text()
            waiting = asyncio.ensure_future(generate())
            await asyncio.sleep(0.3)
            assert not waiting.done() and policy._engine.runner.k_cache == []  # queued; nothing woke the engine
            assert (await http.post("/resume_memory_occupation", json={})).status == 200
            after = await asyncio.wait_for(waiting, 10)
            return before, after

    try:
        before, after = asyncio.run(main())
    finally:
        policy.close()
    assert after == before and not policy.memory_released
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def test_pool_sizing_names_what_is_missing_on_a_cpu(tok):
    from slime_env.agents.model_runner import pool_blocks

    model = tiny("llama", tok)
    with pytest.raises(ValueError, match="max_kv_tokens"):
        pool_blocks(model, block_size=16, dtype=torch.float32, device=torch.device("cpu"), memory_fraction=0.5,
                    max_tokens=None, min_tokens=64)
    assert pool_blocks(model, block_size=16, dtype=torch.float32, device=torch.device("cpu"), memory_fraction=0.5,
                       max_tokens=100, min_tokens=64) == math.ceil(100 / 16) + 1
    with pytest.raises(ValueError, match=r"kv_memory_fraction must be in \(0, 1\), got 1.5"):
        paged_policy(model, tok, kv_memory_fraction=1.5)


def test_serve_engine_mem_fraction_reaches_the_paged_pool_and_is_checked_by_name(tok, tmp_path, monkeypatch):
    """`serve-engine --mem-fraction F` is the paged engine's `kv_memory_fraction` (the embedded default unchanged);
    outside (0, 1) it is refused naming the flag, before any model loads. The paged engine runs on this CPU as in
    the tests above (`paged_usable` answers yes: it asks for CUDA), and the HTTP loop is a recorder (the real one
    serves until interrupted)."""
    import typer
    from slime_env.agents import cli, engine_server, transformers_policy
    from typer.testing import CliRunner

    app = typer.Typer()
    cli.register(app)
    runner = CliRunner()
    for bad in ("0", "1", "1.5", "-0.2"):
        out = runner.invoke(app, ["serve-engine", "--mem-fraction", bad])
        assert out.exit_code == 2 and "--mem-fraction" in out.output and "(0, 1)" in out.output, out.output
    folder = tmp_path / "model"
    tiny("llama", tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    seen = {}
    load = engine_server.load_policy
    monkeypatch.setattr(engine_server, "load_policy", lambda *a, **kw: seen.setdefault("loaded", load(*a, **kw)))
    monkeypatch.setattr(engine_server, "serve_forever", lambda app, **kw: seen.update(app=app))
    monkeypatch.setattr(transformers_policy, "paged_usable", lambda model: True)
    for flag, want in ((["--mem-fraction", "0.85"], 0.85), ([], 0.4)):
        seen.clear()
        out = runner.invoke(app, ["serve-engine", "--model", str(folder), "--device", "cpu", "--max-batch-size", "2",
                                  *flag])
        assert out.exit_code == 0, out.output
        policy, _ = seen["loaded"]
        try:
            assert policy.paged and policy._engine._pool_args["memory_fraction"] == want and "app" in seen
        finally:
            policy.close()
