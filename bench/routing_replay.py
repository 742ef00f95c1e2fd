"""MoE routing replay (R3): how often the engine's and the trainer's routers disagree, and what that does to the
train/rollout log-prob gap, without and with `trainer.routing_replay: rollout`.

A Qwen3-MoE-shaped model (random weights at a trained model's scale, or `--model PATH` for a real checkpoint) serves
two-turn episodes from `TransformersPolicy` (continuous batching: concurrent requests, left padding, a cached prefix
per session; temperature 1), with inserted tokens between the turns. The source of mismatch is the realistic one: the
engine runs in bfloat16 (`--engine-dtype`), the trainer (`TorchTrainer`) in float32, on different batch compositions.
For every loss token we compare the experts the trainer's forward chose (the forward that gives its log-prob, every MoE
layer) with the ones the engine recorded, and the trainer's log-prob with the engine's:

  decisions_differ   share of (token, MoE layer, top-k slot) whose expert is not in the engine's top-k set
  tokens_differ      share of loss tokens whose forward differs from the engine's in at least one MoE layer
  k3_kl              mean of exp(d) - 1 - d, d = logp_train - logp_rollout (k3 estimate of KL(rollout || train))
  max_abs_dlogp      max |logp_train - logp_rollout|

Prompt and inserted tokens are routed by the trainer in both cases (they are not replayed), so with R3 the remaining
gap is precision plus what their routing carries into later positions through attention.

  python bench/routing_replay.py                      # CPU: a small Qwen3-MoE shape
  python bench/routing_replay.py --device cuda --shape a3b-slice --episodes 64 --new-tokens 128
  python bench/routing_replay.py --device cuda --model /path/to/Qwen3-30B-A3B --episodes 16   # needs ~2x its bf16 size
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import time

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from slime_env.agents.routing_capture import RoutingCapture
from slime_env.agents.transformers_policy import TransformersPolicy
from slime_env.ledger import TokenLedger
from slime_env.trainers.batch import pack
from slime_env.trainers.torch_trainer import TorchTrainer, TrainerConfig
from slime_env.trajectory import Trajectory
from slime_env.types import Task

SHAPES = {  # Qwen3-30B-A3B: hidden 2048, 48 layers, 128 experts top-8, moe_intermediate 768, head_dim 128
    "small": dict(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=32, num_experts_per_tok=4),
    "a3b-slice": dict(vocab_size=4096, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                      num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                      num_experts=128, num_experts_per_tok=8),
}


class Tok:
    pad_token_id, eos_token_id = 0, 1

    def decode(self, ids, skip_special_tokens=False):
        return ""


def random_model(shape: str, seed: int) -> torch.nn.Module:
    cfg = Qwen3MoeConfig(**SHAPES[shape], max_position_embeddings=4096, norm_topk_prob=True, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():  # a trained model's scale: unit norms, weights ~ 1/sqrt(fan-in)
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)
    return model


def rollouts(engine: torch.nn.Module, episodes: int, new_tokens: int, vocab: int, seed: int) -> list[Trajectory]:
    policy = TransformersPolicy(engine, Tok(), max_batch_size=16, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    params = {"temperature": 1.0, "max_new_tokens": new_tokens, "ignore_eos": True}

    async def one(i: int) -> Trajectory:
        led = TokenLedger(torch.randint(2, vocab, (24 + i % 9,), generator=gen).tolist())
        inserted = torch.randint(2, vocab, (12,), generator=gen).tolist()
        for turn in range(2):
            g = await policy.generate(led.ids, params, session=f"s{i}")
            led.add_generated(g.token_ids, g.logprobs, turn, g.routed_experts)
            if turn == 0:
                led.add_inserted(inserted, turn)
        return Trajectory(task=Task(prompt="p", id=str(i)), prompt_ids=led.prompt_ids, response_ids=led.response_ids,
                          loss_mask=led.loss_mask, rollout_logprobs=led.rollout_logprobs, spans=led.spans,
                          turn_rewards=[0.0], reward=0.0, status="completed", routing=led.routing())

    async def main():
        return await asyncio.gather(*(one(i) for i in range(episodes)))
    return asyncio.run(main())


def measure(trainer: TorchTrainer, trajs: list[Trajectory], micro: int) -> dict[str, float]:
    cap = RoutingCapture(trainer.model)
    moe_layers = [i for i, layer in enumerate(trainer.model.model.layers) if hasattr(layer.mlp, "gate")]
    n_dec = n_diff = n_tok = n_tok_diff = 0
    k3, dmax, n_lp = 0.0, 0.0, 0
    try:
        for start in range(0, len(trajs), micro):
            batch = pack(trajs[start:start + micro], group_size=1, pad_id=0, routing=True)
            with torch.no_grad():
                lp = trainer.logprobs(trainer.model, batch).cpu()
            B, L = batch.input_ids.shape
            chosen = cap.rows(list(range(B * L))).reshape(B, L, cap.num_layers, cap.top_k).long()
            mask = batch.loss_mask.bool()
            src = torch.zeros_like(mask)
            src[:, :-1] = mask[:, 1:]  # the forward over column c - 1 gives token c's log-prob
            eng = batch.routed_experts.long()[src][:, moe_layers]  # [N, moe layers, k]
            mine = chosen[src][:, moe_layers]
            have = (eng >= 0).all(-1).all(-1)
            eng, mine = eng[have], mine[have]
            hit = (mine.unsqueeze(-1) == eng.unsqueeze(-2)).any(-1)  # each trainer slot's expert in the engine's set?
            n_dec += hit.numel()
            n_diff += int((~hit).sum())
            n_tok += hit.shape[0]
            n_tok_diff += int((~hit).flatten(1).any(-1).sum())
            d = lp[mask] - batch.rollout_logprobs[mask]
            k3 += float((torch.exp(d) - 1 - d).sum())
            dmax = max(dmax, float(d.abs().max()))
            n_lp += d.numel()
    finally:
        cap.close()
    return {"decisions_differ": n_diff / max(n_dec, 1), "tokens_differ": n_tok_diff / max(n_tok, 1),
            "k3_kl": k3 / max(n_lp, 1), "max_abs_dlogp": dmax, "loss_tokens": n_lp}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="small", choices=sorted(SHAPES))
    ap.add_argument("--model", default=None, help="a local Qwen3-MoE checkpoint instead of a random shape")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--engine-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    t0 = time.perf_counter()
    if args.model:
        model = Qwen3MoeForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).eval()
    else:
        model = random_model(args.shape, args.seed)
    engine = copy.deepcopy(model).to(device=args.device, dtype=getattr(torch, args.engine_dtype))
    trajs = rollouts(engine, args.episodes, args.new_tokens, model.config.vocab_size, args.seed)
    del engine
    model = model.to(args.device)
    results = {}
    for mode in ("off", "rollout"):
        trainer = TorchTrainer(model, TrainerConfig(routing_replay=mode), pad_id=0)
        if mode == "off":  # measure the decisions against the engine's without replaying them
            trainer.routing_shape = None
        results[mode] = measure(trainer, trajs, args.micro)
    c = model.config
    report = {"model": args.model or f"random Qwen3-MoE '{args.shape}'", "layers": c.num_hidden_layers,
              "experts": c.num_experts, "top_k": c.num_experts_per_tok, "engine_dtype": args.engine_dtype,
              "trainer_dtype": "float32", "device": args.device, "episodes": args.episodes,
              "without_r3": results["off"], "with_r3": results["rollout"], "seconds": time.perf_counter() - t0}
    print(f"{'':14}{'decisions_differ':>18}{'tokens_differ':>15}{'k3_kl':>12}{'max|dlogp|':>12}")
    for name, key in (("without R3", "off"), ("with R3", "rollout")):
        r = results[key]
        print(f"{name:14}{r['decisions_differ']:>18.4%}{r['tokens_differ']:>15.2%}{r['k3_kl']:>12.3e}"
              f"{r['max_abs_dlogp']:>12.4f}")
    print(json.dumps(report))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
