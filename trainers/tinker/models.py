"""What `serve-tinker` trains: a Hugging Face folder, the embedded SmolLM2 ("default"), or a tiny random model over a
real offline tokenizer ("random", for plumbing: the cookbook's renderers need a real Qwen3 / Llama 3 vocabulary)."""

from __future__ import annotations

from typing import Any

from slime_env.errors import InvalidInput

OFFLINE = {"qwen3": ("qwen", "3"), "llama3.1": ("llama3", "3.1"), "llama3.2": ("llama3", "3.2"),
           "smollm2": ("smollm2", None)}


def load_tokenizer(name: str) -> Any:
    """An offline tokenizer by short name (qwen3, llama3.1, llama3.2, smollm2) or a Hugging Face folder."""
    from slime_env import offline_tokenizers

    if name in OFFLINE:
        fn, version = OFFLINE[name]
        return getattr(offline_tokenizers, fn)(*([version] if version else []))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def random_model(tokenizer: Any, *, hidden: int = 64, layers: int = 2, heads: int = 4, seed: int = 0) -> Any:
    """A tiny randomly initialised Llama-architecture model over `tokenizer`'s vocabulary (float32, CPU)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    vocab = max(len(tokenizer), int(getattr(tokenizer, "vocab_size", 0) or 0))
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=4096,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id)
    return LlamaForCausalLM(config).eval()


def load_model(checkpoint: str, tokenizer: Any) -> Any:
    """`checkpoint`: "random", "default" (embedded SmolLM2-135M-Instruct) or a Hugging Face folder."""
    import torch

    if checkpoint == "random":
        return random_model(tokenizer)
    if checkpoint == "default":
        from slime_env.agents.default_model import load_default_model

        return load_default_model()[0]
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    except OSError as e:
        raise InvalidInput(f"checkpoint {checkpoint!r}: not 'random', 'default' or a model folder ({e})") from None
