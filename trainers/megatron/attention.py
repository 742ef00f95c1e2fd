"""`SDPAttention`: megatron-core's core attention over PyTorch's fused kernels.

The local layer spec's `DotProductAttention` materialises the [b, heads, s, s] score matrix in fp32
(14% MFU at 1B on an H100) and refuses packed sequences. This module keeps its constructor and forward
contract and computes causal attention with `scaled_dot_product_attention` (flash / memory-efficient
kernels, GQA without repeating K/V) for `bshd` input, and with `torch.nn.attention.varlen` (flash
attention over `cu_seqlens`) for packed `thd` input. Where the varlen kernel cannot run (CPU, fp32,
an old PyTorch) each packed sequence goes through SDPA on its own — exact, slower, used by the CPU tests.

`kernel` (the trainer's `attention_kernel`) picks the packed path's kernel on the GPU: `flash` (varlen flash
attention for every sequence), `cudnn` (cuDNN's fused attention, one call per sequence: 1.7x flash's forward +
backward at 64k tokens and 1.6x at 16k on an H100, 0.7x at 4k — `bench/attention.py`) or `auto` (cuDNN for
sequences of at least `CUDNN_MIN_TOKENS` on Hopper or newer, flash for the runs of shorter ones between them).
Under context parallelism (packed input only) each layer all-gathers K/V over the CP group and every local
query chunk attends to its causal prefix (`slime_env.trainers.megatron.context_parallel`): on Hopper a chunk of at
least `CUDNN_MIN_TOKENS` through cuDNN in two calls joined by their log-sum-exps (`_CudnnPrefixRun`), the runs of
shorter chunks through varlen flash.

`keep=True` (the trainer's `recompute_attention: false`, under full recompute): while the trainer's update runs
(`keeping(model)`), the first, gradient-free forward of a recomputed layer keeps the attention output and its
softmax log-sum-exp, and the backward's recompute takes them instead of running the kernel again; the backward
kernels run on them as the kernels' own autograd would. At 64k tokens attention is ~70% of a 4B model's FLOPs, and
full recompute ran its forward twice; the price is heads x (head_dim + 1) values per token and recomputed layer.
Under CP the same holds for each rank's prefix runs.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import itertools
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide

KERNELS = ("auto", "flash", "cudnn")
CUDNN_MIN_TOKENS = 8192  # measured: cuDNN ahead at 16k and 64k, behind at 4k (bench/attention.py, H100)


def _varlen_attn():
    """The varlen flash-attention entry point of this PyTorch, or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


