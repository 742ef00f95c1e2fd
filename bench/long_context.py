"""The Megatron trainer's full RL step at a real model's shape and long trajectories (issue: performance at the
shapes agentic RL runs at): tokens/s/GPU, MFU with and without recompute FLOPs, and peak GPU memory, with the LM
head's log-probs computed whole (`lm_head_chunk_tokens: 0`) beside in chunks (auto), in the same run.

Random bf16 weights at `--shape` (bench/shapes.py), `--seqs` sequences of `--tokens` tokens per rank (3/4 of each
trained), full activation recompute by default, megatron's distributed Adam. Under `torchrun --nproc-per-node N`
the step is DP = N on N times the sequences (each rank its own `--seqs`); with `--cp C` it is DP = N / C, each
sequence split over C GPUs (tokens/s/GPU and MFU then count each DP rank's tokens over its C GPUs). A mode that runs
out of memory is reported as such. `--kernels flash,auto` times the packed attention's kernels side by side
(`attention_kernel`; bench/attention.py times the kernels alone); `--recompute-method block --recompute-layers N`
recomputes only N layers, `--keep-attention` keeps attention outputs through the recompute (MFU "with recompute"
counts what runs). Usage:
    torchrun --nproc-per-node 4 bench/long_context.py --shape qwen3-4b --tokens 16384 --seqs 4
    python bench/long_context.py --shape qwen3-1.7b --tokens 65536 --seqs 1
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from megatron_mfu import spec_peak, trajectories  # noqa: E402 - the same random trajectories as its full-step row
from shapes import dense_flops, hf_config, model_class  # noqa: E402


def recompute_fields(args) -> dict:
    """The trainer's recompute fields from the flags (`--recompute-method block --recompute-layers N`: only the first
    N layers are recomputed; `--keep-attention`: recompute_attention false)."""
    out = {"recompute_method": args.recompute_method, "recompute_attention": not args.keep_attention}
    if args.recompute_layers is not None:
        out["recompute_layers"] = args.recompute_layers
    return out


def run_mode(args, cfg, chunk, kernel, info) -> dict:
    from slime_env.trainers.megatron_trainer import MegatronTrainer
    from slime_env.trainers.torch_trainer import TrainerConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        hf = model_class(args.shape)(cfg).to(dtype)
    trainer = MegatronTrainer(hf, TrainerConfig(backend="megatron", lr=1e-6, recompute=args.recompute,
                                                max_tokens_per_micro_batch=args.tokens, lm_head_chunk_tokens=chunk,
                                                attention_kernel=kernel, cp=args.cp, **recompute_fields(args)),
                              pad_id=0)
    del hf
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    trajs = trajectories([args.tokens] * (args.seqs * info["world"] // args.cp), cfg.vocab_size, seed=1)
    times, first = [], None
    try:
        if args.profile and device == "cuda":
            trainer.step(trajs, group_size=2)  # warm-up outside the profile
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                trainer.step(trajs, group_size=2)
                torch.cuda.synchronize()
            if info["rank"] == 0:
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.profile), flush=True)
        for i in range(args.warmup + args.iters):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            metrics = trainer.step(trajs, group_size=2)
            first = first or metrics  # the same weights in every mode: kernels compared by its loss and gradient
            if device == "cuda":
                torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
    except torch.OutOfMemoryError as e:
        return {"oom": str(e).splitlines()[0][:200]}
    finally:
        peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
        del trainer
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    seconds = statistics.median(times)
    lengths = [args.tokens] * args.seqs  # one DP rank's share, over its CP ranks
    gpu_s = seconds * args.cp  # GPU-seconds of a DP rank's step: its sequences take CP GPUs
    spec = spec_peak() if device == "cuda" else float("nan")
    model = dense_flops(cfg, lengths) / gpu_s / 1e12
    recomputed = args.recompute_layers if args.recompute_method == "block" else None
    hardware = dense_flops(cfg, lengths, recompute=args.recompute == "full", recomputed_layers=recomputed,
                           recompute_attention=not args.keep_attention) / gpu_s / 1e12
    return {"step_s": seconds, "tokens_per_s_per_gpu": sum(lengths) / gpu_s, "model_tflops": model,
            "mfu": model / spec, "mfu_with_recompute": hardware / spec, "peak_gib": peak,
            "first_loss": first["train/loss"], "first_grad_norm": first["train/grad_norm"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-4b")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per sequence")
    ap.add_argument("--seqs", type=int, default=4, help="sequences per DP rank")
    ap.add_argument("--cp", type=int, default=1, help="context parallel: each sequence split over CP GPUs")
    ap.add_argument("--recompute", default="full", choices=["none", "selective", "full"])
    ap.add_argument("--recompute-method", default="uniform", choices=["uniform", "block"],
                    help="block: only the first --recompute-layers layers are recomputed")
    ap.add_argument("--recompute-layers", type=int, default=None)
    ap.add_argument("--keep-attention", action="store_true",
                    help="recompute_attention: false (attention outputs kept through full recompute)")
    ap.add_argument("--modes", default="auto,0", help="lm_head_chunk_tokens values to run (auto = None)")
    ap.add_argument("--kernels", default="auto", help="attention_kernel values to run (auto, flash, cudnn)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (a quick check of the script)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="profile one step after a warm-up and print its N costliest CUDA kernels")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    from slime_env.trainers.megatron import init_parallel

    info = init_parallel(1, cp=args.cp)
    if args.seqs * info["world"] // args.cp % 2:
        raise SystemExit(f"--seqs {args.seqs} x {info['world'] // args.cp} DP ranks is odd: the step trains GRPO "
                         "groups of 2")
    cfg = hf_config(args.shape, **({"num_hidden_layers": args.layers} if args.layers else {}))
    rows = {}
    for kernel in args.kernels.split(","):
        for mode in args.modes.split(","):
            chunk = None if mode == "auto" else int(mode)
            rows[f"{kernel}/{mode}"] = row = run_mode(args, cfg, chunk, kernel, info)
            if info["rank"] == 0:
                print(json.dumps({"shape": args.shape, "gpus": info["world"], "cp": args.cp, "tokens": args.tokens,
                                  "seqs": args.seqs,
                                  "recompute": args.recompute, "attention_kernel": kernel,
                                  **recompute_fields(args),
                                  "lm_head_chunk_tokens": mode, **row}), flush=True)
    if args.out and info["rank"] == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
