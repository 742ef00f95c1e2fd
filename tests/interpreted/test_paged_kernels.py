"""The paged-attention Triton kernels in Triton's interpreter, against the torch reference (see conftest.py)."""

from __future__ import annotations

import pytest
import torch

from agents import paged_attention as pa
from paged_support import paged_policy, sessions, tiny


def _meta(dec_ctx, dec_rows, q_lens, ctx_lens, rows, n_dec, pad_dec=0, pad_tiles=0):
    """A step's metadata as the runner builds it: decoding tokens first, then the prefilled ones, with padding."""
    starts, at = [], n_dec
    for n in q_lens:
        starts.append(at)
        at += n
    tile_seq, tile_m = pa.tiles_for(q_lens)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    return pa.Meta(t(dec_ctx + [0] * pad_dec), t(dec_rows + [0] * pad_dec), t(starts), t(q_lens), t(ctx_lens),
                   t(rows), t(tile_seq + [-1] * pad_tiles), t(tile_m + [0] * pad_tiles)), at


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_kernels_equal_the_reference(dtype):
    g = torch.Generator().manual_seed(1)
    blocks, bs, kv_heads, d, heads = 24, 8, 2, 32, 6  # 3 query heads per K/V head
    kc = torch.randn(blocks, bs, kv_heads, d, generator=g).to(dtype)
    vc = torch.randn(blocks, bs, kv_heads, d, generator=g).to(dtype)
    tables = torch.stack([torch.randperm(blocks - 1, generator=g)[:12] + 1 for _ in range(5)]).to(torch.int32)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    # Decoding tokens (one token, partial blocks, several BLOCK_N spans), then new tokens after a cached prefix
    # (60 of 90), a whole fresh prompt, one token and several query tiles; padding decode entries and tiles.
    meta, n = _meta([1, 9, 64, 95, 33], [3, 0, 4, 1, 2], [5, 40, 1, 70], [5, 60, 90, 70], [2, 4, 0, 3], 5,
                    pad_dec=3, pad_tiles=4)
    q = torch.randn(n + 7, heads, d, generator=g).to(dtype)  # 7 padding tokens at the end
    got = pa.attention(q, kc, vc, tables, meta, 0.17, use_triton=True)
    want = pa.attention_reference(q, kc, vc, tables, meta, 0.17)
    assert (got.float() - want.float()).abs().max() < tol
    assert got[n:].abs().max() == 0  # padding rows untouched


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