class SDPAttention(MegatronModule):
    """Causal self-attention for megatron's `SelfAttention` (see the module docstring).

    forward(query, key, value, ...): bshd `[s, b, heads, d]` -> `[s, b, heads * d]`; thd (with
    `packed_seq_params.qkv_format == "thd"`) `[t, heads, d]` -> `[t, heads, d]`. No dropout, no bias,
    no sliding window: refused at construction, not silently ignored.
    """

    kept_calls = 0  # gradient-free forwards whose output was kept (the tests count the kernels that did not run again)

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, kernel: str = "auto", keep: bool = False):
        super().__init__(config=config)
        if kernel not in KERNELS:
            raise ValueError(f"attention_kernel must be one of {KERNELS}, got {kernel!r}")
        if (attention_dropout if attention_dropout is not None else config.attention_dropout) != 0:
            raise ValueError("SDPAttention has no attention dropout: set attention_dropout=0")
        if getattr(config, "window_size", None) is not None:
            raise ValueError("SDPAttention does not implement sliding-window attention")
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"SDPAttention is causal only, got {attn_mask_type}")
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        tp = pg_collection.tp.size()
        self.cp_group = getattr(pg_collection, "cp", None) if config.context_parallel_size > 1 else None
        self.heads = divide(config.num_attention_heads, tp)
        self.kv_heads = divide(config.num_query_groups or config.num_attention_heads, tp)
        self.head_dim = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self._varlen = _varlen_attn()
        # PyTorch 2.11 takes is_causal=, later versions window_size=(-1, 0) for the same causal mask.
        params = inspect.signature(self._varlen).parameters if self._varlen else {}
        self._varlen_causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
        # PyTorch >= 2.12 takes enable_gqa=; 2.11's kernel (flash attention) accepts fewer K/V heads as they are,
        # which is tried once; K/V heads are repeated only if this PyTorch refuses both.
        self._varlen_gqa = "enable_gqa" in params
        self._varlen_native_gqa: bool | None = None
        # The shortest sequence cuDNN takes (None: never; -1: auto, decided on the first CUDA call).
        self._cudnn_min: int | None = None if kernel == "flash" else 0 if kernel == "cudnn" else -1
        # keep: outputs kept by gradient-free forwards, oldest first (megatron's schedules recompute the micro-batches
        # in the order they ran forward); `_keeping` is set by `keeping()` for the length of an update.
        self.keep, self._keeping = keep, False
        self._kept: collections.deque[_Kept] = collections.deque()

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("SDPAttention does not take an attention bias")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._thd(query, key, value, packed_seq_params)
        if self.cp_group is not None:
            raise ValueError("SDPAttention runs context parallelism on packed (thd) input only")
        # [s, b, h, d] -> [b, h, s, d]; GQA maps query head i to kv head i // (heads / kv_heads), as megatron does.
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                             enable_gqa=self.kv_heads != self.heads)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.head_dim)

    def _thd(self, q, k, v, p):
        cu_q = p.cu_seqlens_q_padded if p.cu_seqlens_q_padded is not None else p.cu_seqlens_q
        cu_k = p.cu_seqlens_kv_padded if p.cu_seqlens_kv_padded is not None else p.cu_seqlens_kv
        if self.cp_group is None:
            max_len = int(p.max_seqlen_q)
            if self._keeping and (out := self._kept_attention(q, k, v, cu_q, lambda: self._plan(q, cu_q, max_len))
                                  ) is not None:
                return out
            if _fused_kernels(q) and (least := self._cudnn_from(q)) is not None and max_len >= least:
                return self._by_length(q, k, v, cu_q)
            return self._varlen_causal_attn(q, k, v, cu_q, cu_k, max_len, int(p.max_seqlen_kv))
        from slime_env.trainers.megatron import context_parallel as cp

        layout = _cp_layout(cu_q, self.cp_group.rank(), self.cp_group.size())
        k, v = (cp.gather_kv(x, self.cp_group)[layout.kv_index] for x in (k, v))
        if self._keeping and (out := self._kept_attention(q, k, v, layout, lambda: self._prefix_plan(q, k, layout))
                              ) is not None:
            return out
        return self._prefix_attn(q, k, v, layout)

    def _prefix_attn(self, q, k, v, layout):
        """Each query chunk of a CP `layout` to its causal key prefix: cuDNN where a chunk has at least `_cudnn_min`
        tokens (`_CudnnPrefixRun`), varlen flash for the runs of shorter chunks between them and everywhere off
        Hopper; off GPUs the exact per-segment path."""
        if _fused_kernels(q) and (least := self._cudnn_from(q)) is not None and layout.max_q >= least:
            return _attend(q, k, v, _prefix_runs(self, layout, least))
        return self._varlen_causal_attn(q, k, v, layout.cu_q, layout.cu_k, layout.max_q, layout.max_k)

    def _prefix_plan(self, q, k, layout) -> list[_Run]:
        """The runs `_prefix_attn` computes `layout` with (one varlen flash run where no chunk goes to cuDNN; the
        exact path off GPUs)."""
        if not _fused_kernels(q):
            return [_MathRun(self, 0, q.shape[0], layout.cu_q, layout.max_q, k_rows=(0, k.shape[0]),
                             cu_k=layout.cu_k, max_k=layout.max_k)]
        least = self._cudnn_from(q)
        return _prefix_runs(self, layout, least if least is not None and layout.max_q >= least else _NEVER)

    def _cudnn_from(self, q) -> int | None:
        """The shortest sequence cuDNN takes on `q`'s GPU (None: never); `auto` decides on the first call."""
        if self._cudnn_min is not None and self._cudnn_min < 0:  # auto: measured ahead on Hopper
            self._cudnn_min = CUDNN_MIN_TOKENS if torch.cuda.get_device_capability(q.device)[0] >= 9 else None
        return self._cudnn_min

    def _by_length(self, q, k, v, cu: torch.Tensor):
        """Self-attention of a packed batch with cuDNN for each sequence of at least `_cudnn_min` tokens and one
        varlen call for each run of shorter sequences between them (slices of the packed tensors, no copies in)."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        outs, runs = [], _runs(cu, self._cudnn_min)
        for a, b, run_cu, run_max in runs:
            if run_cu is not None:
                outs.append(self._varlen_causal_attn(q[a:b], k[a:b], v[a:b], run_cu, run_cu, run_max, run_max))
                continue
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = F.scaled_dot_product_attention(*self._cudnn_views(q, k, v, a, b), is_causal=True, scale=self.scale)
            outs.append(o.squeeze(0).transpose(0, 1))
        return _joined(outs, runs[-1][1] if runs else 0, q)

    def _cudnn_views(self, q, k, v, a: int, b: int, ka: int | None = None, kb: int | None = None):
        """Rows [a, b) of the packed q and rows [ka, kb) (default: the same) of k, v as [1, heads, s, d] views; K/V
        heads repeated (cuDNN's kernel takes as many K/V heads as query heads)."""
        ka, kb = (a, b) if ka is None else (ka, kb)
        qs, ks, vs = q[a:b].transpose(0, 1).unsqueeze(0), *(x[ka:kb].transpose(0, 1).unsqueeze(0) for x in (k, v))
        if self.kv_heads != self.heads:
            ks, vs = (x.repeat_interleave(self.heads // self.kv_heads, dim=1) for x in (ks, vs))
        return qs, ks, vs

    def _kv_grads(self, dk: torch.Tensor, dv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gradients of cuDNN's repeated K/V heads ([1, heads, s, d]) summed back onto the K/V heads."""
        group = self.heads // self.kv_heads
        return tuple(x.unflatten(1, (self.kv_heads, group)).sum(2) if group > 1 else x for x in (dk, dv))

    def _varlen_causal_attn(self, q, k, v, cu_q, cu_k, max_q: int, max_k: int):
        """Causal attention of each query segment to its key segment, aligned at their ends (a query segment shorter
        than its keys is the tail of the sequence the keys span)."""
        if self._varlen is not None and _fused_kernels(q):
            kw = dict(self._varlen_causal, scale=self.scale)
            args = (cu_q, cu_k, max_q, max_k)
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            if self.kv_heads != self.heads:
                if self._varlen_gqa:
                    kw["enable_gqa"] = True
                elif self._varlen_native_gqa is not False:
                    try:
                        out = self._varlen(q, k, v, *args, **kw)
                        self._varlen_native_gqa = True
                        return out
                    except RuntimeError:
                        self._varlen_native_gqa = False
                if self._varlen_native_gqa is False:
                    k, v = (x.repeat_interleave(self.heads // self.kv_heads, dim=1) for x in (k, v))
            return self._varlen(q, k, v, *args, **kw)
        # Exact fallback: one SDPA call per segment (host sync on the lengths: CPU / fp32 only).
        out = torch.empty_like(q)
        for (a, b), (c, d) in zip(_pairs(cu_q), _pairs(cu_k)):
            if b > a:
                qs, ks, vs = (x[lo:hi].transpose(0, 1).unsqueeze(0) for x, lo, hi in ((q, a, b), (k, c, d), (v, c, d)))
                n, m = b - a, d - c
                mask = None if n == m else torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=self.scale,
                                                   enable_gqa=self.kv_heads != self.heads)
                out[a:b] = o.squeeze(0).transpose(0, 1)
        return out

    # --- attention kept through recompute (`keep`) -------------------------------------------------------------
    def _kept_attention(self, q, k, v, batch, plan):
        """The output under `keeping`, or None where attention runs as usual (with its own autograd). `batch`: what
        identifies the packed batch (its `cu_seqlens`, or under CP its layout); `plan()`: the runs that compute it."""
        if not torch.is_grad_enabled():  # the first pass of a recomputed layer: run the kernels, keep what they made
            kept = _Kept(batch, q.shape, [(run, *run.forward(q, k, v)) for run in plan()])
            self._kept.append(kept)
            SDPAttention.kept_calls += 1
            return kept.output(q)
        kept = self._kept.popleft() if self._kept else None
        if kept is None or kept.batch is not batch or kept.shape != q.shape:
            self._kept.clear()  # a layer megatron does not recompute (or, defensively, a stale entry)
            return None
        return _KeptAttention.apply(q, k, v, kept)

    def _plan(self, q, cu: torch.Tensor, max_len: int) -> list[_Run]:
        """The kernel of each stretch of the packed batch, as the forward without `keep` would choose them."""
        if not _fused_kernels(q):
            return [_MathRun(self, 0, q.shape[0], cu, max_len)]
        if (least := self._cudnn_from(q)) is None or max_len < least:
            return [_FlashRun(self, 0, q.shape[0], cu, max_len)]
        return [_CudnnRun(self, a, b, None, n) if run_cu is None else _FlashRun(self, a, b, run_cu, n)
                for a, b, run_cu, n in _runs(cu, least)]


def _fused_kernels(q: torch.Tensor) -> bool:
    """The GPU kernels (flash, cuDNN) run on `q`: CUDA, 16-bit; elsewhere the exact per-sequence path."""
    return q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)


def _joined(outs: list[torch.Tensor], end: int, q: torch.Tensor) -> torch.Tensor:
    """The per-stretch outputs `outs` (covering rows [0, end)) as one [T, heads, d] tensor like `q`; rows past the
    last sequence (padding) are zeros, never read."""
    if end < q.shape[0]:
        outs = outs + [q.new_zeros(q.shape[0] - end, *q.shape[1:])]
    return outs[0].contiguous() if len(outs) == 1 else torch.cat(outs)


@contextlib.contextmanager
def keeping(model: torch.nn.Module) -> Iterator[None]:
    """Within: `SDPAttention` modules built with `keep=True` keep their outputs through full recompute (see the
    module docstring); on leaving, whatever is still kept is dropped (nothing outlives an update)."""
    mods = [m for m in model.modules() if isinstance(m, SDPAttention) and m.keep]
    for m in mods:
        m._keeping = True
    try:
        yield
    finally:
        for m in mods:
            m._keeping = False
            m._kept.clear()


class _Run:
    """Query rows [qa, qb) of a packed batch against key rows [ka, kb) (self-attention: the same rows) under one
    kernel: `forward(q, k, v)` -> (out [qb-qa, heads, d], state), `backward(dout, q, k, v, out, state)` -> (dq, dk,
    dv) of those rows."""

    def __init__(self, attn: SDPAttention, a: int, b: int, cu: torch.Tensor | None, max_len: int):
        self.attn, self.a, self.b, self.cu, self.max_len = attn, a, b, cu, max_len
        self.qa, self.qb, self.ka, self.kb = a, b, a, b


class _FlashRun(_Run):
    """Varlen flash attention (K/V heads as they are: the kernel maps query heads onto them)."""

    def forward(self, q, k, v):
        q, k, v = (x[self.a:self.b].contiguous() for x in (q, k, v))
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, self.cu, self.cu, self.max_len, self.max_len, 0.0, True, False, scale=self.attn.scale)
        return out, (lse, rng, unused)

    def backward(self, dout, q, k, v, out, state):
        lse, rng, unused = state
        q, k, v = (x[self.a:self.b].contiguous() for x in (q, k, v))
        return torch.ops.aten._flash_attention_backward(
            dout[self.a:self.b].contiguous(), q, k, v, out, lse, self.cu, self.cu, self.max_len, self.max_len, 0.0,
            True, rng, unused, scale=self.attn.scale)


class _CudnnRun(_Run):
    """cuDNN's fused attention over one sequence (`SDPAttention._cudnn_views`; the repeated K/V heads' gradients
    summed)."""

    def _views(self, q, k, v):
        return self.attn._cudnn_views(q, k, v, self.a, self.b)

    def forward(self, q, k, v):
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            *self._views(q, k, v), None, True, 0.0, True, False, scale=self.attn.scale)
        return out.squeeze(0).transpose(0, 1), (out, lse, cum_q, cum_k, max_q, max_k, seed, offset)

    def backward(self, dout, q, k, v, out, state):
        out4, lse, cum_q, cum_k, max_q, max_k, seed, offset = state
        d4 = dout[self.a:self.b].transpose(0, 1).unsqueeze(0)
        if d4.stride() != out4.stride():  # the kernel reads the output's gradient in the output's layout
            d4 = torch.empty_like(out4).copy_(d4)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            d4, *self._views(q, k, v), out4, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, True,
            scale=self.attn.scale)
        return tuple(x.squeeze(0).transpose(0, 1) for x in (dq, *self.attn._kv_grads(dk, dv)))


class _MathRun(_Run):
    """Anywhere else (CPU, fp32): the exact per-sequence path (under CP: query segments `cu` against key segments
    `cu_k`); its backward recomputes it under autograd (which is what keep saves on GPUs: here it only exercises the
    bookkeeping)."""

    def __init__(self, attn, a, b, cu, max_len, *, k_rows: tuple[int, int] | None = None,
                 cu_k: torch.Tensor | None = None, max_k: int | None = None):
        super().__init__(attn, a, b, cu, max_len)
        if k_rows is not None:
            self.ka, self.kb = k_rows
        self.cu_k, self.max_k = (cu, max_len) if cu_k is None else (cu_k, max_k)

    def _attn(self, q, k, v):
        return self.attn._varlen_causal_attn(q, k, v, self.cu, self.cu_k, self.max_len, self.max_k)

    def forward(self, q, k, v):
        return self._attn(q, k, v), ()

    def backward(self, dout, q, k, v, out, state):
        with torch.enable_grad():
            qkv = [x.detach().requires_grad_() for x in (q, k, v)]
            return torch.autograd.grad(self._attn(*qkv), qkv, dout)


class _Kept:
    """What a forward outside autograd made: the batch it ran on (`batch` by identity, the query shape) and, per run,
    (run, out, state)."""

    def __init__(self, batch: object, shape: torch.Size, parts: list[tuple[_Run, torch.Tensor, tuple]]):
        self.batch, self.shape, self.parts = batch, shape, parts

    def output(self, q: torch.Tensor) -> torch.Tensor:
        return _joined([out for _, out, _ in self.parts], self.parts[-1][0].qb if self.parts else 0, q)


def _attend(q, k, v, runs: list[_Run]) -> torch.Tensor:
    """Attention through `runs`: their forward outside autograd, their own backward through `_KeptAttention`."""
    with torch.no_grad():
        kept = _Kept(None, q.shape, [(run, *run.forward(q, k, v)) for run in runs])
    return _KeptAttention.apply(q, k, v, kept)


class _KeptAttention(torch.autograd.Function):
    """The output `kept` holds, and the kernels' backward on it (the recompute's attention under `keeping`)."""

    @staticmethod
    def forward(ctx, q, k, v, kept: _Kept):
        ctx.save_for_backward(q, k, v)
        ctx.kept = kept
        return kept.output(q)

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for run, out, state in ctx.kept.parts:
            gq, gk, gv = run.backward(dout, q, k, v, out, state)
            dq[run.qa:run.qb], dk[run.ka:run.kb], dv[run.ka:run.kb] = gq, gk, gv
        ctx.kept = None
        return dq, dk, dv, None


def _pairs(cu: torch.Tensor) -> list[tuple[int, int]]:
    return list(itertools.pairwise(cu.tolist()))


# Every layer of a CP forward attends over the same batch: its layout is built once (a one-entry cache holding the
# very `cu_seqlens` tensor, compared by identity, so a new batch never hits a stale entry).
_layout_cache: dict[str, object] = {}


def _cp_layout(cu: torch.Tensor, rank: int, size: int):
    from slime_env.trainers.megatron.context_parallel import prefix_layout

    if _layout_cache.get("cu") is not cu or _layout_cache.get("key") != (rank, size):
        _layout_cache.update(cu=cu, key=(rank, size), layout=prefix_layout(cu, rank, size))
    return _layout_cache["layout"]


# Every layer of a forward attends over the same packed batch: its runs are found once (a one-entry cache holding the
# very `cu_seqlens` tensor, compared by identity, as `_cp_layout`'s).
_runs_cache: dict[str, object] = {}


def _runs(cu: torch.Tensor, min_tokens: int) -> list[tuple[int, int, torch.Tensor | None, int]]:
    """The packed batch `cu` as consecutive runs `(start, end, the run's cu_seqlens or None, longest)`: a sequence of
    at least `min_tokens` alone (None: cuDNN's), the shorter ones between two such together (varlen's)."""
    if _runs_cache.get("cu") is cu and _runs_cache.get("min") == min_tokens:
        return _runs_cache["runs"]
    runs, short = [], []

    def close_short():
        if short:
            a = short[0][0]
            bounds = [a] + [hi for _, hi in short]
            run_cu = torch.tensor([x - a for x in bounds], dtype=cu.dtype, device=cu.device)
            runs.append((a, short[-1][1], run_cu, max(hi - lo for lo, hi in short)))
            short.clear()
    for lo, hi in _pairs(cu):
        if hi - lo >= min_tokens:
            close_short()
            runs.append((lo, hi, None, hi - lo))
        elif hi > lo:
            short.append((lo, hi))
    close_short()
    _runs_cache.update(cu=cu, min=min_tokens, runs=runs)
    return runs


# --- context parallelism: query chunks against their causal key prefixes --------------------------------------------
class _PrefixRun(_Run):
    """Query rows [qa, qb) of a CP rank's chunks against key rows [ka, kb) of its gathered prefixes (each chunk's
    keys end where the chunk ends)."""

    def __init__(self, attn: SDPAttention, qa: int, qb: int, ka: int, kb: int):
        super().__init__(attn, qa, qb, None, qb - qa)
        self.ka, self.kb = ka, kb


class _FlashPrefixRun(_PrefixRun):
    """Consecutive chunks in one varlen flash call (the kernel aligns a short query segment at its keys' end)."""

    def __init__(self, attn, qa, qb, ka, kb, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int):
        super().__init__(attn, qa, qb, ka, kb)
        self.cu_q, self.cu_k, self.max_q, self.max_k = cu_q, cu_k, max_q, max_k

    def _rows(self, q, k, v):
        return q[self.qa:self.qb].contiguous(), k[self.ka:self.kb].contiguous(), v[self.ka:self.kb].contiguous()

    def forward(self, q, k, v):
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            *self._rows(q, k, v), self.cu_q, self.cu_k, self.max_q, self.max_k, 0.0, True, False,
            scale=self.attn.scale)
        return out, (lse, rng, unused)

    def backward(self, dout, q, k, v, out, state):
        lse, rng, unused = state
        return torch.ops.aten._flash_attention_backward(
            dout[self.qa:self.qb].contiguous(), *self._rows(q, k, v), out, lse, self.cu_q, self.cu_k, self.max_q,
            self.max_k, 0.0, True, rng, unused, scale=self.attn.scale)


