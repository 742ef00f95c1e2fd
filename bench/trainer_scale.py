"""Trainers at scale on one GPU: long trajectories with activation recompute, an MoE model beside its dense
twin, FSDP2 beside Megatron. Random bf16 weights, the real RL step (`trainer.step`: packing, old log-probs
reused, loss, backward, optimizer), each timed after warm-up as the median of `--iters` steps.

- `long`: the ~1B Llama of bench/megatron_mfu.py, one trajectory of `--tokens` tokens (a quarter prompt, the rest
  generated); `recompute: none` beside `full`: seconds, tokens/s, MFU (model FLOPs of the tokens / time / spec
  peak), peak GPU memory.
- `longest`: with full recompute, the longest single trajectory whose step fits (doubling from 32k, then
  bisecting), for the 1B dense model and the MoE shape below.
- `moe`: a Qwen3-MoE shape (16 layers, hidden 1024, 16 heads / 4 KV, 16 experts of FFN 1024, top-2; ~0.9B total,
  ~0.2B active) beside the dense Qwen3 of the same active size (FFN 2048): tokens/s and MFU of active parameters.
- `fsdp`: the 1B shape, 16 sequences of 256..2048 tokens: `FSDPTrainer` (FSDP2, bf16 compute, fp32 params)
  beside `MegatronTrainer` on the same batch: seconds, tokens/s, MFU, peak memory.
- `two-gpu` (under `torchrun --nproc-per-node 2`): the `fsdp` batch with DP=2 beside PP=2 (1F1B over 8k-token
  micro-batches) and CP=2, all Megatron; then the longest single trajectory with CP=2 and full recompute beside
  the one-GPU `longest` figure. MFU is per GPU (model FLOPs / time / (2 x spec peak)).

Usage: python bench/trainer_scale.py [long] [longest] [moe] [fsdp] [--tokens 32768] [--iters 3]
       torchrun --nproc-per-node 2 bench/trainer_scale.py two-gpu
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.megatron_mfu import SHAPE, spec_peak, trajectories  # noqa: E402

MOE = dict(vocab_size=49152, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=1024,
           num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=16,
           num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=262144, tie_word_embeddings=True,
           rms_norm_eps=1e-6, router_aux_loss_coef=0.001)


def flops(c, lengths: list[int]) -> float:
    """6 x (active, non-embedding) parameters x tokens + causal attention, forward + backward."""
    h, layers = c.hidden_size, c.num_hidden_layers
    d = getattr(c, "head_dim", None) or h // c.num_attention_heads
    attn = h * (c.num_attention_heads * d + 2 * c.num_key_value_heads * d) + c.num_attention_heads * d * h
    if getattr(c, "num_experts", 0):
        mlp = 3 * h * c.moe_intermediate_size * c.num_experts_per_tok + h * c.num_experts
    else:
        mlp = 3 * h * c.intermediate_size
    n = layers * (attn + mlp) + h * c.vocab_size
    return 6.0 * n * sum(lengths) + 6.0 * layers * c.num_attention_heads * d * sum(s * s for s in lengths)


_built: dict[int, torch.nn.Module] = {}


def model(c, fresh: bool = False):
    """A random float32 HF model of config `c` on the CPU; kept for the next Megatron trainer (which copies its
    weights) unless `fresh` (FSDP shards the one it is given)."""
    from transformers import AutoModelForCausalLM

    if fresh or id(c) not in _built:
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(c, dtype=torch.float32)
        if fresh:
            return m
        _built.clear()
        _built[id(c)] = m
    return _built[id(c)]


def measure(make, c, lengths: list[int], iters: int) -> dict:
    """Build a trainer with `make()`, time `iters` steps after one warm-up; free it. An OOM is reported, not raised."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    trainer = None
    try:
        trainer = make()
        trajs = trajectories(lengths, c.vocab_size)
        trainer.step(trajs, group_size=len(trajs))
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            trainer.step(trajs, group_size=len(trajs))
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        s = statistics.median(times)
        return {"s": s, "tokens_s": sum(lengths) / s, "mfu": flops(c, lengths) / s / 1e12 / spec_peak(),
                "peak_gb": torch.cuda.max_memory_allocated() / 2**30}
    except torch.OutOfMemoryError:
        return {"oom": True, "peak_gb": torch.cuda.max_memory_allocated() / 2**30}
    finally:
        del trainer
        gc.collect()
        torch.cuda.empty_cache()


def megatron(c, **kw):
    from slime_env.trainers.megatron_trainer import MegatronTrainer
    from slime_env.trainers.torch_trainer import TrainerConfig

    def make():
        hf = model(c)
        return MegatronTrainer(hf, TrainerConfig(backend="megatron", lr=1e-6, **kw), pad_id=0)
    return make


def fsdp(c, **kw):
    from slime_env.trainers.fsdp_trainer import FSDPTrainer
    from slime_env.trainers.torch_trainer import TrainerConfig

    return lambda: FSDPTrainer(model(c, fresh=True), TrainerConfig(backend="fsdp", lr=1e-6, **kw), pad_id=0)


def row(name: str, r: dict) -> None:
    if r.get("oom"):
        print(f"{name:58s} {'OOM':>8s} {'':>10s} {'':>7s} {r['peak_gb']:8.1f}", flush=True)
    else:
        print(f"{name:58s} {r['s'] * 1e3:8.0f} {r['tokens_s']:10.0f} {r['mfu']:7.1%} {r['peak_gb']:8.1f}", flush=True)


def _fit(r: dict) -> str:
    return "OOM" if r.get("oom") else f"fits, peak {r['peak_gb']:.1f} GB"


