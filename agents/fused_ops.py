"""Fused elementwise kernels for the paged engine's forward (Triton; CUDA, or a CPU under `TRITON_INTERPRET=1`).

A decoder layer run through the model's own modules launches ~35 small kernels besides its matrix products
(RMSNorm alone is seven, the rotary embedding ten); inside a CUDA graph each still costs a few microseconds of
launch, which is most of a small model's step. Three kernels do the same arithmetic:
- `add_rms_norm(x, delta, weight, eps)`: `x + delta` (the residual stream, rounded to its dtype as torch rounds
  it) and the RMSNorm of that sum, as Llama's `RMSNorm` computes it (float32 statistics, normalised value cast to
  the input dtype before the weight multiplies it);
- `rope_store(q, k, v, cos, sin, ...)`: optional per-head RMSNorm of q and k (Qwen3), the rotary embedding of both
  (rotate-half convention), q rotated in place, k and v written into the K/V pool at their slots;
- `silu_mul(gate, up)`: `silu(gate) * up`, the gated MLP's middle (gate and up: the halves of one GEMM's output);
- `skinny_linear(x, weight, bias)`: a projection of at most 16 rows (a small batch's decode step), each weight row
  read once for all of them.
Each reads its inputs once and writes its outputs once, in float32 registers, so results differ from the modules'
own (which round to the model dtype between operations) by at most a rounding step; tests compare against them.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without Triton never call these
    triton = None

if triton is not None:
    @triton.jit
    def _add_rms_norm_kernel(X, DELTA, W, OUT, RES, eps, n, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(X + row * n + offs, mask=mask, other=0.0)
        if HAS_DELTA:
            x = (x.to(tl.float32) + tl.load(DELTA + row * n + offs, mask=mask, other=0.0).to(tl.float32))
            x = x.to(RES.dtype.element_ty)  # the residual stream, rounded as torch's add rounds it
            tl.store(RES + row * n + offs, x, mask=mask)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, 0) / n
        normed = (xf * tl.rsqrt(var + eps)).to(OUT.dtype.element_ty)
        w = tl.load(W + offs, mask=mask, other=0.0)
        tl.store(OUT + row * n + offs, (w.to(tl.float32) * normed.to(tl.float32)).to(OUT.dtype.element_ty),
                 mask=mask)

    @triton.jit
    def _head(X, W, offs, rot, eps, D: tl.constexpr, NORM: tl.constexpr):
        """One head's vector and its rotate-half partners, in float32, RMSNorm'd as Qwen3's q/k norm does."""
        x = tl.load(X + offs).to(tl.float32)
        xr = tl.load(X + rot).to(tl.float32)
        if NORM:
            scale = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
            x = ((x * scale).to(X.dtype.element_ty).to(tl.float32) * tl.load(W + offs).to(tl.float32))
            xr = ((xr * scale).to(X.dtype.element_ty).to(tl.float32) * tl.load(W + rot).to(tl.float32))
            x = x.to(X.dtype.element_ty).to(tl.float32)
            xr = xr.to(X.dtype.element_ty).to(tl.float32)
        return x, xr

    @triton.jit
    def _rope_store_kernel(Q, K, V, COS, SIN, QW, KW, KC, VC, SLOTS, eps,
                           s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_ct, s_cslot, s_chead,
                           HEADS: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr, NORM: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        offs = tl.arange(0, D)
        rot = tl.where(offs < D // 2, offs + D // 2, offs - D // 2)  # rotate_half's partner of each element
        sign = tl.where(offs < D // 2, -1.0, 1.0)
        cos = tl.load(COS + t * s_ct + offs).to(tl.float32)
        sin = tl.load(SIN + t * s_ct + offs).to(tl.float32)
        if h < HEADS:
            q, qr = _head(Q + t * s_qt + h * s_qh, QW, offs, rot, eps, D, NORM)
            tl.store(Q + t * s_qt + h * s_qh + offs, (q * cos + sign * qr * sin).to(Q.dtype.element_ty))
        if h < KV_HEADS:
            k, kr = _head(K + t * s_kt + h * s_kh, KW, offs, rot, eps, D, NORM)
            dst = tl.load(SLOTS + t) * s_cslot + h * s_chead + offs
            tl.store(KC + dst, (k * cos + sign * kr * sin).to(KC.dtype.element_ty))
            tl.store(VC + dst, tl.load(V + t * s_vt + h * s_vh + offs).to(VC.dtype.element_ty))

    @triton.jit
    def _silu_mul_kernel(GATE, UP, OUT, n, s_g, s_u, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        start = tl.program_id(1) * BLOCK
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(GATE + row * s_g + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(UP + row * s_u + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + row * n + offs, (g / (1.0 + tl.exp(-g)) * u).to(OUT.dtype.element_ty), mask=mask)


    @triton.jit
    def _skinny_linear_kernel(X, W, BIAS, Y, M, N, K, s_xm, s_wn, s_ym, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Y[:M, n-block] = X[:M] @ W[n-block]^T (+ bias): one program streams BLOCK_N rows of W once for all M
        (at most BLOCK_M) rows of X, float32 accumulation."""
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        mask_n = offs_n < N
        mask_m = offs_m < M
        w_ptr = W + offs_n.to(tl.int64)[:, None] * s_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            w = tl.load(w_ptr + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            x = tl.load(X + offs_m[:, None] * s_xm + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
        if HAS_BIAS:
            acc += tl.load(BIAS + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + offs_m[:, None] * s_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
                 mask=mask_m[:, None] & mask_n[None, :])


# (block_n, block_k, num_warps, num_stages) of `skinny_linear` by the weight's output rows (the first bound that
# holds): the fastest of a sweep on an H200 at the qwen3-8b shape, 1 and 8 rows (2026-11-29; 4,096 rows: o_proj and
# down_proj; 6,144: q/k/v; 24,576: gate/up; 151,936: the LM head).
SKINNY_CONFIGS = ((4096, (32, 512, 4, 4)), (8192, (64, 256, 4, 4)), (32768, (32, 256, 4, 4)), (None, (64, 256, 4, 3)))
SKINNY_MAX_ROWS = 16


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for at most `SKINNY_MAX_ROWS` rows of x (a small batch's decode step), 16-bit:
    each row of the weight is read once for all of x's rows. Reading the weights is the step's main cost at a small
    batch; on an H200 at the qwen3-8b shape this reads them at 3.8 TB/s where cuBLAS's kernels read 3.5 (o_proj:
    2.9 against 2.5; the LM head 4.4 against 3.6)."""
    m, k = x.shape
    n = weight.shape[0]
    if m > SKINNY_MAX_ROWS or x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(f"skinny_linear: at most {SKINNY_MAX_ROWS} rows with contiguous last dims, got "
                         f"{tuple(x.shape)}")
    block_n, block_k, warps, stages = next(c for top, c in SKINNY_CONFIGS if top is None or n <= top)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _skinny_linear_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return y


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm(x + delta) * weight) for (T, hidden) contiguous tensors; `delta` None: no addition."""
    n = x.shape[-1]
    out = torch.empty_like(x)
    res = torch.empty_like(x) if delta is not None else x
    _add_rms_norm_kernel[(x.shape[0],)](x, delta if delta is not None else x, weight, out, res, eps, n,
                                        HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(n))
    return res, out


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, q_norm: torch.Tensor | None,
               k_norm: torch.Tensor | None, eps: float) -> None:
    """Rotate q in place; write rotated k and v into the pool (`(blocks, block_size, kv_heads, dim)`) at `slots`."""
    tokens, heads, d = q.shape
    kv_heads = k.shape[1]
    norm = q_norm is not None
    _rope_store_kernel[(tokens, max(heads, kv_heads))](
        q, k, v, cos, sin, q_norm if norm else cos, k_norm if norm else cos, k_cache, v_cache, slots, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        k_cache.stride(1), k_cache.stride(2), HEADS=heads, KV_HEADS=kv_heads, D=d, NORM=norm)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for (T, n) tensors whose rows are contiguous (e.g. the two halves of one fused GEMM's output:
    any row stride); the result is contiguous."""
    n = gate.shape[-1]
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    block = min(1024, triton.next_power_of_2(n))
    _silu_mul_kernel[(gate.shape[0], triton.cdiv(n, block))](gate, up, out, n, gate.stride(0), up.stride(0),
                                                              BLOCK=block)
    return out