class _CudnnPrefixRun(_PrefixRun):
    """One chunk through cuDNN, whose causal mask starts both sequences together: the keys before the chunk in one
    call without a mask, the chunk's own keys in a causal one, the two outputs joined by their log-sum-exps (ring
    attention's merge). Each call's backward takes the joined output and log-sum-exp: with them its softmax is its
    share of the whole row's, so the gradients are the whole attention's."""

    def _pieces(self) -> list[tuple[int, int, bool]]:
        split = self.kb - (self.qb - self.qa)
        return ([(self.ka, split, False)] if split > self.ka else []) + [(split, self.kb, True)]

    def forward(self, q, k, v):
        calls = []
        for lo, hi, causal in self._pieces():
            views = self.attn._cudnn_views(q, k, v, self.qa, self.qb, lo, hi)
            out4, lse, *rest = torch.ops.aten._scaled_dot_product_cudnn_attention(
                *views, None, True, 0.0, causal, False, scale=self.attn.scale)
            calls.append((lo, hi, causal, out4, lse, rest[:6]))
        out4, lse = calls[0][3], calls[0][4]
        if len(calls) == 2:
            (*_, o1, l1, _), (*_, o2, l2, _) = calls
            lse = torch.logaddexp(l1, l2)
            w1, w2 = ((x - lse).exp().reshape(*x.shape[:3], 1) for x in (l1, l2))
            out4 = torch.empty_like(o1).copy_(o1.float() * w1 + o2.float() * w2)  # the kernel's layout kept
        pieces = [(lo, hi, causal, rest) for lo, hi, causal, _, _, rest in calls]
        return out4.squeeze(0).transpose(0, 1), (out4, lse, pieces)

    def backward(self, dout, q, k, v, out, state):
        out4, lse, pieces = state
        d4 = dout[self.qa:self.qb].transpose(0, 1).unsqueeze(0)
        if d4.stride() != out4.stride():  # the kernel reads the output's gradient in the output's layout
            d4 = torch.empty_like(out4).copy_(d4)
        dq, dks, dvs = 0, [], []
        for lo, hi, causal, (cum_q, cum_k, max_q, max_k, seed, offset) in pieces:
            gq, gk, gv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                d4, *self.attn._cudnn_views(q, k, v, self.qa, self.qb, lo, hi), out4, lse, seed, offset, None,
                cum_q, cum_k, max_q, max_k, 0.0, causal, scale=self.attn.scale)
            gk, gv = self.attn._kv_grads(gk, gv)
            dq, dks, dvs = dq + gq, dks + [gk], dvs + [gv]
        return tuple(x.squeeze(0).transpose(0, 1) for x in (dq, torch.cat(dks, 2), torch.cat(dvs, 2)))


