"""Weight sync with LoRA against full weights, into the embedded engine (SmolLM2-135M-Instruct, this machine's device).

For full fine-tuning and for a LoRA adapter (`--rank`, every linear layer) after one RL step: the bytes that leave the
trainer per sync, the seconds of the sync into a `TransformersPolicy` (full: the state dict copied in; LoRA: the
adapter merged into the engine's base copy), the seconds to write the adapter as a PEFT folder (what SGLang / vLLM /
serve-engine load), and the trainer's parameter + gradient + AdamW state bytes. Usage: python bench/lora_sync.py
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import tempfile
import time

import torch

from slime_env.agents import TransformersPolicy, load_default_model
from slime_env.trainers.torch_trainer import TorchTrainer, TrainerConfig


def trainer_state_bytes(trainer: TorchTrainer) -> dict[str, float]:
    params = list(trainer.model.parameters())
    trainable = [p for p in params if p.requires_grad]
    weights = sum(p.numel() * p.element_size() for p in params)
    grads = sum(p.numel() * p.element_size() for p in trainable)
    adam = sum(2 * p.numel() * 4 for p in trainable)  # exp_avg + exp_avg_sq, fp32
    return {"weights_mb": weights / 2**20, "grads_mb": grads / 2**20, "adam_mb": adam / 2**20,
            "total_mb": (weights + grads + adam) / 2**20, "trainable_params": sum(p.numel() for p in trainable)}


def _trajectories(n: int, vocab: int):
    import random

    from slime_env import Task, Trajectory
    from slime_env.ledger import Span

    rng = random.Random(0)
    out = []
    for i in range(n):
        prompt = [rng.randrange(vocab) for _ in range(8)]
        response = [rng.randrange(vocab) for _ in range(16)]
        out.append(Trajectory(task=Task(prompt="p"), prompt_ids=prompt, response_ids=response, loss_mask=[1] * 16,
                              rollout_logprobs=[-1.0] * 16, spans=[Span(0, "generated", 0, 16)],
                              turn_rewards=[float(i % 2)], reward=float(i % 2), status="completed"))
    return out


def run(rank: int, repeats: int) -> dict[str, dict[str, float]]:
    model, tok = load_default_model()
    engine = TransformersPolicy(copy.deepcopy(model), tok, batching="static")
    trajs = _trajectories(8, model.config.vocab_size)
    out = {}
    for mode in ("full", "lora"):
        lora = {"rank": rank, "alpha": 2 * rank, "target_modules": "all-linear"} if mode == "lora" else None
        trainer = TorchTrainer(copy.deepcopy(model), TrainerConfig(lr=1e-5, micro_batch_size=4, lora=lora), pad_id=0)
        trainer.step(trajs, group_size=4)
        times, nbytes = [], 0.0
        for v in range(repeats):
            t0 = time.perf_counter()
            asyncio.run(trainer.sync(engine, version=str(v + 1)))
            times.append(time.perf_counter() - t0)
        nbytes = trainer.adapter().nbytes if mode == "lora" else sum(
            t.numel() * t.element_size() for t in trainer.weights().values())
        row = {"sync_mb": nbytes / 2**20, "sync_s_median": sorted(times)[len(times) // 2],
               **trainer_state_bytes(trainer)}
        if mode == "lora":
            with tempfile.TemporaryDirectory() as d:
                t0 = time.perf_counter()
                trainer.adapter().save(d)
                row["peft_folder_write_s"] = time.perf_counter() - t0
        out[mode] = row
    engine.close()
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(json.dumps(run(args.rank, args.repeats), indent=1))
