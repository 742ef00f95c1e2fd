"""TransformersPolicy's dense continuous engine (`slime_env.agents.engine`, `paged=False`) and prefix cache on CUDA (run
on the GPU machine). Models outside the paged engine's families take this path on CUDA; the paged engine has its own
tests (tests/gpu/test_paged_gpu.py).

The model is a small Llama with random weights in SmolLM2's vocabulary (the 540 MB SmolLM2 weights do not
travel to the GPU machine): the engine's mechanics — rows, padding, positions, the prefix cache — are what is
checked, against the static batching loop on the same GPU. The tokenizer is SmolLM2's real one.
`SLIME_ENV_GPU_TOKENIZER` names its folder (default: the offline-built one)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import torch
from slime_env.agents.transformers_policy import TransformersPolicy

from slime_env import Message, get_renderer

GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def parts():
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = os.environ.get("SLIME_ENV_GPU_TOKENIZER")
    if folder:
        tok = AutoTokenizer.from_pretrained(folder)
    else:
        from slime_env.offline_tokenizers import smollm2

        tok = smollm2()
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 matmuls: batched and single rows agree to rounding
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
                         tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    model = LlamaForCausalLM(config).to("cuda", torch.float32).eval()
    return model, tok, get_renderer(tok)


def _sessions(policy, renderer, n, turns, lengths, params):
    async def one(i):
        session = policy.for_episode(f"s{i}")
        ids = renderer.render_prompt([Message("user", f"question number {i}: " + "tell me more " * (i + 1))])
        out = []
        for t in range(turns):
            gen = await session.generate(ids, {**params, "max_new_tokens": lengths[(i + t) % len(lengths)],
                                               "ignore_eos": True})
            out.append(gen)
            ids = ids + list(gen.token_ids) + renderer.bridge(gen.token_ids, [Message("user", "go on")])
        return out

    async def main():
        return await asyncio.gather(*(one(i) for i in range(n)))

    t0 = time.perf_counter()
    result = asyncio.run(main())
    return result, time.perf_counter() - t0


def test_continuous_equals_static_on_cuda(parts):
    model, tok, renderer = parts
    cont = TransformersPolicy(model, tok, max_batch_size=8, paged=False)
    static = TransformersPolicy(model, tok, max_batch_size=8, batching="static")
    assert cont.device.type == "cuda"
    try:
        a, _ = _sessions(cont, renderer, 6, 3, [5, 17, 9, 30], GREEDY)
        b, _ = _sessions(static, renderer, 6, 3, [5, 17, 9, 30], GREEDY)
    finally:
        cont.close()
        static.close()
    for sa, sb in zip(a, b):
        for ga, gb in zip(sa, sb):
            assert ga.token_ids == gb.token_ids
            assert list(ga.logprobs) == pytest.approx(list(gb.logprobs), abs=1e-3)
    assert cont.usage["cached_tokens"] > 0 and cont._engine.prefix.hits >= 12


def test_speed_on_cuda(parts, capsys):
    """Not a pass/fail timing: prints tokens/s and turn-3 time to first token, continuous vs static."""
    model, tok, renderer = parts
    rows = {}
    for name in ("static", "continuous"):
        policy = TransformersPolicy(model, tok, max_batch_size=32, batching=name, paged=False)
        try:
            _sessions(policy, renderer, 4, 1, [4], {"temperature": 0.7})  # warm-up
            result, wall = _sessions(policy, renderer, 32, 3, [8, 48, 20, 33, 12, 40], {"temperature": 0.7})
            made = sum(len(g.token_ids) for s in result for g in s)
            session = policy.for_episode("long")
            ids = renderer.render_prompt([Message("user", " ".join(f"fact {i} is true." for i in range(240)))])

            async def ttft():
                nonlocal ids
                for _ in range(2):
                    gen = await session.generate(ids, {**GREEDY, "max_new_tokens": 16})
                    ids = ids + list(gen.token_ids) + renderer.bridge(gen.token_ids, [Message("user", "and?")])
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                await session.generate(ids, {**GREEDY, "max_new_tokens": 1})
                return time.perf_counter() - t0

            rows[name] = (made / wall, asyncio.run(ttft()), len(ids))
        finally:
            policy.close()
    with capsys.disabled():
        (s_tps, s_ttft, n), (c_tps, c_ttft, _) = rows["static"], rows["continuous"]
        print(f"\n[cuda {torch.cuda.get_device_name()}] 32 x 3-turn sessions: static {s_tps:.0f} tok/s, "
              f"continuous {c_tps:.0f} tok/s ({c_tps / s_tps:.2f}x); turn-3 TTFT on {n} tokens: static "
              f"{s_ttft * 1000:.1f} ms, continuous {c_ttft * 1000:.1f} ms ({s_ttft / c_ttft:.1f}x lower)")
    assert rows["continuous"][0] > 0