# Every layer of a CP forward attends over the same layout: its runs are planned once (the very layout, compared by
# identity, and what the runs read of a layer: its head counts and scale, the same in every layer of a model).
_prefix_cache: dict[str, object] = {}
_NEVER = 1 << 62  # a `min_tokens` no chunk reaches: every chunk in one varlen flash run


def _prefix_runs(attn: SDPAttention, layout, min_tokens: int) -> list[_PrefixRun]:
    """`layout`'s chunks as consecutive runs: a chunk of at least `min_tokens` query rows alone through cuDNN, the
    shorter ones between two such in one varlen flash call."""
    key = (min_tokens, attn.heads, attn.kv_heads, attn.scale)
    if _prefix_cache.get("layout") is layout and _prefix_cache.get("key") == key:
        return _prefix_cache["runs"]
    runs, short = [], []

    def close_short():
        if short:
            (qa, _, ka, _), (_, qb, _, kb) = short[0], short[-1]
            cu_q, cu_k = ([0, *(c[i + 1] - c[i] for c in short)] for i in (0, 2))
            runs.append(_FlashPrefixRun(attn, qa, qb, ka, kb,
                                        *(torch.tensor(x, device=layout.cu_q.device).cumsum(0, dtype=torch.int32)
                                          for x in (cu_q, cu_k)), max(cu_q), max(cu_k)))
            short.clear()
    for (qa, qb), (ka, kb) in zip(_pairs(layout.cu_q), _pairs(layout.cu_k)):
        if qb == qa:  # an empty chunk (an empty sequence): nothing to attend
            continue
        if qb - qa >= min_tokens:
            close_short()
            runs.append(_CudnnPrefixRun(attn, qa, qb, ka, kb))
        else:
            short.append((qa, qb, ka, kb))
    close_short()
    _prefix_cache.update(layout=layout, key=key, runs=runs)
    return runs
