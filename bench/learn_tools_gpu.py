"""The GPU tool-use learning check from a cold start, and on-policy distillation after it (one GPU).

`--phase cold-start`: SmolLM2-135M-Instruct on Calculator-v0 ("What is 47 * 12 + 31?", 2-3 operations on two-digit
numbers, a calculator tool in hermes format, up to 3 turns). The base model never calls the tool. An SFT warm-up
on a scripted teacher's successful episodes (`slime_env.envs.calculator:teacher_reply`, rejection-sampled: reward 1
only; train side of a fixed partition), then GRPO with the Megatron trainer and the embedded engine on the same GPU
until the budget. Held-out: 200 test-side problems (never in the SFT data or training), greedy; plus a sampled set (64
problems x 8 samples: pass@k, maj@8). Target: >= +30 points in <= 15 minutes, with the tool used in most solved
episodes (`eval/solved_with_tool`). Saves the final weights (checkpoints/) and its tokenizer: the OPD teacher.

`--task search` (with `--phase cold-start`): the same protocol on Search-v0 (Search-R1) over the offline demo corpus
(a BM25 retriever; "Which section of the Python language reference says: "…"", exact match on the section's title).
The scripted teacher (`slime_env.envs.search:teacher_reply`) searches for the quoted sentence and answers with the title
of the passage that contains it; it never sees the gold answer. Held-out: 200 questions of reference topics no training
question has as its answer (the split is by topic), so they are solved only by reading the search's results.
Target: >= +20 points of exact match in <= 15 minutes, with searches issued in most solved episodes.

`--phase opd --teacher PATH`: the base SmolLM2 as the student, the cold-start run's model as the teacher (loaded
next to the trainer), `opd_coef` 1 on top of GRPO. The student starts at reward 0 everywhere, so GRPO's groups have
no variance and the teacher's per-token signal is what it learns from. Reported: `opd/reverse_kl` falling and
held-out accuracy rising over steps.

Usage: python bench/learn_tools_gpu.py --phase cold-start [--task search] [--budget-min 8];
python bench/learn_tools_gpu.py --phase opd --teacher runs/learn_tools_gpu/checkpoints/step_N/model
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slime_env.trainers.run import TrainConfig, train  # noqa: E402

# task -> (env, its task generator, training tasks, max_turns, max_new_tokens, the scripted teacher)
TASKS = {"calculator": ("Calculator-v0", "slime_env.envs.calculator:calculator_tasks", 20000, 3, 64,
                        "slime_env.envs.calculator:teacher_reply"),
         "search": ("Search-v0", "slime_env.envs.search:search_tasks", 800, 4, 128,
                    "slime_env.envs.search:teacher_reply")}
TARGETS = {"calculator": " (target: >= +30 points within 15 min on one H100)",
           "search": " (target: >= +20 points of exact match within 15 min on one H100)"}


def config(args) -> TrainConfig:
    env, gen, n_train, max_turns, max_new, teacher = TASKS[args.task]
    cfg = {
        "run_dir": args.run_dir, "model": "default", "env": env,
        "train_data": {"generator": gen, "n": n_train, "seed": 1, "split": "train"},
        "eval_data": {"generator": gen, "n": args.eval_size, "seed": 2, "split": "test"},
        "eval": {"sets": {"sampled": {"data": {"generator": gen, "n": args.sampled_size, "seed": 3, "split": "test"},
                                      "n_samples": 8, "temperature": 1.0}}, "every": args.eval_every},
        "steps": args.steps, "prompts_per_step": args.prompts, "n_samples_per_prompt": args.n, "max_turns": max_turns,
        "max_new_tokens": max_new, "temperature": 1.0, "eval_every": args.eval_every, "max_concurrency": 512,
        "time_budget_s": args.budget_min * 60, "seed": 0, "device": "auto", "save_every": 10_000,
        "trainer": {"backend": args.backend, "estimator": "grpo", "lr": args.lr, "micro_batch_size": args.micro_batch,
                    "max_tokens_per_micro_batch": 16384, "max_grad_norm": 1.0},
    }
    if args.phase == "cold-start":
        cfg["warmup"] = {"steps": args.sft_steps, "lr": args.sft_lr, "batch_size": 64,
                         "data": {"rollouts": {"policy": teacher, "max_tasks": min(n_train, 1024),
                                               "min_reward": 1.0}}}
    else:
        cfg["trainer"]["opd_coef"] = args.opd_coef
        cfg["teacher"] = {"model": args.teacher}
    return TrainConfig.from_dict(cfg, "bench/learn_tools_gpu.py")


def plot_opd(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kl = [(r["step"], r["train/opd/reverse_kl"]) for r in rows if "train/opd/reverse_kl" in r]
    ev = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([s for s, _ in kl], [v for _, v in kl], color="tab:purple", label="reverse KL to the teacher (per token)")
    ax.set_xlabel("step")
    ax.set_ylabel("reverse KL")
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot([s for s, _ in ev], [v for _, v in ev], marker="o", color="tab:red", label="held-out accuracy (greedy)")
    ax2.set_ylim(-0.02, 1.02)
    ax2.set_ylabel("held-out accuracy")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="center right")
    ax.set_title("On-policy distillation: SmolLM2-135M student, the cold-start run as teacher")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", choices=["cold-start", "opd"], default="cold-start")
    ap.add_argument("--task", choices=sorted(TASKS), default="calculator")
    ap.add_argument("--teacher", default=None, help="opd: the teacher model folder (the cold-start run's)")
    ap.add_argument("--steps", type=int, default=400, help="upper bound; the time budget usually ends the run")
    ap.add_argument("--budget-min", type=float, default=8.0)
    ap.add_argument("--prompts", type=int, default=None, help="default: 32 (cold-start), 16 (opd)")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--lr", type=float, default=None, help="RL learning rate; default: 2e-6 (cold-start), 3e-5 (opd: "
                    "2e-6 left the reverse KL flat for 21 steps)")
    ap.add_argument("--sft-steps", type=int, default=30)
    ap.add_argument("--sft-lr", type=float, default=5e-5)
    ap.add_argument("--opd-coef", type=float, default=1.0)
    ap.add_argument("--micro-batch", type=int, default=64, help="rows per micro-batch (torch trainer)")
    ap.add_argument("--eval-size", type=int, default=200)
    ap.add_argument("--sampled-size", type=int, default=64, help="problems of the sampled eval set (8 samples each)")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--backend", default="megatron", choices=["megatron", "torch"])
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--copy-to", default=None, help="also copy the plot and metrics.jsonl into this folder")
    args = ap.parse_args()
    if args.phase == "opd" and not args.teacher:
        ap.error("--phase opd needs --teacher")
    if args.phase == "opd" and args.task != "calculator":
        ap.error("--phase opd is the calculator's (its teacher is the calculator cold-start run)")
    # the calculator's file names predate --task
    name = args.phase if args.task == "calculator" else f"{args.task}_{args.phase}"
    args.run_dir = args.run_dir or f"runs/learn_tools_gpu_{name}"
    cold = args.phase == "cold-start"
    args.lr = args.lr if args.lr is not None else (2e-6 if cold else 3e-5)
    args.prompts = args.prompts if args.prompts is not None else (32 if cold else 16)
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (no GPU: this check is meant for one)"
    summary = asyncio.run(train(config(args)))
    rows = [json.loads(line) for line in open(summary["metrics"])]
    print("\nstep  elapsed_s  train_reward  heldout_acc  solved_w_tool  tool_calls  sampled_pass@8  opd_rev_kl")
    for r in rows:
        def f(key, fmt=".3f"):
            return format(r[key], fmt) if key in r else ""
        print(f"{r['step']:4d} {r.get('time/elapsed_s', 0):10.0f} {f('train/reward_mean'):>13s} "
              f"{f('eval/accuracy'):>12s} {f('eval/solved_with_tool'):>14s} {f('eval/tool_calls_per_episode'):>11s} "
              f"{f('eval/sampled/pass@8'):>15s} {f('train/opd/reverse_kl', '.4f'):>11s}")
    gain = summary["last_accuracy"] - summary["first_accuracy"]
    print(f"\n{args.phase}: held-out accuracy {summary['first_accuracy']:.3f} -> "
          + (f"{summary['after_warmup_accuracy']:.3f} after SFT -> " if "after_warmup_accuracy" in summary else "")
          + f"{summary['last_accuracy']:.3f} ({gain * 100:+.1f} points) in {summary['elapsed_s'] / 60:.1f} min on "
          f"{device}, {args.backend} trainer"
          + (TARGETS[args.task] if cold else ""))
    ckpts = sorted(Path(args.run_dir, "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    if ckpts:
        from slime_env.offline_tokenizers import smollm2

        smollm2().save_pretrained(str(ckpts[-1] / "model"))  # the folder loads as a model (an OPD teacher)
        print(f"model: {ckpts[-1] / 'model'}")
    docs = Path(__file__).resolve().parents[1] / "docs" / f"learn_tools_gpu_{name}.png"
    if cold:
        shutil.copy(summary["curves"], docs)
    else:  # the reverse KL to the teacher beside the held-out accuracy
        plot_opd(rows, docs)
    if args.copy_to:
        os.makedirs(args.copy_to, exist_ok=True)
        shutil.copy(docs, os.path.join(args.copy_to, docs.name))
        shutil.copy(summary["metrics"], os.path.join(args.copy_to, f"learn_tools_gpu_{name}_metrics.jsonl"))


if __name__ == "__main__":
    main()