def _say(line: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, once
        print(line, flush=True)


def longest(make_for, c, start: int = 32768, cap: int = 262144) -> int:
    """The longest single trajectory (tokens) whose step fits: doubling, then bisecting to 4k."""
    fits, fails = 0, None
    n = start
    while n <= cap and fails is None:
        r = measure(make_for(n), c, [n], 1)
        _say(f"  {n:7d} tokens: {_fit(r)}")
        if r.get("oom"):
            fails = n
        else:
            fits, n = n, n * 2
    while fails is not None and fails - fits > 4096:
        mid = (fits + fails) // 2 // 1024 * 1024
        r = measure(make_for(mid), c, [mid], 1)
        _say(f"  {mid:7d} tokens: {_fit(r)}")
        fits, fails = (fits, mid) if r.get("oom") else (mid, fails)
    return fits


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _reset_parallel() -> None:
    """Megatron's parallel groups torn down, so the next trainer can lay the same ranks out differently."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()


def two_gpu(iters: int) -> None:
    from transformers import LlamaConfig

    import torch.distributed as dist

    rank0 = int(os.environ.get("RANK", "0")) == 0
    world = _world()
    if world != 2:
        raise SystemExit("two-gpu: run under torchrun --nproc-per-node 2")
    c = LlamaConfig(**{**SHAPE, "max_position_embeddings": 1 << 20})
    rng = random.Random(0)
    lengths = [rng.randint(256, 2048) for _ in range(16)]
    for name, kw in (("DP=2", {}), ("PP=2 (1F1B)", {"pp": 2}), ("CP=2", {"cp": 2})):
        _reset_parallel()
        r = measure(megatron(c, max_tokens_per_micro_batch=8192, **kw), c, lengths, iters)
        if not r.get("oom"):
            r["mfu"] /= world
        if rank0:
            row(f"1B MegatronTrainer.step {name}, {sum(lengths)} tokens", r)
    _reset_parallel()
    if rank0:
        print("longest single trajectory, 1B dense, recompute full, CP=2:", flush=True)

    def make_for(t):
        _reset_parallel()
        return megatron(c, recompute="full", cp=2, max_tokens_per_micro_batch=t)

    best = longest(make_for, c, start=131072, cap=1 << 20)
    if rank0:
        print(f"  -> {best} tokens", flush=True)
    dist.barrier()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("parts", nargs="*", default=["long", "longest", "moe", "fsdp"])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()
    if "two-gpu" in args.parts:
        return two_gpu(args.iters)
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    dense1b = LlamaConfig(**{**SHAPE, "max_position_embeddings": 262144})
    print(f"{torch.cuda.get_device_name()}; MFU against the spec peak ({spec_peak():.0f} TFLOP/s); random bf16 weights")
    print(f"{'row':58s} {'ms':>8s} {'tokens/s':>10s} {'MFU':>7s} {'peak GB':>8s}")
    if "long" in args.parts:
        n = args.tokens
        budget = dict(max_tokens_per_micro_batch=n)
        for rc in ("none", "selective", "full"):
            row(f"1B dense, one {n}-token trajectory, recompute {rc}",
                measure(megatron(dense1b, recompute=rc, **budget), dense1b, [n], args.iters))
    if "longest" in args.parts:
        print("longest single trajectory, 1B dense, recompute full:")
        best = longest(lambda t: megatron(dense1b, recompute="full", max_tokens_per_micro_batch=t), dense1b)
        print(f"  -> {best} tokens")
        moe = Qwen3MoeConfig(**MOE)
        print("longest single trajectory, Qwen3-MoE shape (~0.2B active), recompute full:")
        best = longest(lambda t: megatron(moe, recompute="full", max_tokens_per_micro_batch=t), moe)
        print(f"  -> {best} tokens")
    if "moe" in args.parts:
        rng = random.Random(0)
        lengths = [rng.randint(1024, 4096) for _ in range(16)]
        moe, dense = Qwen3MoeConfig(**MOE), Qwen3Config(**{k: v for k, v in MOE.items() if k not in (
            "moe_intermediate_size", "num_experts", "num_experts_per_tok", "norm_topk_prob", "router_aux_loss_coef")})
        r_dense = measure(megatron(dense, max_tokens_per_micro_batch=16384), dense, lengths, args.iters)
        row(f"dense Qwen3 (FFN 2048, same active size), {sum(lengths)} tokens", r_dense)
        r_moe = measure(megatron(moe, max_tokens_per_micro_batch=16384), moe, lengths, args.iters)
        row(f"Qwen3-MoE 16 experts top-2 (active MFU), {sum(lengths)} tokens", r_moe)
        if not (r_moe.get("oom") or r_dense.get("oom")):
            print(f"MoE MFU / dense MFU: {r_moe['mfu'] / r_dense['mfu']:.2f}")
    if "fsdp" in args.parts:
        rng = random.Random(0)
        lengths = [rng.randint(256, 2048) for _ in range(16)]
        c = LlamaConfig(**SHAPE)
        r_meg = measure(megatron(c, max_tokens_per_micro_batch=40000), c, lengths, args.iters)
        row(f"1B MegatronTrainer.step, {sum(lengths)} tokens", r_meg)
        for mb, rc in ((4, "none"), (4, "full")):
            r = measure(fsdp(c, micro_batch_size=mb, recompute=rc), c, lengths, args.iters)
            row(f"1B FSDPTrainer.step (FSDP2, micro-batch {mb} rows, recompute {rc})", r)


if __name__ == "__main__":
    main()
