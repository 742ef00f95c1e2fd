"""The paged-attention Triton kernels in Triton's interpreter, against the torch reference (see conftest.py)."""

from __future__ import annotations

import pytest
import torch
from paged_support import paged_policy, sessions, tiny
from slime_env.agents import paged_attention as pa


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


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_kernels_equal_the_reference(dtype, splits, monkeypatch):
    """Both decode paths: one program per (token, K/V head) over the whole context, and the context cut into
    `splits` stretches (here: one of 64 keys, one partial, two empty) combined by the second kernel."""
    monkeypatch.setattr(pa, "MAX_SPLITS", splits)
    monkeypatch.setattr(pa, "PROGRAMS_PER_SM", 1000)  # as many stretches as MAX_SPLITS allows
    assert pa.decode_splits(8, 2, torch.device("cpu")) == splits
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


@pytest.mark.parametrize("fused", [False, True])
def test_the_engine_on_the_triton_kernels_equals_the_engine_on_the_reference(fused):
    """The engine on the Triton attention kernels, with or without the fused elementwise kernels (on by default
    only for 16-bit models; forced here in float32, which the interpreter computes exactly)."""
    from slime_env.offline_tokenizers import smollm2

    tok = smollm2()
    model = tiny("qwen3", tok)
    ref = paged_policy(model, tok, use_triton=False)
    want = sessions(ref, n=2, turns=2)
    ref.close()
    fast = paged_policy(model, tok, use_triton=True)
    assert not fast._engine.runner.fused  # float32: the model's modules
    fast._engine.runner.fused = fused
    try:
        got = sessions(fast, n=2, turns=2)
    finally:
        fast.close()
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        assert list(a.logprobs) == pytest.approx(list(b.logprobs), abs=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_ops_equal_the_model_modules(dtype):
    """add + RMSNorm, Qwen3's per-head norms + rotary embedding + K/V store, SiLU * up: against the modules'
    own arithmetic (which rounds to the dtype between operations: a rounding step apart at most)."""
    from slime_env.agents import fused_ops as fo
    from slime_env.agents.packed_forward import _rope
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3", vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    layer = AutoModelForCausalLM.from_config(config).model.layers[0].to(dtype)
    for norm in (layer.input_layernorm, layer.self_attn.q_norm, layer.self_attn.k_norm):
        norm.weight.data = torch.rand_like(norm.weight) + 0.5  # not all ones: the weight's place matters
    tol = 1e-5 if dtype == torch.float32 else 4e-3
    x, delta = torch.randn(7, 64).to(dtype), torch.randn(7, 64).to(dtype)
    res, h = fo.add_rms_norm(x, delta, layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
    assert torch.equal(res, x + delta)
    assert (h.float() - layer.input_layernorm(x + delta).float()).abs().max() < tol * 4
    attn = layer.self_attn
    q, k, v = (torch.randn(7, n, 16).to(dtype) for n in (4, 2, 2))
    positions = torch.arange(10, 17)
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    cos, sin = Qwen3RotaryEmbedding(config)(q, positions[None])
    cos, sin = cos[0].to(dtype), sin[0].to(dtype)
    want_q, want_k = _rope(attn)(attn.q_norm(q), attn.k_norm(k), cos, sin, unsqueeze_dim=1)
    kc, vc = torch.zeros(4, 8, 2, 16, dtype=dtype), torch.zeros(4, 8, 2, 16, dtype=dtype)
    slots = torch.tensor([9, 10, 11, 3, 20, 21, 31])
    got_q = q.clone()
    fo.rope_store(got_q, k, v, cos, sin, kc, vc, slots, attn.q_norm.weight, attn.k_norm.weight,
                  attn.q_norm.variance_epsilon)
    assert (got_q.float() - want_q.float()).abs().max() < tol * 8
    assert (kc.view(-1, 2, 16)[slots].float() - want_k.float()).abs().max() < tol * 8
    assert torch.equal(vc.view(-1, 2, 16)[slots], v)
    gate, up = torch.randn(7, 192).to(dtype).chunk(2, -1)  # the halves of one gate/up GEMM: rows strided
    assert not gate.is_contiguous()
    want = layer.mlp.act_fn(gate) * up
    assert (fo.silu_mul(gate, up).float() - want.float()).abs().max() < tol * 4
