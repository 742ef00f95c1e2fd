"""Megatron-core pieces of `MegatronTrainer`, one job per module.

- `parallel`: torch.distributed + megatron's parallel state (one process on CPU, torchrun on GPUs).
- `attention`: `SDPAttention`, the core attention over `scaled_dot_product_attention` (bshd) and varlen
  flash attention (THD packed sequences), with a per-sequence SDPA fallback on CPU / fp32.
- `context_parallel`: the CP layout of packed sequences (megatron's 2·CP balanced chunks) and its collectives.
- `rope`: megatron's THD RoPE without its per-sequence Python loop (one gather, no host sync; any CP rank).
- `model`: `build_gpt(hf_config)` — a `GPTModel` on megatron's local layer spec with the two above.
- `convert`: Hugging Face <-> megatron-core state dicts for Llama (SmolLM2), Qwen2/2.5, Qwen3 and Qwen3-MoE, with
  TP shards and pipeline stages.
- `logprobs`: vocab-parallel per-token log-probs and entropy.
- `options`: `MegatronOptions`, the backend's fields of the run config's `trainer:` section (no megatron-core import).

Names are imported on first use: megatron-core is an optional dependency, needed only by the modules that build and
run the model (`slime_env.trainers.megatron_trainer`, tests, benchmarks).
"""

from slime_env.loading import lazy_exports

_EXPORTS = {
    "SDPAttention": "slime_env.trainers.megatron.attention", "hf_to_mcore": "slime_env.trainers.megatron.convert",
    "mcore_to_hf": "slime_env.trainers.megatron.convert", "model_family": "slime_env.trainers.megatron.convert",
    "vocab_parallel_logprobs": "slime_env.trainers.megatron.logprobs",
    "build_gpt": "slime_env.trainers.megatron.model", "transformer_config": "slime_env.trainers.megatron.model",
    "init_parallel": "slime_env.trainers.megatron.parallel",
    "apply_rotary_pos_emb_thd": "slime_env.trainers.megatron.rope",
    "install_rope_patch": "slime_env.trainers.megatron.rope", "MegatronOptions": "slime_env.trainers.megatron.options",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
