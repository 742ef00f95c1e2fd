"""One process of a DP / TP check of `MegatronTrainer`, started under torchrun by tests/test_megatron.py (CPU,
gloo, fp32) and tests/gpu/test_megatron_gpu.py (GPUs, NCCL, bf16), or alone for the one-process reference.
Trains one GRPO step of a small random Llama on a fixed global batch with the given TP / CP / EP sizes (DP = world /
(TP x CP))
and writes, from rank 0, JSON: the gradient norm and loss, the packed log-probs before the step, and a
checksum of every parameter on every rank (gathered)."""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

SHAPE = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=False)
# Qwen3-MoE: 8 experts, top-2, one dense layer among three; no load-balancing loss, whose value depends on which
# tokens share a micro-batch (so it differs between layouts by design).
MOE_SHAPE = dict({k: v for k, v in SHAPE.items() if k != "num_hidden_layers"}, moe_intermediate_size=64, num_experts=8,
                 num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], head_dim=32, router_aux_loss_coef=0.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--tied", action="store_true", help="tie the embedding and the LM head (as SmolLM2 does)")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--ppo", action="store_true", help="estimator ppo: the critic trains beside the policy")
    ap.add_argument("--sp", action="store_true", help="sequence parallel over the TP group")
    ap.add_argument("--moe", action="store_true", help="a small Qwen3-MoE instead of a Llama")
    ap.add_argument("--backend", default="megatron", choices=["megatron", "fsdp", "torch"])
    ap.add_argument("--recompute", default="none")
    ap.add_argument("--keep-attention", action="store_true", help="recompute_attention: false (with --recompute full)")
    ap.add_argument("--failed", type=int, default=0, help="the last N trajectories failed (no loss tokens): those "
                    "micro-batches are idle on the rank that holds them")
    ap.add_argument("--lora", action="store_true", help="trainer.lora (torch / fsdp): only an adapter trains; also "
                    "reports the adapter, whether the base moved, the optimizer's parameters and (fsdp) a checkpoint "
                    "round trip into a fresh trainer")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from slime_env.trainers.batch import pack
    from slime_env.trainers.megatron.attention import SDPAttention
    from slime_env.trainers.megatron_trainer import MegatronTrainer
    from slime_env.trainers.torch_trainer import TrainerConfig
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from helpers import trajectories

    torch.manual_seed(0)
    shape = dict(SHAPE, tie_word_embeddings=args.tied, num_hidden_layers=args.layers)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**MOE_SHAPE, num_hidden_layers=args.layers)) if args.moe else \
        LlamaForCausalLM(LlamaConfig(**shape))
    common = dict(lr=1e-4, recompute=args.recompute, micro_batch_size=2, estimator="ppo" if args.ppo else "grpo")
    if args.lora:  # a larger rate, so the adapter's B (zero at the start) moves visibly in one step; a KL term
        common.update(lr=1e-2, kl_coef=0.1, lora={"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj",
                                                                                           "up_proj"]})
        base = {k: v.clone() for k, v in hf.state_dict().items()}
    if args.backend == "megatron":
        trainer = MegatronTrainer(hf, TrainerConfig(backend="megatron", tp=args.tp, ep=args.ep, cp=args.cp, pp=args.pp,
                                                    max_tokens_per_micro_batch=64,
                                                    sequence_parallel=args.sp,
                                                    recompute_attention=not args.keep_attention, **common), pad_id=0)
    elif args.backend == "fsdp":
        from slime_env.trainers.fsdp_trainer import FSDPTrainer

        trainer = FSDPTrainer(hf, TrainerConfig(backend="fsdp", **common), pad_id=0)
    else:
        from slime_env.trainers.distributed import init_process_group
        from slime_env.trainers.torch_trainer import TorchTrainer

        init_process_group()
        trainer = TorchTrainer(hf, TrainerConfig(**common), pad_id=0)
    trajs = trajectories(16, seed=7, vocab=SHAPE["vocab_size"])
    if args.failed:
        from dataclasses import replace

        trajs = trajs[:-args.failed] + [replace(t, status="failed") for t in trajs[-args.failed:]]
    batch = pack(trajs, group_size=4, pad_id=0)
    with torch.no_grad():
        lp = trainer.logprobs(trainer.model, batch).float().cpu()
    metrics = trainer.step(trajs, group_size=4)
    with torch.no_grad():  # scored by the updated weights (under PP: the last stage's copy of a tied embedding)
        lp_after = trainer.logprobs(trainer.model, batch).float().cpu()
    sums = [float(p.detach().double().sum()) for p in trainer.model.parameters()] if args.backend != "fsdp" else [0.0]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sums)  # pipeline stages hold different parameters
    stepped = sum(p.numel() for g in trainer.optimizer.param_groups for p in g["params"]) \
        if args.backend == "megatron" else 0
    stepped_by: list = [None] * dist.get_world_size()  # the parameter elements each rank's optimizer holds state for
    dist.all_gather_object(stepped_by, stepped)
    w = trainer.weights()  # the full HF weights after the step, gathered over TP / EP / FSDP (every rank joins)
    lora = {}
    if args.lora:
        from slime_env.trainers.lora import base_weights

        names = {id(p): n for n, p in trainer.model.named_parameters()}
        after = base_weights(trainer.model, trainer.backend.model_state())  # gathered, every rank joins
        lora = {"adapter_sums": {k: float(v.double().sum()) for k, v in trainer.adapter().tensors.items()},
                "base_moved": [k for k in base if not torch.equal(after[k].cpu(), base[k])],
                "optimizer_params": [names[id(p)] for g in trainer.optimizer.param_groups for p in g["params"]]}
        if args.backend == "fsdp":
            torch.manual_seed(0)  # the same base weights: a LoRA checkpoint holds the adapter alone
            lora["round_trip"] = round_trip(trainer, LlamaForCausalLM(LlamaConfig(**shape)), args.out + ".ckpt")
    if dist.get_rank() == 0:
        mask = batch.loss_mask.bool()
        with open(args.out, "w") as f:
            json.dump({"grad_norm": metrics["train/grad_norm"], "loss": metrics["train/loss"],
                       "value_loss": metrics.get("train/value_loss"),
                       "critic_grad_norm": metrics.get("train/critic_grad_norm"),
                       "weight_sums": {k: float(v.double().sum()) for k, v in w.items()},
                       "logprobs": lp[mask].tolist(), "logprobs_after": lp_after[mask].tolist(), "param_sums": gathered,
                       "parallel": getattr(trainer, "parallel", {"world": dist.get_world_size()}),
                       "stepped_by": stepped_by, "trainable": sum(p.numel() for p in trainer.model.parameters()),
                       "kept_calls": SDPAttention.kept_calls, "layers": args.layers, **lora}, f)
    dist.barrier()
    dist.destroy_process_group()


def round_trip(trainer, fresh_model, path: str) -> dict:
    """Save `trainer`, load the checkpoint into a fresh trainer of the same config over the same ranks: whether the
    adapter, this step count and every rank's optimizer shard came back equal (all ranks must agree)."""
    from slime_env.trainers.fsdp_trainer import FSDPTrainer

    trainer.save(path)
    fresh = FSDPTrainer(fresh_model, trainer.config, pad_id=0)
    fresh.load(path)
    a, b = trainer.adapter().tensors, fresh.adapter().tensors
    local = [{k: v.to_local() if hasattr(v, "to_local") else v for k, v in st.items()}
             for st in (t.optimizer.state_dict()["state"] for t in (trainer, fresh))]
    same_optimizer = local[0].keys() == local[1].keys() and all(
        torch.equal(local[0][i][k], local[1][i][k]) for i in local[0] for k in local[0][i])
    flags = torch.tensor([float(same_optimizer)], device=trainer.device)  # NCCL reduces CUDA tensors only
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    return {"adapter": a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a),
            "optimizer": bool(flags.item()), "step": fresh.step_count, "files": sorted(os.listdir(path))}


if __name__ == "__main__":
    main()
