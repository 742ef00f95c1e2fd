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
query chunk attends to its causal prefix (`slime_env.trainers.megatron.context_parallel`).
"""

from __future__ import annotations

import inspect
import itertools
import math

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

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, kernel: str = "auto"):
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
            if self._cudnn_min is not None and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
                if self._cudnn_min < 0:  # auto: measured ahead on Hopper
                    self._cudnn_min = CUDNN_MIN_TOKENS if torch.cuda.get_device_capability(q.device)[0] >= 9 else None
                if self._cudnn_min is not None and int(p.max_seqlen_q) >= self._cudnn_min:
                    return self._by_length(q, k, v, cu_q)
            return self._varlen_causal_attn(q, k, v, cu_q, cu_k, int(p.max_seqlen_q), int(p.max_seqlen_kv))
        from slime_env.trainers.megatron import context_parallel as cp

        layout = _cp_layout(cu_q, self.cp_group.rank(), self.cp_group.size())
        k, v = (cp.gather_kv(x, self.cp_group)[layout.kv_index] for x in (k, v))
        return self._varlen_causal_attn(q, k, v, layout.cu_q, layout.cu_k, layout.max_q, layout.max_k)

    def _by_length(self, q, k, v, cu: torch.Tensor):
        """Self-attention of a packed batch with cuDNN for each sequence of at least `_cudnn_min` tokens and one
        varlen call for each run of shorter sequences between them (slices of the packed tensors, no copies in)."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        outs, runs = [], _runs(cu, self._cudnn_min)
        for a, b, run_cu, run_max in runs:
            if run_cu is not None:
                outs.append(self._varlen_causal_attn(q[a:b], k[a:b], v[a:b], run_cu, run_cu, run_max, run_max))
                continue
            qs, ks, vs = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            if self.kv_heads != self.heads:  # cuDNN's kernel takes as many K/V heads as query heads
                ks, vs = (x.repeat_interleave(self.heads // self.kv_heads, dim=1) for x in (ks, vs))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale)
            outs.append(o.squeeze(0).transpose(0, 1))
        end = runs[-1][1] if runs else 0
        if end < q.shape[0]:  # rows past the last sequence (padding): zeros, never read
            outs.append(q.new_zeros(q.shape[0] - end, *q.shape[1:]))
        return outs[0].contiguous() if len(outs) == 1 else torch.cat(outs)

    def _varlen_causal_attn(self, q, k, v, cu_q, cu_k, max_q: int, max_k: int):
        """Causal attention of each query segment to its key segment, aligned at their ends (a query segment shorter
        than its keys is the tail of the sequence the keys span)."""
        if self._varlen is not None and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
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
