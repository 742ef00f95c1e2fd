"""Shared by the asynchronous-training tests (and the subprocess of the kill -9 test): a tiny random Llama saved
with the real SmolLM2 tokenizer, and `AsyncGate-v0`, a three-turn env whose gated tasks hold their episode in
`env.step` until the test opens the gate — so "this episode is still running while the trainer moves on" is an
event the test controls, not a race against the clock."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from slime_env import Env, register

GATE = {"open": False}


class GateEnv(Env):
    """Three turns; reward per turn = parity of the generated ids' sum (varied rewards from a random model).
    A task with `metadata["gate"]` waits in its first step until `GATE["open"]`."""

    async def reset(self, *, seed=None, options=None):
        self.task = options["task"]
        self.turn = 0
        return [{"role": "user", "content": self.task.prompt}], {}

    async def step(self, action):
        if self.task.metadata.get("gate"):
            while not GATE["open"]:
                await asyncio.sleep(0.01)
        self.turn += 1
        reward = float(sum(action.token_ids) % 2)
        done = self.turn >= 3
        return [{"role": "user", "content": f"Again ({self.turn})."}], reward, done, False, {}


register("AsyncGate-v0", GateEnv, override=True)


def tiny_model_dir(root: Path) -> Path:
    """A 2-layer Llama with SmolLM2's vocabulary and chat template, saved as a model folder the engine loads."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from slime_env.offline_tokenizers import smollm2

    path = root / "tiny-llama"
    if (path / "config.json").exists():
        return path
    tok = smollm2()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def write_tasks(path: Path, n: int, gated: tuple[int, ...] = ()) -> Path:
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"t{i}", "prompt": f"Count to {i}.", "metadata": {"gate": i in gated}}) + "\n")
    return path
