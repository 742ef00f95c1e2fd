"""Run tinker-cookbook's supervised training loop (`tinker_cookbook.supervised.train.main`, unchanged) against
`slime-env serve-tinker` on CPU: the cookbook's Qwen3 renderer over the real Qwen3 tokenizer (offline), a tiny random
model (or `--checkpoint default` / a model folder), and the cookbook's own example conversations.

    .venv/bin/python -P examples/tinker_cookbook_sft.py --steps 8                     # --backend fsdp / megatron
    # or against a running server: slime-env serve-tinker --model Qwen/Qwen3-8B --checkpoint random --tokenizer qwen3
    .venv/bin/python -P examples/tinker_cookbook_sft.py --base-url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

# Before anything imports huggingface_hub: the cookbook loads "Qwen/Qwen3-8B"'s tokenizer from an offline cache.
os.environ.setdefault("HF_HOME", str(Path(tempfile.gettempdir()) / "slime_env-tinker-hf"))
os.environ["HF_HUB_OFFLINE"] = "1"

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tinker_support: the offline HF cache

MODEL = "Qwen/Qwen3-8B"  # the name the cookbook picks its renderer (qwen3) and tokenizer by


def run(steps: int, log_path: Path, base_url: str | None = None, checkpoint: str = "random", lr: float = 2e-3,
        batch_size: int = 8, backend: str = "torch") -> list[dict]:
    """Cookbook SFT for `steps` batches (an in-process server on trainer `backend` unless `base_url`); returns the
    cookbook's metrics rows (metrics.jsonl)."""
    import importlib.resources

    from tinker_support import ServerThread, offline_hub

    from slime_env.trainers.tinker import TinkerBackend
    from slime_env.trainers.tinker.models import load_model, load_tokenizer

    tok = load_tokenizer("qwen3")
    offline_hub(Path(os.environ["HF_HOME"]), MODEL, tok)
    from tinker_cookbook.renderers import TrainOnWhat
    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    data = importlib.resources.files("tinker_cookbook") / "example_data" / "conversations.jsonl"
    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=MODEL, renderer_name="qwen3", max_length=512,
                                            batch_size=batch_size, train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES)
    config = train.Config(log_path=str(log_path / "run"), model_name=MODEL, base_url=base_url, recipe_name="sl_basic",
                          dataset_builder=FromConversationFileBuilder(common_config=common, file_path=str(data)),
                          learning_rate=lr, lr_schedule="constant", lora_rank=8, max_steps=steps, save_every=0,
                          eval_every=0, num_epochs=1000)
    if base_url is None:
        server = TinkerBackend(MODEL, load_model(checkpoint, tok), tok, log_path / "ckpt", trainer=backend,
                               max_context_length=1024)
        with ServerThread(server) as url:
            asyncio.run(train.main(config.__class__(**{**_fields(config), "base_url": url})))
    else:
        asyncio.run(train.main(config))
    rows = [json.loads(line) for line in (log_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "train_mean_nll" in r]


def _fields(config) -> dict:
    import chz

    return {name: getattr(config, name) for name in chz.chz_fields(config)}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--base-url", default=None)
    ap.add_argument("--checkpoint", default="random")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--backend", default="torch", help="the in-process server's trainer: torch, fsdp or megatron")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for row in run(args.steps, Path(tmp), args.base_url, args.checkpoint, args.lr, backend=args.backend):
            print(f"step {row['step']:3d}  train_mean_nll {row['train_mean_nll']:.4f}")
