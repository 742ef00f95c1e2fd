"""A `serve-tinker` server on loopback in a background thread, for tests and the bench; and an offline Hugging Face
cache so `tinker-cookbook`'s `get_tokenizer("Qwen/Qwen3-8B")` finds the real Qwen3 tokenizer without a network."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from pathlib import Path
from typing import Any


class ServerThread:
    """`with ServerThread(backend) as url:` serves `backend` at `url` until the block ends."""

    def __init__(self, backend: Any):
        self.backend = backend
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.runner = None
        self.url = ""

    def __enter__(self) -> str:
        from slime_env.trainers.tinker import start

        self.thread.start()
        self.runner, self.url = asyncio.run_coroutine_threadsafe(start(self.backend), self.loop).result(60)
        return self.url

    def __exit__(self, *exc: Any) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def offline_hub(hf_home: Path, repo: str, tokenizer: Any, model_type: str = "qwen3") -> None:
    """Lay `tokenizer` out in `hf_home` as the Hugging Face cache holds `repo`, so that with HF_HUB_OFFLINE=1
    `AutoTokenizer.from_pretrained(repo)` loads it (what the cookbook's renderers are built from)."""
    snap = hf_home / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / ("0" * 40)
    if not (snap / "tokenizer_config.json").is_file():
        snap.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(str(snap))
        (snap / "config.json").write_text(json.dumps({"model_type": model_type}))  # AutoTokenizer reads it first
        refs = snap.parent.parent / "refs"
        refs.mkdir(exist_ok=True)
        (refs / "main").write_text("0" * 40)
    os.environ["HF_HOME"] = str(hf_home)
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TINKER_API_KEY", "tml-local")
