"""Attention over the paged K/V pool: Triton kernels for CUDA, a torch reference for everything else.

The pool holds, per layer, keys and values as `(num_blocks, block_size, kv_heads, head_dim)`; a sequence's tokens
sit in the blocks its row of `block_tables` lists, in order. Two calls, both reading K/V through the block table
(no gather into a contiguous copy):
- `decode(q, ...)`: one query per sequence (`q`: (B, heads, dim)); one program per (sequence, K/V head) does all
  of that head's query heads together (grouped-query attention), flash-attention style over `BLOCK_N` keys at a
  time. Fixed shapes: the engine captures it in CUDA graphs; lengths are read from device memory.
- `prefill(q, ...)`: the packed new tokens of several sequences (`q`: (T, heads, dim)), each sequence's queries at
  the end of its context (cached prefix first), causal. One program per (tile of `BLOCK_M` queries, query head).

Both need the new tokens' K/V already in the pool (`store`). Softmax in float32; `tl.dot` in IEEE float32 for
float32 models (Triton's default there is TF32, which would not match the model's own forward). The Triton
versions run under `TRITON_INTERPRET=1` on a CPU too, which is how CI checks them against the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:  # Triton ships with CUDA builds of torch; CPU-only installs use the reference path
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

BLOCK_M = 32  # prefill: queries per program
BLOCK_N = 64  # keys per iteration


def triton_usable(device: torch.device) -> bool:
    """Whether the Triton kernels run on `device` by default: CUDA with Triton installed. (Under
    `TRITON_INTERPRET=1` they also run on a CPU, slowly: tests ask for them by name.)"""
    return triton is not None and device.type == "cuda"


@dataclass
class Prefill:
    """Where the packed queries of a prefill step come from. Host lists → `tensors(device)` once per step."""
    q_start: torch.Tensor   # (S,) first packed index of each sequence's queries
    q_len: torch.Tensor     # (S,) its new tokens
    ctx_len: torch.Tensor   # (S,) its tokens in the pool after this step (cached + new)
    rows: torch.Tensor      # (S,) its row of block_tables
    tile_seq: torch.Tensor  # (tiles,) the sequence of each BLOCK_M-query tile
    tile_m: torch.Tensor    # (tiles,) the tile's first query within its sequence
    max_q: int              # longest q_len (host int)


def prefill_plan(q_lens: list[int], ctx_lens: list[int], rows: list[int], device: torch.device) -> Prefill:
    starts, tile_seq, tile_m, at = [], [], [], 0
    for s, n in enumerate(q_lens):
        starts.append(at)
        at += n
        for m in range(0, n, BLOCK_M):
            tile_seq.append(s)
            tile_m.append(m)
    meta = torch.tensor([starts, q_lens, ctx_lens, rows], dtype=torch.int32)
    tiles = torch.tensor([tile_seq, tile_m], dtype=torch.int32)
    meta, tiles = meta.to(device, non_blocking=True), tiles.to(device, non_blocking=True)
    return Prefill(meta[0], meta[1], meta[2], meta[3], tiles[0], tiles[1], max(q_lens, default=0))


def store(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Write the K/V of each token (`k`, `v`: (T, kv_heads, dim)) at its pool slot (block * block_size + offset)."""
    kc = k_cache.view(-1, *k_cache.shape[2:])
    vc = v_cache.view(-1, *v_cache.shape[2:])
    kc.index_copy_(0, slots, k.to(kc.dtype))
    vc.index_copy_(0, slots, v.to(vc.dtype))


