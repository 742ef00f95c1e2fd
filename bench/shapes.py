"""Model shapes the benches take (`--shape`): random weights at a real model's shape, no download.

Qwen3 dense 0.6B / 1.7B / 4B / 8B (their config.json values), a Qwen3-MoE shape small enough for one or two GPUs
(Qwen3-30B-A3B's layer, 8 of its 48 layers), and SmolLM2-135M. `hf_config(name)` is the transformers config;
`model_class(name)` the causal-LM class to build it with.
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


def dense_flops(cfg: Any, lengths: list[int], *, recompute: bool = False) -> float:
    """Model FLOPs of a forward + backward over sequences of `lengths` (6·N·tokens + causal attention), N without the
    embedding lookup; `recompute`: plus the forward that full activation recompute runs again (8·N·tokens)."""
    h, layers, v = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    d = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size
    n_layers = layers * per_layer
    tokens, quad = sum(lengths), sum(s * s for s in lengths)
    factor = 8.0 if recompute else 6.0  # recompute runs the layers' forward once more (the head is not recomputed)
    # causal attention: QK^T and AV over half the square, 2·s²·q forward, twice that backward
    return factor * n_layers * tokens + 6.0 * h * v * tokens + factor * layers * q * quad
