"""Exact causal attention kernels side by side at long lengths (issue: performance at the shapes agentic RL runs at).

The trainer's packed (thd) attention (`trainers/megatron/attention.py`) calls PyTorch's varlen flash attention. This
bench times the exact alternatives this PyTorch offers on the GPU at a model's head shape (`--shape`, bench/shapes.py:
Qwen3-4B has 32 query heads, 8 K/V heads of 128), forward and forward + backward, in bf16:

- `varlen`: `torch.nn.attention.varlen.varlen_attn` over `cu_seqlens` (what the trainer runs today);
- `sdpa-flash` / `sdpa-cudnn` / `sdpa-efficient`: `scaled_dot_product_attention` with one backend forced, on one
  sequence at a time (bshd; a packed batch is one call per sequence);
- `flex`: compiled FlexAttention with a causal + same-document block mask over the packed batch (one call).

Layouts: `--layouts 65536x1,16384x4,4096x16` (length x sequences, packed into one micro-batch). Each kernel's output
and input gradients are checked against `varlen` (max abs difference printed); TFLOP/s count causal FLOPs only
(forward 4·s²/2·heads·d per sequence, backward 2.5× the forward). Usage:
    python bench/attention.py --shape qwen3-4b --layouts 65536x1,16384x4
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.nn.functional as F
from shapes import hf_config


def timed(fn, iters: int) -> float:
    """Median milliseconds of `fn()` over `iters` runs after one warm-up, CUDA events."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def kernels(heads: int, kv_heads: int, lengths: list[int], device: str):
    """name -> fn(q, k, v) on packed [t, heads, d] tensors, giving [t, heads, d]."""
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), device=device, dtype=torch.int32)
    bounds = cu.tolist()
    rep = heads // kv_heads
    out: dict = {}
    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn

        causal = {"is_causal": True} if "is_causal" in inspect.signature(varlen_attn).parameters else \
            {"window_size": (-1, 0)}

        def varlen(q, k, v):
            try:
                return varlen_attn(q, k, v, cu, cu, max(lengths), max(lengths), **causal)
            except RuntimeError:  # a kernel that wants as many K/V heads as query heads
                return varlen_attn(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), cu, cu,
                                   max(lengths), max(lengths), **causal)
        out["varlen"] = varlen
    except ImportError:
        pass
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def per_sequence(backend, gqa: bool):
        def fn(q, k, v):
            outs = []
            for a, b in itertools.pairwise(bounds):
                qs, ks, vs = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
                if not gqa:
                    ks, vs = ks.repeat_interleave(rep, 1), vs.repeat_interleave(rep, 1)
                with sdpa_kernel(backend):
                    o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa and rep > 1)
                outs.append(o.squeeze(0).transpose(0, 1))
            return torch.cat(outs)
        return fn
    out["sdpa-flash"] = per_sequence(SDPBackend.FLASH_ATTENTION, True)
    out["sdpa-cudnn"] = per_sequence(SDPBackend.CUDNN_ATTENTION, False)
    out["sdpa-efficient"] = per_sequence(SDPBackend.EFFICIENT_ATTENTION, True)
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        doc = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                      torch.tensor(lengths, device=device))

        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (doc[q_idx] == doc[kv_idx])
        total = sum(lengths)
        block = create_block_mask(mask_mod, None, None, total, total, device=device)
        compiled = torch.compile(flex_attention, dynamic=False)

        def flex(q, k, v):
            qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            return compiled(qs, ks, vs, block_mask=block, enable_gqa=rep > 1).squeeze(0).transpose(0, 1)
        out["flex"] = flex
    except ImportError:
        pass
    return out


def measure(fn, q, k, v, dout, iters: int):
    """(output and input gradients, {fwd_ms, fwd_bwd_ms}) of kernel `fn`."""
    qs, ks, vs = (x.clone().requires_grad_() for x in (q, k, v))
    o = fn(qs, ks, vs)
    o.backward(dout)
    got = (o.detach(), qs.grad, ks.grad, vs.grad)
    with torch.no_grad():
        fwd = timed(lambda: fn(q, k, v), iters)

    def fwd_bwd():
        qs.grad = ks.grad = vs.grad = None
        fn(qs, ks, vs).backward(dout)
    return got, {"fwd_ms": fwd, "fwd_bwd_ms": timed(fwd_bwd, iters)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-4b")
    ap.add_argument("--layouts", default="65536x1,16384x4,4096x16")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/attention.py times GPU kernels: no CUDA device here")
    cfg = hf_config(args.shape)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}; "
          f"{args.shape}: {heads} query heads, {kv_heads} K/V heads of {d}")
    rows = []
    for layout in args.layouts.split(","):
        length, n = (int(x) for x in layout.split("x"))
        lengths = [length] * n
        t = sum(lengths)
        fwd_flops = sum(4 * s * s / 2 * heads * d for s in lengths)
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(t, heads, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(t, kv_heads, d, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(t, kv_heads, d, device="cuda", dtype=torch.bfloat16, generator=g)
        dout = torch.randn(t, heads, d, device="cuda", dtype=torch.bfloat16, generator=g)
        ref, ref_name = None, None
        for name, fn in kernels(heads, kv_heads, lengths, "cuda").items():
            row = {"layout": layout, "kernel": name}
            try:
                got, times = measure(fn, q, k, v, dout, args.iters)
            except (RuntimeError, NotImplementedError, ValueError) as e:  # a backend this GPU / torch / shape lacks
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                print(f"{layout:>10s} {name:>15s}  {row['error']}")
            else:
                if ref is None:
                    ref, ref_name = got, name
                row.update(times,
                           max_abs_diff=max((a.float() - b.float()).abs().max().item() for a, b in zip(got, ref)),
                           fwd_tflops=fwd_flops / times["fwd_ms"] / 1e9,
                           fwd_bwd_tflops=3.5 * fwd_flops / times["fwd_bwd_ms"] / 1e9)
                print(f"{layout:>10s} {name:>15s}  fwd {row['fwd_ms']:8.2f} ms {row['fwd_tflops']:6.0f} TF/s   "
                      f"fwd+bwd {row['fwd_bwd_ms']:8.2f} ms {row['fwd_bwd_tflops']:6.0f} TF/s   "
                      f"max|diff| vs {ref_name} {row['max_abs_diff']:.3g}")
            rows.append(row)
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
