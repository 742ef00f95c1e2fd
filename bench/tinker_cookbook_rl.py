"""tinker-cookbook's RL loop (`tinker_cookbook.rl.train.main`, unchanged) on its arithmetic env against
`slime-env serve-tinker` on CPU: the Qwen3 renderer over the real Qwen3 tokenizer (offline), a tiny random model.
Plumbing, not learning: a random model rarely answers; the run shows sampling (with log-probs), importance-sampling
forward_backward, optim_step and sampler hand-off going round for several steps.

    .venv/bin/python -P bench/tinker_cookbook_rl.py --batches 3 [--loss ppo]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HOME", str(Path(tempfile.gettempdir()) / "slime_env-tinker-hf"))
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TINKER_API_KEY", "tml-local")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

MODEL = "Qwen/Qwen3-8B"


def run(batches: int, log_path: Path, loss: str = "importance_sampling", kl: float = 0.0) -> list[dict]:
    from tinker_support import ServerThread, offline_hub

    from slime_env.trainers.tinker import TinkerBackend
    from slime_env.trainers.tinker.models import load_tokenizer, random_model

    tok = load_tokenizer("qwen3")
    offline_hub(Path(os.environ["HF_HOME"]), MODEL, tok)
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
    from tinker_cookbook.rl import train

    backend = TinkerBackend(MODEL, random_model(tok), tok, log_path / "ckpt", max_context_length=2048)
    with ServerThread(backend) as url:
        builder = ArithmeticDatasetBuilder(batch_size=2, model_name_for_tokenizer=MODEL, renderer_name="qwen3",
                                           n_batches=batches, group_size=4)
        config = train.Config(learning_rate=1e-3, dataset_builder=builder, model_name=MODEL, recipe_name="rl_basic",
                              max_tokens=16, log_path=str(log_path / "run"), eval_every=0, save_every=0,
                              loss_fn=loss, lora_rank=8, base_url=url, kl_penalty_coef=kl)
        asyncio.run(train.main(config))
    return [json.loads(line) for line in (log_path / "run" / "metrics.jsonl").read_text().splitlines()]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--loss", default="importance_sampling")
    args = ap.parse_args()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(args.batches, Path(tmp), args.loss)
    for r in rows:
        keys = [k for k in r if k.startswith(("env/all/reward", "optim/", "progress/")) or k in ("step",)]
        print(json.dumps({k: r[k] for k in sorted(keys)}))
    print(f"{len(rows)} RL steps in {time.perf_counter() - t0:.1f} s")
