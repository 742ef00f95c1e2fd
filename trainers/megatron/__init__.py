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

Imported only by `slime_env.trainers.megatron_trainer` (and tests/benchmarks): megatron-core is an optional dependency.
"""

from slime_env.trainers.megatron.attention import SDPAttention
from slime_env.trainers.megatron.convert import hf_to_mcore, mcore_to_hf, model_family
from slime_env.trainers.megatron.logprobs import vocab_parallel_logprobs
from slime_env.trainers.megatron.model import build_gpt, transformer_config
from slime_env.trainers.megatron.parallel import init_parallel
from slime_env.trainers.megatron.rope import apply_rotary_pos_emb_thd, install_rope_patch

__all__ = ["SDPAttention", "apply_rotary_pos_emb_thd", "build_gpt", "hf_to_mcore", "init_parallel",
           "install_rope_patch", "mcore_to_hf", "model_family", "transformer_config", "vocab_parallel_logprobs"]
