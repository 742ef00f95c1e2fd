"""Attention over the paged K/V pool: Triton kernels for CUDA, a torch reference for everything else.

The pool holds, per layer, keys and values as `(num_blocks, block_size, kv_heads, head_dim)`; a sequence's tokens
sit in the blocks its row of `block_tables` lists, in order. A step's queries are packed (T, heads, dim): first one
token per decoding sequence, then the new tokens of sequences being prefilled (each at the end of its context, its
cached prefix first, causal), then padding. `attention(q, ...)` runs two kernels that read K/V through the block
table (no gather into a contiguous copy), both writing into one output:
- decoding tokens: one program per (sequence, K/V head) does all of that head's query heads together
  (grouped-query attention), flash-attention style over `BLOCK_N` keys at a time; at a small batch each context
  is cut into stretches, one program each, combined by a second kernel (`decode_splits`: one sequence of an 8B
  Qwen3 at 4,000 tokens of context took 4.2 ms a step in 8 programs, 0.5 ms split);
- prefilled tokens: one program per (tile of `BLOCK_M` queries of one sequence, query head).
Both grids are fixed by the step's padded size, not its contents: entries past the real ones (context length 0,
tile sequence -1) exit without writing, so one CUDA graph serves every step of a size. The new tokens' K/V must
be in the pool first (`store`). Softmax in float32; `tl.dot` in IEEE float32 for float32 models (Triton's default
there is TF32, which would not match the model's own forward). The kernels also run under `TRITON_INTERPRET=1`
on a CPU, which is how CI checks them against the reference.
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
class Meta:
    """Where a step's packed queries come from (device int64 tensors; in graph mode views of one buffer)."""
    dec_ctx: torch.Tensor   # (D,) context length of decoding token i (its own included); 0: padding
    dec_rows: torch.Tensor  # (D,) its block-table row
    q_start: torch.Tensor   # (S,) packed index of prefilled sequence s's first new token
    q_len: torch.Tensor     # (S,) its new tokens
    ctx_len: torch.Tensor   # (S,) its tokens in the pool after this step (cached + new)
    rows: torch.Tensor      # (S,) its block-table row
    tile_seq: torch.Tensor  # (TILES,) the sequence of each BLOCK_M-query tile; -1: padding
    tile_m: torch.Tensor    # (TILES,) the tile's first query within its sequence


def tiles_for(q_lens: list[int]) -> tuple[list[int], list[int]]:
    """(sequence, first query) of each BLOCK_M-query tile of prefilled sequences with these lengths."""
    seq, first = [], []
    for s, n in enumerate(q_lens):
        for m in range(0, n, BLOCK_M):
            seq.append(s)
            first.append(m)
    return seq, first


