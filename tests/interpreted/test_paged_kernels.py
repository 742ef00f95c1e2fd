"""The paged-attention Triton kernels in Triton's interpreter, against the torch reference (see conftest.py)."""

from __future__ import annotations

import pytest
import torch

from agents import paged_attention as pa
from paged_support import paged_policy, sessions, tiny


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_kernels_equal_the_reference(dtype):
    g = torch.Generator().manual_seed(1)
    blocks, bs, kv_heads, d, heads = 24, 8, 2, 32, 6  # 3 query heads per K/V head
    kc = torch.randn(blocks, bs, kv_heads, d, generator=g).to(dtype)
    vc = torch.randn(blocks, bs, kv_heads, d, generator=g).to(dtype)
    tables = torch.stack([torch.randperm(blocks - 1, generator=g)[:12] + 1 for _ in range(5)]).to(torch.int32)
    ctx = torch.tensor([1, 9, 64, 95, 33], dtype=torch.int32)  # one token, partial blocks, several BLOCK_N spans
    rows = torch.tensor([3, 0, 4, 1, 2], dtype=torch.int32)
    q = torch.randn(5, heads, d, generator=g).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    got = pa.decode(q, kc, vc, tables, ctx, rows, 0.17, use_triton=True)
    want = pa.decode_reference(q, kc, vc, tables, ctx, rows, 0.17)
    assert (got.float() - want.float()).abs().max() < tol
    # New tokens after a cached prefix (60 of 90), a whole fresh prompt, one token, several query tiles.
    plan = pa.prefill_plan([5, 40, 1, 70], [5, 60, 90, 70], [2, 4, 0, 3], torch.device("cpu"))
    q = torch.randn(116, heads, d, generator=g).to(dtype)
    got = pa.prefill(q, kc, vc, tables, plan, 0.17, use_triton=True)
    want = pa.prefill_reference(q, kc, vc, tables, plan, 0.17)
    assert (got.float() - want.float()).abs().max() < tol


def test_the_engine_on_the_triton_kernels_equals_the_engine_on_the_reference():
    from slime_env.offline_tokenizers import smollm2

    tok = smollm2()
    model = tiny("qwen3", tok)
    ref = paged_policy(model, tok, use_triton=False)
    want = sessions(ref, n=2, turns=2)
    ref.close()
    fast = paged_policy(model, tok, use_triton=True)
    try:
        got = sessions(fast, n=2, turns=2)
    finally:
        fast.close()
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        assert list(a.logprobs) == pytest.approx(list(b.logprobs), abs=1e-4)
