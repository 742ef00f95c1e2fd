"""One process of the expert-parallel LoRA check of `MegatronTrainer` on Qwen3-MoE, started under torchrun by
tests/test_megatron_lora.py (gloo on CPU, NCCL on GPUs; fp32, EP = `--ep`, TP = `--tp` with sequence parallel). `--dir`
holds `base/` (an HF model folder) and `moe/` (a PEFT adapter on the experts, the router and one projection of each
fused attention layer). Rank 0 writes `--dir/result.json` (the shapes of its local expert adapters, the KL reference's
and the policy's log-probs, one GRPO step's loss, KL and grad norm, the log-probs after it and after resuming from the
checkpoint `ckpt/`) and the adapter after the step, gathered over EP (`moe_after/`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

MOE = ["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "gate"]
LORA = dict(rank=4, alpha=8)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)  # with sequence parallel, as megatron's MoE layers need under TP
    ap.add_argument("--dir", required=True)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from helpers import trajectories
    from slime_env.trainers.batch import pack
    from slime_env.trainers.megatron_trainer import MegatronTrainer
    from slime_env.trainers.torch_trainer import TrainerConfig

    def trainer() -> MegatronTrainer:
        base = AutoModelForCausalLM.from_pretrained(os.path.join(args.dir, "base"), dtype=torch.float32)
        # the torch trainer adds no load-balancing loss: off here too, so the router adapters see the same gradient
        return MegatronTrainer(base, TrainerConfig(backend="megatron", dtype="float32", ep=args.ep, tp=args.tp,
                                                   sequence_parallel=args.tp > 1, lr=1e-2,
                                                   kl_coef=0.1, micro_batch_size=2, moe_aux_loss_coeff=0.0,
                                                   # a diagnosis on GPUs: the all-gather dispatcher (CPU's) there too
                                                   moe_token_dispatcher=os.environ.get("MOE_LORA_CHECK_DISPATCHER"),
                                                   lora=dict(LORA, target_modules=MOE)), pad_id=0)

    t = trainer()
    t.load(os.path.join(args.dir, "moe"))
    trajs = trajectories(8, seed=3)
    batch = pack(trajs, group_size=4, pad_id=0)
    mask = batch.loss_mask.bool()
    params = dict(t.model.named_parameters())
    out = {"local_fc1_A": list(params["decoder.layers.0.mlp.experts.fc1.lora_A"].shape),
           "local_fc2_B": list(params["decoder.layers.0.mlp.experts.fc2.lora_B"].shape),
           "expert_adapters_skip_dp": all(p.allreduce is False for n, p in params.items() if ".experts.fc" in n),
           "trainable": sorted(n for n, p in params.items() if p.requires_grad)}
    # megatron's gradient norm on GPUs (its distributed optimizer, which shards the expert gradients over the
    # expert-data-parallel group, TP ranks included) counts a parameter on TP ranks other than 0 only when it is marked
    # tensor-parallel: every expert parameter must count on every rank
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    counted = torch.tensor(float(all(param_is_not_tensor_parallel_duplicate(p, ps.get_tensor_model_parallel_group())
                                     for n, p in params.items() if ".experts." in n)), device=t.device)
    dist.all_reduce(counted, op=dist.ReduceOp.MIN)
    out["experts_in_every_ranks_norm"] = bool(counted.item())

    def everyone(lp: torch.Tensor) -> list[float]:  # a DP rank may score its own rows alone (zeros elsewhere)
        lp = lp.detach().to(t.device).contiguous()  # NCCL gathers device tensors (some log-probs come on the host)
        parts = [torch.empty_like(lp) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, lp)
        for p in parts[1:]:
            parts[0] = torch.where(parts[0] != 0, parts[0], p)
        return parts[0].cpu()[mask].tolist()

    out["reference"] = everyone(t.backend.reference_logprobs(batch))
    with torch.no_grad():
        out["before"] = everyone(t.logprobs(t.model, batch))
    m = t.step(trajs, group_size=4)
    out.update(loss=m["train/loss"], grad_norm=m["train/grad_norm"], kl=m["train/kl"])
    with torch.no_grad():
        out["after"] = everyone(t.logprobs(t.model, batch))
    after = t.adapter()  # a collective: every rank
    t.save(os.path.join(args.dir, "ckpt"))
    fresh = trainer()
    fresh.load(os.path.join(args.dir, "ckpt"))  # each EP rank takes its experts' share of the PEFT adapter
    with torch.no_grad():
        out["resumed"] = everyone(fresh.logprobs(fresh.model, batch))
    if dist.get_rank() == 0:
        after.save(os.path.join(args.dir, "moe_after"))
        out["parallel"] = t.parallel
        with open(os.path.join(args.dir, "result.json"), "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
