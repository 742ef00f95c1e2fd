"""One process of the LoRA check of `MegatronTrainer`, started under torchrun by tests/test_megatron_lora.py (gloo on
CPU, NCCL on GPUs; fp32) with TP or PP = 2. `--dir` holds what the test prepared: `base/` (an HF model folder),
`single/` and `all/` (PEFT adapters: one projection per fused layer, and every projection with the fused layers' A
shared). Rank 0
writes `--dir/result.json` and the adapter folders named below; the test compares them with `TorchTrainer` and peft.

1. `single` loaded, the KL reference's and the policy's log-probs, one GRPO step with a KL term (loss, grad norm, KL),
   the base weights after it, the checkpoint `ckpt/` (adapter + optimizer) and the log-probs after the step; the
   same step under sequence parallel when TP > 1 (else again without; its adapter after the step: `sp_after/`).
2. A fresh trainer resumes from `ckpt/`: its log-probs; both take one more step; their adapters then.
3. `all` loaded and exported again (`all_export/`), one step, the adapter (`all_after/`) and log-probs after it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

SINGLE = ["q_proj", "o_proj", "up_proj", "down_proj"]
LORA = dict(rank=4, alpha=8)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--dir", required=True)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from helpers import trajectories
    from slime_env.trainers.batch import pack
    from slime_env.trainers.megatron_trainer import MegatronTrainer
    from slime_env.trainers.torch_trainer import TrainerConfig

    def trainer(targets, kl_coef=0.0, sp=False):
        base = AutoModelForCausalLM.from_pretrained(os.path.join(args.dir, "base"), dtype=torch.float32)
        cfg = TrainerConfig(backend="megatron", dtype="float32", tp=args.tp, pp=args.pp, sequence_parallel=sp, lr=1e-2,
                            kl_coef=kl_coef, micro_batch_size=2, max_tokens_per_micro_batch=64,
                            lora=dict(LORA, target_modules=targets))
        return MegatronTrainer(base, cfg, pad_id=0)

    def lp(t, batch):
        with torch.no_grad():
            return t.logprobs(t.model, batch).cpu()[batch.loss_mask.bool()].tolist()

    out: dict = {}
    trajs, more = trajectories(8, seed=3), trajectories(8, seed=4)
    batch = pack(trajs, group_size=4, pad_id=0)
    t = trainer(SINGLE, kl_coef=0.1)
    t.load(os.path.join(args.dir, "single"))
    # On CUDA megatron's optimizer holds fp32 main copies of the parameters, not the parameters: what it trains is
    # named by the trainable parameters, and its element count must be theirs.
    trainable = {n: p for n, p in t.model.named_parameters() if p.requires_grad}
    out["optimizer_params"] = sorted({n.split(".", 3)[-1] for n in trainable})
    out["optimizer_numel_is_the_adapters"] = (sum(p.numel() for g in t.optimizer.param_groups for p in g["params"])
                                              == sum(p.numel() for p in trainable.values()))
    base_before = {k: v.clone() for k, v in t.hf_state_dict().items()}
    out["reference"] = t.backend.reference_logprobs(batch).cpu()[batch.loss_mask.bool()].tolist()
    out["before"] = lp(t, batch)
    m = t.step(trajs, group_size=4)
    out.update(loss=m["train/loss"], grad_norm=m["train/grad_norm"], kl=m["train/kl"])
    base_after = t.hf_state_dict()
    out["base_unchanged"] = all(torch.equal(base_before[k], base_after[k]) for k in base_before)
    t.save(os.path.join(args.dir, "ckpt"))
    out["after"] = lp(t, batch)
    sp = trainer(SINGLE, kl_coef=0.1, sp=args.tp > 1)
    sp.load(os.path.join(args.dir, "single"))
    m = sp.step(trajs, group_size=4)
    out.update(sp_loss=m["train/loss"], sp_grad_norm=m["train/grad_norm"], sp_kl=m["train/kl"])
    sp_after = sp.adapter()
    del sp

    fresh = trainer(SINGLE, kl_coef=0.1)
    fresh.load(os.path.join(args.dir, "ckpt"))
    out["resumed_step"], out["resumed"] = fresh.step_count, lp(fresh, batch)
    t.step(more, group_size=4)
    fresh.step(more, group_size=4)
    a, b = t.adapter(), fresh.adapter()
    out["resumed_adapter_gap"] = max(float((a.tensors[k] - b.tensors[k]).abs().max()) for k in a.tensors)
    del t, fresh

    t = trainer("all-linear")
    t.load(os.path.join(args.dir, "all"))
    exported = t.adapter()
    t.step(trajs, group_size=4)
    after = t.adapter()
    out["all_after"] = lp(t, batch)
    if dist.get_rank() == 0:
        exported.save(os.path.join(args.dir, "all_export"))
        sp_after.save(os.path.join(args.dir, "sp_after"))
        after.save(os.path.join(args.dir, "all_after"))
        out["parallel"] = t.parallel
        with open(os.path.join(args.dir, "result.json"), "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
