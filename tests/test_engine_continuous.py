"""TransformersPolicy's continuous batching and per-session prefix cache, on the real SmolLM2-135M-Instruct."""

from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch")

from slime_env.agents.default_model import load_default_model  # noqa: E402
from slime_env.agents.transformers_policy import TransformersPolicy  # noqa: E402

from slime_env import Message, Task, get_renderer, make, run_episode  # noqa: E402

GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def model_tok():
    return load_default_model()


def _episodes(policy, renderer, n=2):
    """`n` concurrent 3-turn Calculator-v0 episodes, greedy: every turn extends the episode's prefix."""
    async def main():
        tasks = [Task(prompt=f"What is {7 + i} * {3 + i}?", label=(7 + i) * (3 + i)) for i in range(n)]
        return await asyncio.gather(*(run_episode(make("Calculator-v0"), policy, t, renderer=renderer, max_turns=3,
                                                  max_new_tokens=16, sampling_params=GREEDY,
                                                  metadata={"session_id": f"s{i}"}) for i, t in enumerate(tasks)))
    return asyncio.run(main())


@pytest.mark.parametrize(("cache_tokens", "packed"), [(32768, True), (130, True), (32768, False)])
def test_prefix_cache_is_exact_across_multi_turn_episodes(model_tok, cache_tokens, packed):
    # 130 tokens: sessions evict each other. packed=False: the two-pass path models outside the packed families take.
    model, tok = model_tok
    renderer = get_renderer(tok)
    cached = TransformersPolicy(model, tok, max_batch_size=8, prefix_cache_tokens=cache_tokens)
    assert cached._engine.packed  # SmolLM2 is a Llama
    cached._engine.packed = packed
    plain = TransformersPolicy(model, tok, max_batch_size=8, batching="static")
    try:
        with_cache = _episodes(cached, renderer)
        without = _episodes(plain, renderer)
    finally:
        cached.close()
        plain.close()
    assert all(t.num_turns >= 2 for t in with_cache)  # multi-turn: later turns had a prefix to reuse
    for a, b in zip(with_cache, without):
        assert a.status == b.status and a.response_ids == b.response_ids
        assert a.rollout_logprobs == pytest.approx(b.rollout_logprobs, abs=2e-4)
        a.check()
    if cache_tokens > 1000:
        assert cached.usage["cached_tokens"] > 0 and cached._engine.prefix.hits >= 2
    else:
        assert cached._engine.prefix.tokens <= 130


def test_a_short_request_arriving_during_a_long_one_finishes_first(model_tok):
    model, tok = model_tok
    policy = TransformersPolicy(model, tok, max_batch_size=4)
    prompt = get_renderer(tok).render_prompt([Message("user", "Tell me a long story.")])
    done: list[str] = []

    async def main():
        async def one(name, n):
            gen = await policy.generate(prompt, {**GREEDY, "max_new_tokens": n, "ignore_eos": True})
            done.append(name)
            return gen

        long = asyncio.create_task(one("long", 200))
        while policy._engine.steps < 5:  # the long one is decoding
            await asyncio.sleep(0.01)
        short = await one("short", 3)
        assert not long.done()
        return short, await long

    try:
        short, long = asyncio.run(main())
    finally:
        policy.close()
    assert done == ["short", "long"]
    assert len(short.token_ids) == 3 and len(long.token_ids) == 200
    assert long.token_ids[:3] == short.token_ids  # same prompt, greedy: joining the batch changed nothing


def test_abort_mid_decode_then_the_session_goes_on(model_tok):
    model, tok = model_tok
    renderer = get_renderer(tok)
    policy = TransformersPolicy(model, tok, max_batch_size=4)
    reference = TransformersPolicy(model, tok, max_batch_size=4, batching="static")
    prompt = renderer.render_prompt([Message("user", "Count from one to a hundred.")])

    async def main():
        session = policy.for_episode("ep")
        task = asyncio.create_task(session.generate(prompt, {**GREEDY, "max_new_tokens": 300, "ignore_eos": True}))
        while policy._engine.steps < 5:
            await asyncio.sleep(0.01)
        assert await session.abort()
        partial = await task
        follow = list(prompt) + list(partial.token_ids) + renderer.bridge(partial.token_ids, [Message("user", "go on")])
        again = await session.generate(follow, {**GREEDY, "max_new_tokens": 8})
        expected = await reference.generate(follow, {**GREEDY, "max_new_tokens": 8})
        return partial, again, expected

    try:
        partial, again, expected = asyncio.run(main())
    finally:
        policy.close()
        reference.close()
    assert partial.finish_reason == "abort" and 0 < len(partial.token_ids) < 300
    assert again.token_ids == expected.token_ids
    assert list(again.logprobs) == pytest.approx(list(expected.logprobs), abs=2e-4)


