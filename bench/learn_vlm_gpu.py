"""The vision learning check: SFT warm-up, then GRPO, on VisualReasoning-v0 with the stitched SmolVLM.

Model: `vision_models.stitched_smolvlm` — SmolLM2-135M-Instruct's real text weights, a random 2-layer vision tower and
pixel-shuffle connector (128-pixel tiles, 16 image tokens). The engine is the embedded `VisionPolicy` (bf16 on CUDA)
and the trainer `TorchTrainer` (fp32) on the same GPU; weights go into the engine in place after every step.
Tasks: pictures drawn with Pillow (`--kinds`, default count + bars), answers checked by rule; held-out: pictures on the
test side of a fixed partition, greedy. Phases: held-out accuracy of the stitched model; SFT on a scripted teacher's
episodes (the drawn answer as `<answer>X</answer>`: the images go through the same ledger); GRPO (n samples per
prompt) until `--budget-min`. Target: >= 20 points of held-out lift on one H200. Writes OUT/summary.json.
Usage: python bench/learn_vlm_gpu.py [--budget-min 5] [--tiny] (`--tiny`: the random tiny Idefics3, a CPU dry run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import slime_env  # noqa: E402
from slime_env import ScriptedPolicy, run_episode  # noqa: E402
from slime_env.envs.vision import visual_tasks  # noqa: E402
from slime_env.renderers import get_renderer  # noqa: E402


def build(args):
    import torch
    from transformers import Idefics3ForConditionalGeneration

    from slime_env.agents.vision_models import smolvlm_path, tiny_idefics3
    from slime_env.agents.vision_policy import VisionPolicy
    from slime_env.trainers.torch_trainer import TorchTrainer, TrainerConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine_dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.tiny:
        model, proc = tiny_idefics3(image_size=args.image_size, patch_size=args.image_size // 4)
    else:
        path = smolvlm_path(args.image_size)
        from transformers import AutoProcessor

        model = Idefics3ForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32)
        proc = AutoProcessor.from_pretrained(str(path))
    import copy

    engine_model = copy.deepcopy(model).to(device, engine_dtype).eval()
    policy = VisionPolicy(engine_model, proc, max_batch_size=args.max_batch, seed=0)
    config = TrainerConfig(lr=args.lr, micro_batch_size=args.micro_batch, max_grad_norm=1.0)
    trainer = TorchTrainer(model.to(device), config, pad_id=proc.tokenizer.pad_token_id)
    return policy, proc, trainer, device


async def episodes(policy, renderer, tasks, *, temperature: float, n: int = 1, limit: int = 256):
    sem = asyncio.Semaphore(limit)

    async def one(task):
        async with sem:
            env = slime_env.make("VisualReasoning-v0")
            return await run_episode(env, policy, task, renderer=renderer, max_new_tokens=12,
                                     sampling_params={"temperature": temperature})
    return await asyncio.gather(*(one(t) for t in tasks for _ in range(n)))


async def accuracy(policy, renderer, tasks) -> float:
    trajs = await episodes(policy, renderer, tasks, temperature=0.0)
    return sum(t.reward for t in trajs) / len(trajs)


async def main_async(args) -> dict:
    t0 = time.perf_counter()
    policy, proc, trainer, device = build(args)
    renderer = get_renderer(proc)
    kinds = args.kinds
    test = visual_tasks(args.eval_size, seed=12, kinds=kinds, split="test", size=args.image_size)
    train = visual_tasks(4096, seed=11, kinds=kinds, split="train", size=args.image_size)
    log: dict = {"device": device, "kinds": kinds, "phases": []}

    def note(phase, acc, **kw):
        row = {"phase": phase, "heldout_accuracy": acc, "elapsed_s": round(time.perf_counter() - t0, 1), **kw}
        log["phases"].append(row)
        print(json.dumps(row), flush=True)

    note("stitched", await accuracy(policy, renderer, test))
    # SFT warm-up: a scripted teacher that answers each task's drawn label; its episodes carry the images
    sft_tasks = train[:args.sft_tasks]
    teacher = []
    for task in sft_tasks:
        script = ScriptedPolicy(proc.tokenizer, [f" <answer>{task.label}</answer>"],
                                end_token_id=renderer.end_of_turn_id)
        teacher += await episodes(script, renderer, [task], temperature=1.0)
    rng = random.Random(0)
    for step in range(args.sft_steps):
        batch = rng.sample(teacher, min(args.sft_batch, len(teacher)))
        m = await asyncio.to_thread(trainer.sft_step, batch, lr=args.sft_lr)
        if step % 20 == 0:
            print(f"sft step {step}: loss {m['sft/loss']:.4f}", flush=True)
    await trainer.sync(policy, version="sft")
    note("sft", await accuracy(policy, renderer, test), sft_steps=args.sft_steps)
    # GRPO
    deadline = t0 + args.budget_min * 60
    step = 0
    while time.perf_counter() < deadline and step < args.grpo_steps:
        prompts = rng.sample(train, args.prompts)
        trajs = await episodes(policy, renderer, prompts, temperature=1.0, n=args.n)
        m = await asyncio.to_thread(trainer.step, list(trajs), args.n)
        await trainer.sync(policy, version=str(step + 1))
        step += 1
        print(f"grpo step {step}: reward {m['train/reward_mean']:.3f} gap {m['train/rollout_logprob_gap']:.2e} "
              f"grad {m['train/grad_norm']:.3f}", flush=True)
        if step % args.eval_every == 0:
            note("grpo", await accuracy(policy, renderer, test), step=step)
    if not log["phases"][-1].get("step") == step:
        note("grpo", await accuracy(policy, renderer, test), step=step)
    first, last = log["phases"][0]["heldout_accuracy"], log["phases"][-1]["heldout_accuracy"]
    sft = log["phases"][1]["heldout_accuracy"]
    log.update(lift_points=round(100 * (last - first), 1), grpo_lift_points=round(100 * (last - sft), 1),
               wall_s=round(time.perf_counter() - t0, 1))
    policy.close()
    return log


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="count,bars")
    ap.add_argument("--image-size", type=int, default=128)
    ap.add_argument("--eval-size", type=int, default=200)
    ap.add_argument("--sft-tasks", type=int, default=1024)
    ap.add_argument("--sft-steps", type=int, default=150)
    ap.add_argument("--sft-batch", type=int, default=64)
    ap.add_argument("--sft-lr", type=float, default=1e-4)
    ap.add_argument("--grpo-steps", type=int, default=30)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--micro-batch", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--budget-min", type=float, default=5.0)
    ap.add_argument("--tiny", action="store_true", help="the random tiny Idefics3 (a CPU dry run of the script)")
    ap.add_argument("--out", default="runs/learn_vlm_gpu")
    args = ap.parse_args()
    log = asyncio.run(main_async(args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps({**log, "args": vars(args)}, indent=1))
    print(json.dumps({k: log[k] for k in ("lift_points", "grpo_lift_points", "wall_s")}))


if __name__ == "__main__":
    main()
