"""The reward-model learning check on CPU: a classifier RM built here provides the whole reward of a GRPO run.

1. The RM: a rule mirrored into a model. SmolLM2-135M-Instruct samples replies to reasoning-gym `chain_sum` prompts
   (train seed); each is labelled by the rule "the reply puts one number inside <answer></answer>", with templated
   replies of both kinds added so both labels are well represented. A one-label `LlamaForSequenceClassification` on
   the SmolLM2 backbone gets its score head fitted (logistic regression on the frozen backbone's last-token state,
   the state that head reads), and is saved with its tokenizer: an RM folder like any other.
2. GRPO with `reward: {kind: classifier, env_weight: 0}`: the env's own reward is ignored; the RM's logit is the
   reward. Held-out: 200 problems of another seed, greedy, scored by the env with answers taken from <answer> tags
   only — so the accuracy rises only if the policy learns the format the RM rewards (and keeps the sums right).

Usage: python bench/learn_rm.py [--budget-min 10]; writes runs/learn_rm/. Needs reasoning-gym (the `math` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slime_env.trainers.run import TrainConfig, train  # noqa: E402

TASK = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
SYSTEM = "Answer the question. Put only the final number inside <answer></answer>."
RULE = re.compile(r"<answer>\s*-?\d+\s*</answer>")


async def sample_replies(n_prompts: int, n: int, device: str = "cpu") -> list[tuple[list[dict], str]]:
    """(conversation, reply) pairs of the base model at temperature 1 on train-seed prompts."""
    from slime_env.agents.policy_loader import load_policy
    from slime_env.envs.math.reasoning_gym_env import reasoning_gym_tasks

    from slime_env import Message, get_renderer

    policy, _ = load_policy("default", device=device, max_batch_size=64)
    renderer = get_renderer(policy.tokenizer)
    tasks = reasoning_gym_tasks("chain_sum", n_prompts, 11, TASK)
    out = []

    async def one(task, k):
        msgs = [Message("system", SYSTEM), Message("user", task.prompt)]
        gen = await policy.generate(renderer.render_prompt(msgs), {"temperature": 1.0, "max_new_tokens": 24,
                                                                   "sampling_seed": k})
        out.append(([m.to_dict() for m in msgs], renderer.assistant_text(gen.token_ids)))

    await asyncio.gather(*(one(t, i * n + k) for i, t in enumerate(tasks) for k in range(n)))
    policy.close()
    return out


def build_rm(pairs: list[tuple[list[dict], str]], folder: Path, seed: int = 0) -> dict[str, float]:
    """Fit the score head of a one-label classifier on the frozen SmolLM2 backbone; save it to `folder`."""
    import torch
    from slime_env.agents.default_model import default_model_path
    from transformers import LlamaForSequenceClassification

    from slime_env.offline_tokenizers import smollm2

    rng = random.Random(seed)
    data = []
    for msgs, reply in pairs:
        data.append((msgs, reply, float(bool(RULE.search(reply)))))
        n = rng.randint(2, 18)  # templated replies of both kinds: the rule, stated by examples
        data.append((msgs, f"{rng.choice(['', 'The sum is ', 'So '])}<answer>{n}</answer>", 1.0))
        data.append((msgs, rng.choice([f"The answer is {n}.", f"{n}", f"answer: {n}", "I think it is ten."]), 0.0))
    tok = smollm2()
    tok.padding_side = "right"
    model = LlamaForSequenceClassification.from_pretrained(str(default_model_path()), num_labels=1,
                                                           dtype=torch.float32).eval()
    model.config.pad_token_id = tok.eos_token_id
    texts = [tok.apply_chat_template(m + [{"role": "assistant", "content": r}], tokenize=False) for m, r, _ in data]
    feats = []
    with torch.inference_mode():
        for i in range(0, len(texts), 32):
            enc = tok(texts[i:i + 32], return_tensors="pt", padding=True, add_special_tokens=False)
            hidden = model.model(**enc).last_hidden_state
            last = enc["attention_mask"].sum(-1) - 1  # right padding: the last real token, as the head reads it
            feats.append(hidden[torch.arange(len(last)), last])
    x = torch.cat(feats)
    y = torch.tensor([label for _, _, label in data])
    w = torch.zeros(x.shape[1], requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=200, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ w, y) + 1e-3 * w.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        model.score.weight.copy_(w.detach()[None])
        acc = float((((x @ w) > 0).float() == y).float().mean())
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    sampled = [label for _, r, label in data[::3]]
    return {"rm/examples": float(len(data)), "rm/train_accuracy": acc,
            "rm/base_format_rate": sum(sampled) / len(sampled)}


def config(args, rm: str) -> TrainConfig:
    return TrainConfig.from_dict({
        "run_dir": args.run_dir, "model": "default", "env": "ReasoningGym-v0",
        "env_kwargs": {"dataset": "chain_sum", "answer_formats": ["answer_tag"], "system_prompt": SYSTEM},
        "train_data": {"reasoning_gym": {"dataset": "chain_sum", "size": 2000, "seed": 11, "config": TASK}},
        "eval_data": {"reasoning_gym": {"dataset": "chain_sum", "size": args.eval_size, "seed": 12, "config": TASK}},
        "steps": args.steps, "prompts_per_step": args.prompts, "n_samples_per_prompt": args.n,
        "max_new_tokens": 24, "temperature": 1.0, "eval_every": args.eval_every, "max_concurrency": 64,
        "time_budget_s": args.budget_min * 60, "seed": 0, "device": args.device,
        "trainer": {"estimator": "grpo", "lr": args.lr, "micro_batch_size": 16},
        "reward": {"kind": "classifier", "model": rm, "device": args.device, "batch_size": 32, "weight": 1.0,
                   "env_weight": 0.0},
    }, "bench/learn_rm.py")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100, help="upper bound; the time budget usually ends the run")
    ap.add_argument("--budget-min", type=float, default=10.0)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--eval-size", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=3)
    ap.add_argument("--rm-prompts", type=int, default=64)
    ap.add_argument("--run-dir", default="runs/learn_rm")
    ap.add_argument("--device", default="cpu", help="where the engine, the trainer and the RM run (cpu, cuda, auto)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    rm_dir = Path(args.run_dir) / "rm"
    stats = build_rm(asyncio.run(sample_replies(args.rm_prompts, 4, args.device)), rm_dir)
    print(f"RM built in {time.perf_counter() - t0:.0f}s: {json.dumps(stats)}")
    summary = asyncio.run(train(config(args, str(rm_dir))))
    rows = [json.loads(line) for line in open(summary["metrics"])]
    print("\nstep  elapsed_s  rm_score  env_reward(unused)  heldout_acc(<answer> only)")
    for r in rows:
        def f(key):
            return format(r[key], ".3f") if key in r else ""
        print(f"{r['step']:4d} {r.get('time/elapsed_s', 0):10.0f} {f('reward/rm_score_mean'):>9s} "
              f"{f('reward/env_reward_mean'):>19s} {f('eval/accuracy'):>26s}")
    gain = summary["last_accuracy"] - summary["first_accuracy"]
    print(f"\nheld-out accuracy {summary['first_accuracy']:.3f} -> {summary['last_accuracy']:.3f} "
          f"({gain * 100:+.1f} points) in {summary['elapsed_s'] / 60:.1f} min, rewards from the RM alone")


if __name__ == "__main__":
    main()
