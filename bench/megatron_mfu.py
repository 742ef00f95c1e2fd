"""MFU of the Megatron trainer on one GPU (and DP scaling on two), beside Hugging Face in the same run.

Model: a ~1B Llama shape (16 layers, hidden 2048, 32 heads / 8 KV heads, FFN 8192, vocab 49152), random
bf16 weights. Data: 16 sequences of lengths drawn uniformly from 256..2048 (seeded). Rows, each timed
after warm-up as the median of `--iters` runs:
- matmul peak: an 8192^3 bf16 matmul (the ceiling this GPU reaches here, beside its 989 TFLOP/s spec);
- megatron fwd+bwd packed (THD, varlen flash attention, our RoPE) and padded (bshd, right-padded to 2048);
- megatron full RL step: `MegatronTrainer.step` (packing, loss, DDP, distributed Adam) on those sequences;
- HF `LlamaForCausalLM` (sdpa) fwd+bwd padded, eager and with `torch.compile`.
MFU = model FLOPs of the real (unpadded) tokens / time / peak, model FLOPs = 6 * N * tokens (N without
the embedding table) + 6 * layers * hidden * sum(len^2) (causal attention, forward + backward).
`--dp` (under `torchrun --nproc-per-node 2`): the full step with DP=2 on the same global batch, tokens/s
beside one GPU's (measured by rank 0 alone first). Usage: python bench/megatron_mfu.py [--skip-hf]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

SPEC_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}
SHAPE = dict(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=1e-5)


def timed(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def model_flops(cfg, lengths: list[int]) -> float:
    h, layers, ffn, v = cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size, cfg.vocab_size
    d = h // cfg.num_attention_heads
    per_layer = h * (h + 2 * cfg.num_key_value_heads * d) + h * h + 3 * h * ffn
    n = layers * per_layer + h * v  # the LM head is a matmul; the embedding lookup is not
    return 6.0 * n * sum(lengths) + 6.0 * layers * h * sum(s * s for s in lengths)


def matmul_peak() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192 ** 3 / timed(lambda: a @ b, 10) / 1e12


def spec_peak() -> float:
    name = torch.cuda.get_device_name()
    return next((v for k, v in SPEC_TFLOPS.items() if k in name), float("nan"))


def trajectories(lengths: list[int], vocab: int, seed: int = 0):
    from slime_env import Task
    from slime_env.ledger import Span
    from slime_env.trajectory import Trajectory

    rng = random.Random(seed)
    out = []
    for i, n in enumerate(lengths):
        p = n // 4
        ids = [rng.randrange(vocab) for _ in range(n)]
        out.append(Trajectory(task=Task(prompt="p"), prompt_ids=ids[:p], response_ids=ids[p:], loss_mask=[1] * (n - p),
                              rollout_logprobs=[-1.0] * (n - p), spans=[Span(0, "generated", 0, n - p)],
                              turn_rewards=[float(i % 2)], reward=float(i % 2), status="completed"))
    return out


def megatron_rows(cfg, lengths, iters, report) -> None:
    from megatron.core.packed_seq_params import PackedSeqParams
    from slime_env.trainers.megatron import build_gpt, init_parallel

    init_parallel(1)
    model = build_gpt(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    g = torch.Generator(device="cuda").manual_seed(0)
    total, longest = sum(lengths), max(lengths)
    ids = torch.randint(0, cfg.vocab_size, (1, total), device="cuda", generator=g)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device="cuda")
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                             max_seqlen_kv=longest)

    def packed_step():
        loss = model(input_ids=ids, position_ids=None, attention_mask=None, labels=ids, packed_seq_params=packed)
        loss.float().mean().backward()

    report("megatron fwd+bwd packed (THD)", timed(packed_step, iters), lengths)
    padded = torch.randint(0, cfg.vocab_size, (len(lengths), 2048), device="cuda", generator=g)
    mask = torch.arange(2048, device="cuda")[None] < torch.tensor(lengths, device="cuda")[:, None]

    def padded_step():  # two micro-batches of 8 rows: 16 x 2048 padded tokens do not fit at once
        for rows in (slice(0, 8), slice(8, 16)):
            loss = model(input_ids=padded[rows], position_ids=None, attention_mask=None, labels=padded[rows])
            (loss.float() * mask[rows]).mean().backward()

    report("megatron fwd+bwd padded (bshd, 2 x 8 rows)", timed(padded_step, iters), lengths)


def full_step_row(cfg, lengths, iters, report, label="megatron full RL step (MegatronTrainer.step)") -> float:
    from slime_env.trainers.megatron_trainer import MegatronTrainer
    from slime_env.trainers.torch_trainer import TrainerConfig
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg)
    trainer = MegatronTrainer(hf, TrainerConfig(backend="megatron", lr=1e-6, max_tokens_per_micro_batch=40000),
                              pad_id=0)
    del hf
    trajs = trajectories(lengths, cfg.vocab_size)
    seconds = timed(lambda: trainer.step(trajs, group_size=len(trajs)), iters, warmup=2)
    report(label, seconds, lengths)
    return seconds


def hf_rows(cfg, lengths, iters, report) -> None:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    model.config._attn_implementation = "sdpa"
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (len(lengths), 2048), device="cuda", generator=g)
    mask = (torch.arange(2048, device="cuda")[None] < torch.tensor(lengths, device="cuda")[:, None]).long()

    def step(m):
        def run():
            for rows in (slice(0, 8), slice(8, 16)):
                labels = ids[rows].masked_fill(mask[rows] == 0, -100)
                out = m(input_ids=ids[rows], attention_mask=mask[rows], labels=labels)
                out.loss.backward()
        return run

    report("HF LlamaForCausalLM sdpa fwd+bwd padded (2 x 8)", timed(step(model), iters), lengths)
    compiled = torch.compile(model)
    report("HF LlamaForCausalLM sdpa + torch.compile", timed(step(compiled), iters, warmup=3), lengths)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--dp", action="store_true", help="DP scaling (run under torchrun --nproc-per-node 2, with "
                    "ONE_GPU_STEP_S from --full-step-only in the environment)")
    ap.add_argument("--full-step-only", action="store_true", help="print only the one-GPU full step's seconds")
    args = ap.parse_args()
    from transformers import LlamaConfig

    cfg = LlamaConfig(**SHAPE)
    rng = random.Random(0)
    lengths = [rng.randint(256, 2048) for _ in range(16)]
    if args.dp:
        return dp_scaling(cfg, lengths, args.iters)
    if args.full_step_only:
        seconds = full_step_row(cfg, lengths, args.iters, lambda *a: None)
        print(f"{seconds:.6f}")
        return
    peak, spec = matmul_peak(), spec_peak()
    print(f"{torch.cuda.get_device_name()}: matmul peak {peak:.0f} TFLOP/s (spec {spec:.0f}); "
          f"{len(lengths)} sequences, "
          f"{sum(lengths)} tokens (lengths 256..2048), ~{model_flops(cfg, [1]) / 6 / 1e9:.2f}B params")
    print(f"{'row':48s} {'ms':>8s} {'tokens/s':>10s} {'TFLOP/s':>8s} {'MFU spec':>9s} {'MFU meas.':>9s}")

    def report(name, seconds, lens):
        tflops = model_flops(cfg, lens) / seconds / 1e12
        print(f"{name:48s} {seconds * 1e3:8.1f} {sum(lens) / seconds:10.0f} {tflops:8.1f} {tflops / spec:9.1%} "
              f"{tflops / peak:9.1%}", flush=True)

    megatron_rows(cfg, lengths, args.iters, report)
    torch.cuda.empty_cache()  # the model of those rows is gone with the function
    full_step_row(cfg, lengths, args.iters, report)
    if not args.skip_hf:
        torch.cuda.empty_cache()
        hf_rows(cfg, lengths, args.iters, report)


def dp_scaling(cfg, lengths, iters) -> None:
    """Under torchrun: tokens/s of the full step with DP = world size, against one GPU's in a single process."""
    import torch.distributed as dist
    from slime_env.trainers.megatron import init_parallel

    info = init_parallel(1)
    rows = []

    def report(name, seconds, lens):
        rows.append((name, seconds))
        if info["rank"] == 0:
            print(f"{name}: {seconds * 1e3:.1f} ms, {sum(lens) / seconds:.0f} tokens/s", flush=True)

    full_step_row(cfg, lengths * info["world"], iters, report, label=f"DP={info['world']} full step, global batch "
                  f"{len(lengths) * info['world']} sequences")
    dist.barrier()
    if info["rank"] == 0:
        one = float(os.environ.get("ONE_GPU_STEP_S", "nan"))
        if one == one:
            print(f"scaling: {one * info['world'] / rows[0][1]:.2f}x one GPU's tokens/s "
                  f"(one GPU: {len(lengths)} sequences in {one * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