def max_tiles(tokens: int, max_seqs: int) -> int:
    """The most tiles `tokens` prefilled tokens of at most `max_seqs` sequences can need."""
    return -(-tokens // BLOCK_M) + min(tokens, max_seqs)


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


def attention_reference(q, k_cache, v_cache, block_tables, m: Meta, scale):
    out = torch.zeros_like(q)
    group = q.shape[1] // k_cache.shape[2]

    def attend(queries, table, ctx):
        n = queries.shape[0]
        k = _gather(k_cache, table, ctx).float().repeat_interleave(group, 1)  # (ctx, heads, d)
        v = _gather(v_cache, table, ctx).float().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,nhd->hqn", queries.float(), k) * scale
        pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        scores = scores.masked_fill(torch.arange(ctx, device=q.device)[None, :] > pos, float("-inf"))
        return torch.einsum("hqn,nhd->qhd", torch.softmax(scores, -1), v).to(q.dtype)

    for i, ctx in enumerate(m.dec_ctx.tolist()):
        if ctx > 0:
            out[i:i + 1] = attend(q[i:i + 1], block_tables[int(m.dec_rows[i])], ctx)
    used = set(m.tile_seq.tolist()) - {-1}
    for s in sorted(used):
        a, n, ctx = int(m.q_start[s]), int(m.q_len[s]), int(m.ctx_len[s])
        out[a:a + n] = attend(q[a:a + n], block_tables[int(m.rows[s])], ctx)
    return out


# --- Triton ---------------------------------------------------------------------------------------------------
if triton is not None:
    @triton.jit
    def _decode_keys(q, K, V, BT, row, kvh, start, end, scale, s_kb, s_kt, s_kh, s_bt,
                     BLOCK_H: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr,
                     IEEE: tl.constexpr):
        """Online softmax of one K/V head's query heads `q` (BLOCK_H, D) over the keys [start, end) of block-table
        row `row`, BLOCK at a time: (m_i, l_i, acc) in float32 -- each query head's running maximum score, its sum of
        exp(score - maximum) and its unnormalised output (BLOCK_H, D). An empty range leaves (-inf, 0, 0). The inner
        loop of `_decode_kernel` (the whole context) and `_decode_split_kernel` (one stretch of it)."""
        offs_d = tl.arange(0, D)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, D], tl.float32)
        for n0 in range(start, end, BLOCK):
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
        return m_i, l_i, acc

    @triton.jit
    def _decode_kernel(Q, K, V, Out, BT, CTX, ROWS, scale,
                       s_qb, s_qh, s_kb, s_kt, s_kh, s_ob, s_oh, s_bt,
                       GROUP: tl.constexpr, BLOCK_H: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr,
                       D: tl.constexpr, IEEE: tl.constexpr, WRITE_PAD: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        ctx = tl.load(CTX + b)  # 0 for a padding entry: no iteration, nothing stored (zeros when WRITE_PAD)
        row = tl.load(ROWS + b).to(tl.int64)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, D)
        mask_h = (offs_h < GROUP) & (ctx > 0)
        heads = kvh * GROUP + offs_h
        q = tl.load(Q + b * s_qb + heads[:, None] * s_qh + offs_d[None, :], mask=mask_h[:, None], other=0.0)
        m_i, l_i, acc = _decode_keys(q, K, V, BT, row, kvh, 0, ctx, scale, s_kb, s_kt, s_kh, s_bt,
                                     BLOCK_H, PAGE, BLOCK, D, IEEE)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # padding rows: 0, not 0/0
        if WRITE_PAD:
            keep = offs_h < GROUP
        else:
            keep = mask_h
        tl.store(Out + b * s_ob + heads[:, None] * s_oh + offs_d[None, :], out.to(Out.dtype.element_ty),
                 mask=keep[:, None])

    @triton.jit
    def _decode_split_kernel(Q, K, V, PART, ML, BT, CTX, ROWS, scale,
                             s_qb, s_qh, s_kb, s_kt, s_kh, s_bt,
                             HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, PAGE: tl.constexpr,
                             BLOCK: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr):
        """`_decode_kernel` over one of SPLITS equal stretches of the context (whole BLOCKs): the stretch's
        unnormalised output and its (max, sum) per query head into PART / ML, combined by `_decode_combine_kernel`."""
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        ctx = tl.load(CTX + b)
        row = tl.load(ROWS + b).to(tl.int64)
        per = tl.cdiv(tl.cdiv(ctx, SPLITS), BLOCK) * BLOCK
        start = sp * per
        end = tl.minimum(ctx, start + per)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, D)
        mask_h = offs_h < GROUP
        heads = kvh * GROUP + offs_h
        q = tl.load(Q + b * s_qb + heads[:, None] * s_qh + offs_d[None, :], mask=mask_h[:, None], other=0.0)
        m_i, l_i, acc = _decode_keys(q, K, V, BT, row, kvh, start, end, scale, s_kb, s_kt, s_kh, s_bt,
                                     BLOCK_H, PAGE, BLOCK, D, IEEE)
        # PART: (B, heads, SPLITS, D) float32; ML: (B, heads, SPLITS, 2) -- an empty stretch leaves (-inf, 0).
        at = (b * HEADS + heads) * SPLITS + sp
        tl.store(PART + at[:, None] * D + offs_d[None, :], acc, mask=mask_h[:, None])
        tl.store(ML + at * 2, m_i, mask=mask_h)
        tl.store(ML + at * 2 + 1, l_i, mask=mask_h)

    @triton.jit
    def _decode_combine_kernel(PART, ML, Out, CTX, s_ob, s_oh, HEADS: tl.constexpr, D: tl.constexpr,
                               SPLITS: tl.constexpr, WRITE_PAD: tl.constexpr):
        """One (decoding token, query head): the SPLITS stretches' outputs rescaled to their common maximum and
        summed, over the summed normaliser. A padding entry (context 0) writes zeros when WRITE_PAD, else nothing."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        ctx = tl.load(CTX + b)
        offs_s = tl.arange(0, SPLITS)
        offs_d = tl.arange(0, D)
        at = (b * HEADS + h) * SPLITS + offs_s
        m = tl.load(ML + at * 2)
        lsum = tl.load(ML + at * 2 + 1)
        m_all = tl.max(m, 0)
        w = tl.where(lsum > 0, tl.exp(m - m_all), 0.0)
        part = tl.load(PART + at[:, None] * D + offs_d[None, :])
        total = tl.sum(lsum * w, 0)
        out = tl.sum(part * w[:, None], 0) / tl.where(total > 0, total, 1.0)
        if WRITE_PAD:
            tl.store(Out + b * s_ob + h * s_oh + offs_d, out.to(Out.dtype.element_ty))
        else:
            tl.store(Out + b * s_ob + h * s_oh + offs_d, out.to(Out.dtype.element_ty), mask=(offs_d < D) & (ctx > 0))

    @triton.jit
    def _prefill_kernel(Q, K, V, Out, BT, Q_START, Q_LEN, CTX, ROWS, TILE_SEQ, TILE_M, scale,
                        s_qt, s_qh, s_kb, s_kt, s_kh, s_ot, s_oh, s_bt,
                        GROUP: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
                        D: tl.constexpr, IEEE: tl.constexpr):
        tile = tl.program_id(0)
        h = tl.program_id(1)
        kvh = h // GROUP
        seq = tl.load(TILE_SEQ + tile)
        real = seq >= 0  # a padding tile reads sequence 0's entries, runs no iteration and stores nothing
        seq = tl.maximum(seq, 0)
        m0 = tl.load(TILE_M + tile)
        q0 = tl.load(Q_START + seq)
        qn = tl.where(real, tl.load(Q_LEN + seq), 0)
        ctx = tl.where(real, tl.load(CTX + seq), 0)
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
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # padding rows: 0, not 0/0
        tl.store(Out + (q0 + offs_m)[:, None] * s_ot + h * s_oh + offs_d[None, :], out.to(Out.dtype.element_ty),
                 mask=mask_m[:, None])


def _check(q: torch.Tensor, k_cache: torch.Tensor) -> tuple[int, int]:
    d = q.shape[-1]
    if d & (d - 1) or d < 16:
        raise ValueError(f"the Triton kernels need a power-of-two head dim >= 16, got {d}")
    return q.shape[1] // k_cache.shape[2], d


def decode_splits(entries: int, kv_heads: int, device: torch.device) -> int:
    """Stretches each decoding token's context is cut into (a power of two, 1 to `MAX_SPLITS`): enough programs for
    about `PROGRAMS_PER_SM` per multiprocessor. One program per (token, K/V head) leaves most of the GPU idle at a
    small batch -- 8 programs for one sequence of an 8B Qwen3, each walking its whole context alone -- so a small
    batch's decode step splits the context (flash-decoding); a large batch keeps one program per (token, head).
    Fixed by the step's padded size, so one CUDA graph serves every step of a size."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    want = -(-PROGRAMS_PER_SM * sms // max(1, entries * kv_heads))
    return min(MAX_SPLITS, 1 << max(0, (want - 1).bit_length())) if want > 1 else 1