def test_weights_update_waits_for_running_requests_and_clears_the_cache(model_tok):
    model, tok = model_tok
    renderer = get_renderer(tok)
    policy = TransformersPolicy(model, tok, max_batch_size=4)
    prompt = renderer.render_prompt([Message("user", "Hello")])

    async def main():
        session = policy.for_episode("w")
        first = await session.generate(prompt, {**GREEDY, "max_new_tokens": 4})
        assert policy._engine.prefix.tokens > 0
        steps = policy._engine.steps
        running = asyncio.create_task(policy.generate(prompt, {**GREEDY, "max_new_tokens": 60, "ignore_eos": True}))
        while policy._engine.steps < steps + 2:  # it is decoding
            await asyncio.sleep(0.01)
        await policy.update_weights(dict(model.state_dict()), "1")
        old = await running
        assert len(old.token_ids) == 60 and old.weight_version == "0"  # it finished on the old weights
        new = await policy.generate(prompt, {**GREEDY, "max_new_tokens": 2})
        assert new.weight_version == "1"
        return first

    try:
        asyncio.run(main())
        assert policy._engine.prefix.tokens == 0 and policy.weight_version == "1"
    finally:
        policy.close()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_the_packed_step_equals_the_models_own_forward_for_each_family(model_tok, family):
    """Tiny random-weight models of each packed family (Qwen2: biased projections; Qwen3: per-head norms):
    sessions joining while others decode, resumed turns on a cached prefix, greedy — the same tokens and
    log-probs as the static loop, which runs the model's own forward."""
    from transformers import AutoConfig, AutoModelForCausalLM

    _, tok = model_tok
    config = AutoConfig.for_model(family, vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  max_position_embeddings=2048, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    packed = TransformersPolicy(model, tok, max_batch_size=4)
    static = TransformersPolicy(model, tok, max_batch_size=4, batching="static")
    assert packed._engine.packed
    engine, shifts = packed._engine, []
    engine.trim_slack = 4  # drop unused leading columns eagerly: the buffers are re-laid in place often
    relayout = engine._relayout

    def counted(**kw):
        shifts.append(kw)
        relayout(**kw)

    engine._relayout = counted

    async def session(policy, i):
        s = policy.for_episode(f"{family}{i}")
        while policy is packed and engine.steps < 3 * i:  # arrive while the others decode
            await asyncio.sleep(0.001)
        ids, out = list(range(100 + i, 120 + 30 * i)), []  # 20, 50, 80 tokens: the last is a long fresh prompt
        for turn in range(3):
            gen = await s.generate(ids, {**GREEDY, "max_new_tokens": 16 - 5 * i, "ignore_eos": True})
            out.append(gen)
            ids = ids + list(gen.token_ids) + [200 + turn, 201, 202 + i]
        return out

    async def main(policy):
        return await asyncio.gather(*(session(policy, i) for i in range(3)))

    try:
        got, want = asyncio.run(main(packed)), asyncio.run(main(static))
    finally:
        packed.close()
        static.close()
    assert packed.usage["cached_tokens"] > 0
    assert any(kw.get("drop") for kw in shifts) and any(kw.get("left") for kw in shifts)
    for a, b in zip(sum(got, []), sum(want, [])):
        assert a.token_ids == b.token_ids
        assert list(a.logprobs) == pytest.approx(list(b.logprobs), abs=2e-4)


def test_a_long_prompt_is_prefilled_in_chunks_while_others_decode_and_gives_the_same_tokens(model_tok):
    """A 2,000-token prompt fed 64 tokens a step: a short request sent after its first chunk joins the next step and
    finishes while the long prompt is still being fed (before: it waited for the whole prefill, a minute for an
    8k-token prompt on CPU). The long request's tokens and log-probs equal those of the prompt fed whole. (256 a
    step left 8 steps for the short request's 4, and a busy machine's event loop once sent it too late.)"""
    model, tok = model_tok
    renderer = get_renderer(tok)
    long_prompt = renderer.render_prompt([Message("user", "Summarise: " + "the quick brown fox jumps. " * 330)])
    short_prompt = renderer.render_prompt([Message("user", "Hi")])
    assert len(long_prompt) > 1900
    chunked = TransformersPolicy(model, tok, max_batch_size=4, prefill_chunk_tokens=64)
    whole = TransformersPolicy(model, tok, max_batch_size=4, prefill_chunk_tokens=None)
    params = {**GREEDY, "max_new_tokens": 4, "ignore_eos": True}

    async def main():
        long = asyncio.create_task(chunked.generate(long_prompt, params))
        while not chunked._engine._prefilling and not long.done():  # its first chunk is fed
            await asyncio.sleep(0.005)
        short = await chunked.generate(short_prompt, {**params, "max_new_tokens": 3})
        still_feeding = bool(chunked._engine._prefilling) and not long.done()
        return short, await long, still_feeding

    try:
        short, long, still_feeding = asyncio.run(main())
        reference = asyncio.run(whole.generate(long_prompt, params))
    finally:
        chunked.close()
        whole.close()
    assert len(short.token_ids) == 3 and still_feeding  # done while the long prompt was still being fed
    assert long.token_ids == reference.token_ids
    assert long.logprobs == pytest.approx(reference.logprobs, abs=2e-4)
    assert chunked.usage["prompt_tokens"] == len(long_prompt) + len(short_prompt)
    with pytest.raises(Exception, match="prefill_chunk_tokens must be >= 1"):
        TransformersPolicy(model, tok, prefill_chunk_tokens=0)