# --- torch reference ----------------------------------------------------------------------------------------
def _gather(cache: torch.Tensor, table_row: torch.Tensor, n: int) -> torch.Tensor:
    """(n, kv_heads, dim): the first n tokens of a sequence from its blocks."""
    bs = cache.shape[1]
    blocks = table_row[: -(-n // bs)].long()
    return cache[blocks].reshape(-1, *cache.shape[2:])[:n]


def decode_reference(q, k_cache, v_cache, block_tables, ctx_lens, rows, scale):
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for i in range(q.shape[0]):
        n, table = int(ctx_lens[i]), block_tables[int(rows[i])]
        k = _gather(k_cache, table, n).float().repeat_interleave(group, 1)  # (n, heads, d)
        v = _gather(v_cache, table, n).float().repeat_interleave(group, 1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[i].float(), k) * scale, -1)
        out[i] = torch.einsum("hn,nhd->hd", w, v).to(q.dtype)
    return out


def prefill_reference(q, k_cache, v_cache, block_tables, p: Prefill, scale):
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for s in range(len(p.q_len)):
        a, n, ctx, table = int(p.q_start[s]), int(p.q_len[s]), int(p.ctx_len[s]), block_tables[int(p.rows[s])]
        k = _gather(k_cache, table, ctx).float().repeat_interleave(group, 1)
        v = _gather(v_cache, table, ctx).float().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,nhd->hqn", q[a:a + n].float(), k) * scale
        pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        scores = scores.masked_fill(torch.arange(ctx, device=q.device)[None, :] > pos, float("-inf"))
        out[a:a + n] = torch.einsum("hqn,nhd->qhd", torch.softmax(scores, -1), v).to(q.dtype)
    return out


# --- Triton ---------------------------------------------------------------------------------------------------
if triton is not None:
    @triton.jit
    def _decode_kernel(Q, K, V, O, BT, CTX, ROWS, scale,
                       s_qb, s_qh, s_kb, s_kt, s_kh, s_ob, s_oh, s_bt,
                       GROUP: tl.constexpr, BLOCK_H: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr,
                       D: tl.constexpr, IEEE: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        ctx = tl.load(CTX + b)
        row = tl.load(ROWS + b).to(tl.int64)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, D)
        mask_h = offs_h < GROUP
        heads = kvh * GROUP + offs_h
        q = tl.load(Q + b * s_qb + heads[:, None] * s_qh + offs_d[None, :], mask=mask_h[:, None], other=0.0)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, D], tl.float32)
        for n0 in range(0, ctx, BLOCK):
            offs_n = n0 + tl.arange(0, BLOCK)
            mask_n = offs_n < ctx
            blk = tl.load(BT + row * s_bt + offs_n // PAGE, mask=mask_n, other=0).to(tl.int64)
            base = blk * s_kb + (offs_n % PAGE) * s_kt + kvh * s_kh
            k = tl.load(K + base[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
            v = tl.load(V + base[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(mask_n[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(O + b * s_ob + heads[:, None] * s_oh + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=mask_h[:, None])

    @triton.jit
    def _prefill_kernel(Q, K, V, O, BT, Q_START, Q_LEN, CTX, ROWS, TILE_SEQ, TILE_M, scale,
                        s_qt, s_qh, s_kb, s_kt, s_kh, s_ot, s_oh, s_bt,
                        GROUP: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
                        D: tl.constexpr, IEEE: tl.constexpr):
        tile = tl.program_id(0)
        h = tl.program_id(1)
        kvh = h // GROUP
        seq = tl.load(TILE_SEQ + tile)
        m0 = tl.load(TILE_M + tile)
        q0 = tl.load(Q_START + seq)
        qn = tl.load(Q_LEN + seq)
        ctx = tl.load(CTX + seq)
        row = tl.load(ROWS + seq).to(tl.int64)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        mask_m = offs_m < qn
        pos = ctx - qn + offs_m  # each query's position in its sequence
        q = tl.load(Q + (q0 + offs_m)[:, None] * s_qt + h * s_qh + offs_d[None, :], mask=mask_m[:, None], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        end = tl.minimum(ctx, ctx - qn + m0 + BLOCK_M)  # keys past the tile's last query are never needed
        for n0 in range(0, end, BLOCK):
            offs_n = n0 + tl.arange(0, BLOCK)
            mask_n = offs_n < end
            blk = tl.load(BT + row * s_bt + offs_n // PAGE, mask=mask_n, other=0).to(tl.int64)
            base = blk * s_kb + (offs_n % PAGE) * s_kt + kvh * s_kh
            k = tl.load(K + base[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
            v = tl.load(V + base[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            # Key 0 is in the first iteration for every query: each row's maximum is finite from then on.
            s = tl.where(mask_n[None, :] & (offs_n[None, :] <= pos[:, None]), s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(O + (q0 + offs_m)[:, None] * s_ot + h * s_oh + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=mask_m[:, None])


def _check(q: torch.Tensor, k_cache: torch.Tensor) -> tuple[int, int]:
    d = q.shape[-1]
    if d & (d - 1) or d < 16:
        raise ValueError(f"the Triton kernels need a power-of-two head dim >= 16, got {d}")
    return q.shape[1] // k_cache.shape[2], d


def decode(q, k_cache, v_cache, block_tables, ctx_lens, rows, scale, *, use_triton: bool):
    """(B, heads, dim) attention output of one query per sequence; see the module docstring."""
    if not use_triton:
        return decode_reference(q, k_cache, v_cache, block_tables, ctx_lens, rows, scale)
    group, d = _check(q, k_cache)
    out = torch.empty_like(q)
    grid = (q.shape[0], k_cache.shape[2])
    _decode_kernel[grid](q, k_cache, v_cache, out, block_tables, ctx_lens, rows, scale,
                         q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                         out.stride(0), out.stride(1), block_tables.stride(0),
                         GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), PAGE=k_cache.shape[1],
                         BLOCK=BLOCK_N, D=d, IEEE=q.dtype == torch.float32)
    return out


def prefill(q, k_cache, v_cache, block_tables, p: Prefill, scale, *, use_triton: bool):
    """(T, heads, dim) causal attention output of the packed new tokens; see the module docstring."""
    if not use_triton:
        return prefill_reference(q, k_cache, v_cache, block_tables, p, scale)
    group, d = _check(q, k_cache)
    out = torch.empty_like(q)
    grid = (p.tile_seq.shape[0], q.shape[1])
    _prefill_kernel[grid](q, k_cache, v_cache, out, block_tables, p.q_start, p.q_len, p.ctx_len, p.rows,
                          p.tile_seq, p.tile_m, scale,
                          q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                          out.stride(0), out.stride(1), block_tables.stride(0),
                          GROUP=group, PAGE=k_cache.shape[1], BLOCK_M=BLOCK_M, BLOCK=BLOCK_N, D=d,
                          IEEE=q.dtype == torch.float32)
    return out