MAX_SPLITS = 32
PROGRAMS_PER_SM = 2


def attention(q, k_cache, v_cache, block_tables, m: Meta, scale, *, use_triton: bool) -> torch.Tensor:
    """(T, heads, dim) attention output of a step's packed queries; see the module docstring. Padding rows are 0."""
    if not use_triton:
        return attention_reference(q, k_cache, v_cache, block_tables, m, scale)
    group, d = _check(q, k_cache)
    entries, kv_heads = m.dec_ctx.shape[0], k_cache.shape[2]
    # A decode-only step (no prefill tiles, a decode entry for every token) writes every row itself: no zero fill.
    decode_only = not m.tile_seq.shape[0] and entries == q.shape[0]
    out = torch.empty_like(q) if decode_only else torch.zeros_like(q)
    common = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0), out.stride(1),
              block_tables.stride(0))
    ieee = q.dtype == torch.float32
    splits = decode_splits(entries, kv_heads, q.device) if entries else 1
    if entries and splits > 1:
        heads = q.shape[1]
        part = torch.empty((entries, heads, splits, d), dtype=torch.float32, device=q.device)
        ml = torch.empty((entries, heads, splits, 2), dtype=torch.float32, device=q.device)
        _decode_split_kernel[(entries, kv_heads, splits)](
            q, k_cache, v_cache, part, ml, block_tables, m.dec_ctx, m.dec_rows, scale, q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            HEADS=heads, GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), PAGE=k_cache.shape[1],
            BLOCK=BLOCK_N, D=d, SPLITS=splits, IEEE=ieee)
        _decode_combine_kernel[(entries, heads)](part, ml, out, m.dec_ctx, out.stride(0), out.stride(1), HEADS=heads,
                                                 D=d, SPLITS=splits, WRITE_PAD=decode_only)
    elif entries:
        _decode_kernel[(entries, kv_heads)](
            q, k_cache, v_cache, out, block_tables, m.dec_ctx, m.dec_rows, scale, q.stride(0), q.stride(1), *common,
            GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), PAGE=k_cache.shape[1], BLOCK=BLOCK_N, D=d,
            IEEE=ieee, WRITE_PAD=decode_only)
    if m.tile_seq.shape[0]:
        _prefill_kernel[(m.tile_seq.shape[0], q.shape[1])](
            q, k_cache, v_cache, out, block_tables, m.q_start, m.q_len, m.ctx_len, m.rows, m.tile_seq, m.tile_m,
            scale, q.stride(0), q.stride(1), *common,
            GROUP=group, PAGE=k_cache.shape[1], BLOCK_M=BLOCK_M, BLOCK=BLOCK_N, D=d, IEEE=ieee)
    return out
