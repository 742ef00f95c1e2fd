"""Model shapes the benches take (`--shape`): random weights at a real model's shape, no download.

Qwen3 dense 0.6B / 1.7B / 4B / 8B (their config.json values), a Qwen3-MoE shape small enough for one or two GPUs
(Qwen3-30B-A3B's layer, 8 of its 48 layers), and SmolLM2-135M. `hf_config(name)` is the transformers config;
`model_class(name)` the causal-LM class to build it with; `random_model(name)` the model with random weights and
SmolLM2's tokenizer, `save_random_model` the same as a Hugging Face folder (what a run's `model:` or an engine loads).

The tokenizer is SmolLM2's (49,152 ids, built offline) at every shape, and each shape keeps its own vocabulary size
(Qwen3's 151,936): the embedding and LM head cost what they cost at that shape. No id is clamped: every id the
tokenizer makes is below every shape's vocabulary size, and an id the random model samples at or past 49,152 is a
valid model input that decodes to no text.
"""

from __future__ import annotations

from typing import Any

QWEN3 = dict(vocab_size=151936, max_position_embeddings=131072, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
             head_dim=128, num_key_value_heads=8, attention_bias=False)
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-0.6b": ("qwen3", {**QWEN3, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                             "num_attention_heads": 16, "tie_word_embeddings": True}),
    "qwen3-1.7b": ("qwen3", {**QWEN3, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                             "num_attention_heads": 16, "tie_word_embeddings": True}),
    "qwen3-4b": ("qwen3", {**QWEN3, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                           "num_attention_heads": 32, "tie_word_embeddings": True}),
    "qwen3-8b": ("qwen3", {**QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                           "num_attention_heads": 32, "tie_word_embeddings": False}),
    "qwen3-moe-8l": ("qwen3_moe", {**QWEN3, "hidden_size": 2048, "intermediate_size": 6144,
                                   "moe_intermediate_size": 768, "num_hidden_layers": 8, "num_attention_heads": 32,
                                   "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1,
                                   "norm_topk_prob": True, "tie_word_embeddings": False, "mlp_only_layers": []}),
    "smollm2-135m": ("llama", {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
                               "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                               "max_position_embeddings": 8192, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
                               "tie_word_embeddings": True}),
}


def hf_config(name: str, **overrides: Any):
    """The transformers config of shape `name` (one of `SHAPES`), with `overrides`."""
    if name not in SHAPES:
        raise SystemExit(f"--shape {name!r}: one of {sorted(SHAPES)}")
    family, fields = SHAPES[name]
    import transformers

    cls = {"qwen3": transformers.Qwen3Config, "qwen3_moe": transformers.Qwen3MoeConfig,
           "llama": transformers.LlamaConfig}[family]
    return cls(**{**fields, **overrides})


def model_class(name: str):
    import transformers

    family = SHAPES[name][0]
    return {"qwen3": transformers.Qwen3ForCausalLM, "qwen3_moe": transformers.Qwen3MoeForCausalLM,
            "llama": transformers.LlamaForCausalLM}[family]


def tokenizer():
    """SmolLM2-135M-Instruct's tokenizer: from the saved folder $SLIME_ENV_GPU_TOKENIZER when set (a machine without
    the model package), else built offline (`slime_env.offline_tokenizers.smollm2`)."""
    import os

    folder = os.environ.get("SLIME_ENV_GPU_TOKENIZER")
    if folder:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder)
    from slime_env.offline_tokenizers import smollm2

    return smollm2()


def random_model(shape: Any, *, layers: int | None = None, device: str = "cpu", dtype: Any = None):
    """(model, tokenizer): random weights (seed 0, `dtype`, default bfloat16) on `device` in eval mode, at `shape` — a
    name in `SHAPES` (`layers` overriding its depth, the tokenizer's special ids set) or a transformers config — with
    `tokenizer()`."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = tokenizer()
    if isinstance(shape, str):
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        shape = hf_config(shape, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=pad,
                          **({"num_hidden_layers": layers} if layers else {}))
    torch.manual_seed(0)
    with torch.device(device):  # built where it runs, in its dtype: an 8B shape never sits in host memory in fp32
        model = AutoModelForCausalLM.from_config(shape, dtype=dtype or torch.bfloat16)
    return model.eval(), tok


def save_random_model(shape: Any, folder: Any, *, layers: int | None = None, device: str = "cpu") -> dict:
    """`random_model(shape, layers=layers, device=device)` saved with its tokenizer as a Hugging Face folder at
    `folder`; returns its state dict (the saved tensors, on `device`)."""
    model, tok = random_model(shape, layers=layers, device=device)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return {k: v.detach() for k, v in model.state_dict().items()}


def gpus_arg(value: str) -> int:
    """argparse type of `--gpus N`: a count of at least 1."""
    import argparse

    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: a number of GPUs, at least 1")
    return int(value)


def dense_flops(cfg: Any, lengths: list[int], *, recompute: bool = False, recomputed_layers: int | None = None,
                recompute_attention: bool = True) -> float:
    """Model FLOPs of a forward + backward over sequences of `lengths` (6·N·tokens + causal attention), N without the
    embedding lookup; `recompute`: plus the forward that full activation recompute runs again (2·N·tokens and the
    attention forward) in `recomputed_layers` layers (None: all), without the attention's if `recompute_attention`
    is false (its output kept from the forward)."""
    h, layers, v = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    d = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size
    tokens, quad = sum(lengths), sum(s * s for s in lengths)
    again = (layers if recomputed_layers is None else min(recomputed_layers, layers)) if recompute else 0
    # causal attention: QK^T and AV over half the square, 2·s²·q forward, twice that backward (the head is not
    # recomputed)
    linear = 6.0 * layers * per_layer * tokens + 2.0 * again * per_layer * tokens
    attention = 6.0 * layers * q * quad + (2.0 * again * q * quad if recompute_attention else 0.0)
    return linear + 6.0 * h * v * tokens + attention
