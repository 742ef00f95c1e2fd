"""Tiny random-weight models and multi-turn sessions for the paged engine's tests (CPU, interpreter and GPU)."""

from __future__ import annotations

import asyncio

import torch
from slime_env.agents.transformers_policy import TransformersPolicy

GREEDY = {"temperature": 0.0}


def tiny(family: str, tok, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  max_position_embeddings=1024, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def paged_policy(model, tok, **options):
    options.setdefault("max_kv_tokens", 4096)
    return TransformersPolicy(model, tok, max_batch_size=4, paged=True, paged_options=options)


def sessions(policy, n=3, turns=3, stagger=True):
    """`n` concurrent multi-turn sessions (greedy, fixed lengths): later ones join while earlier ones decode;
    each turn's prompt extends the last turn's ids."""
    async def session(i):
        s = policy.for_episode(f"s{i}")
        engine = getattr(policy, "_engine", None)
        while stagger and engine is not None and engine.steps < 3 * i:
            await asyncio.sleep(0.001)
        ids, out = list(range(100 + i, 120 + 30 * i)), []
        for turn in range(turns):
            gen = await s.generate(ids, {**GREEDY, "max_new_tokens": 16 - 4 * i, "ignore_eos": True})
            out.append(gen)
            ids = ids + list(gen.token_ids) + [200 + turn, 201, 202 + i]
        return out

    async def main():
        return await asyncio.gather(*(session(i) for i in range(n)))

    return sum(asyncio.run(main()), [])
