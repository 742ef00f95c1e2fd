"""`build_gpt(hf_config)`: a megatron-core `GPTModel` with the shape of a Hugging Face Llama / Qwen2 / Qwen3 /
Qwen3-MoE.

Megatron's local block spec (no Transformer Engine, no apex: neither can be installed everywhere we run)
with our modules in it: `SDPAttention` as the core attention, the vectorised THD RoPE, `FusedRMSNorm` for every
norm and, in MoE layers, `GroupedExperts`. Fusions that need TE or apex are off. `transformer_config` checks
the parallel sizes against the model; `training_features_on` sets the modes of an RL step.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from slime_env.trainers.megatron import moe
from slime_env.trainers.megatron.convert import attention_dims, model_family

RECOMPUTE = ("none", "selective", "full")


def recompute_config(recompute: str = "none", *, layers: int = 1, modules: list[str] | None = None,
                     method: str = "uniform") -> dict[str, Any]:
    """megatron's activation-recompute fields: "selective" recomputes `modules` (megatron's default: the core
    attention) in the backward pass; "full" keeps only each chunk of `layers` layers' input (method "uniform"), or
    recomputes only the first `layers` layers of each stage (method "block")."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute {recompute!r}: one of {RECOMPUTE}")
    if recompute == "none":
        return {}
    if recompute == "selective":
        return {"recompute_granularity": "selective", **({"recompute_modules": list(modules)} if modules else {})}
    return {"recompute_granularity": "full", "recompute_method": method, "recompute_num_layers": layers}


def rope_theta(hf_config: Any) -> float:
    theta = getattr(hf_config, "rope_theta", None)
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    if theta is None:
        theta = params.get("rope_theta", 10000.0)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in (None, "default"):
        raise ValueError(f"rope type {kind!r} of {hf_config.model_type} is not supported by the Megatron trainer "
                         "(only plain RoPE)")
    return float(theta)


def transformer_config(hf_config: Any, *, tp: int = 1, ep: int = 1, cp: int = 1, pp: int = 1,
                       dtype: torch.dtype = torch.float32,
                       sequence_parallel: bool = False, recompute: str = "none", recompute_layers: int = 1,
                       recompute_modules: list[str] | None = None, recompute_method: str = "uniform",
                       moe_options: dict[str, Any] | None = None, **overrides):
    """megatron `TransformerConfig` for `hf_config`; refuses, naming the numbers, a TP size that does not divide
    the attention heads, the KV heads or the vocabulary, an EP size that does not divide the experts (or EP on a
    dense model), sequence parallelism without TP, a CP size below 1, a PP size that does not divide the layers.
    `moe_options`: `moe.moe_config`'s keywords."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    family = model_family(hf_config)
    c = hf_config
    heads, kv, head_dim = attention_dims(c)
    for what, n in (("attention heads", heads), ("KV heads", kv), ("vocabulary size", c.vocab_size)):
        if n % tp:
            raise ValueError(f"tensor-parallel size {tp} does not divide the {what} ({n}) of {c.model_type}: "
                             f"choose a TP size that divides {heads} heads and {kv} KV heads")
    if sequence_parallel and tp == 1:
        raise ValueError("sequence_parallel splits activations over the TP group: it needs tp > 1")
    if cp < 1:
        raise ValueError(f"context-parallel size {cp} must be >= 1")
    if pp < 1 or c.num_hidden_layers % pp:
        raise ValueError(f"pipeline-parallel size {pp} does not divide the {c.num_hidden_layers} layers of "
                         f"{c.model_type}: each stage holds the same number of layers")
    if ep > 1 and not moe.is_moe(c):
        raise ValueError(f"expert-parallel size {ep} needs an MoE model; {c.model_type} is dense")
    if moe.is_moe(c) and tp > 1 and not sequence_parallel:
        raise ValueError(f"an MoE model with tp={tp} needs sequence_parallel: true (megatron routes each TP rank's "
                         "share of the tokens)")
    extra = moe.moe_config(c, ep=ep, **(moe_options or {})) if moe.is_moe(c) else {}
    if extra and recompute_modules and "moe_act" in recompute_modules:
        raise ValueError("recompute_modules: moe_act recomputes megatron's GroupedMLP (the grouped_gemm package), "
                         "which this trainer does not use")
    extra |= recompute_config(recompute, layers=recompute_layers, modules=recompute_modules, method=recompute_method)
    cuda = torch.cuda.is_available()
    kw = dict(
        num_layers=c.num_hidden_layers, hidden_size=c.hidden_size, num_attention_heads=heads, num_query_groups=kv,
        ffn_hidden_size=c.intermediate_size, kv_channels=head_dim, normalization="RMSNorm",
        layernorm_epsilon=c.rms_norm_eps, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=family == "qwen2" or bool(getattr(c, "attention_bias", False)),
        qk_layernorm=family in ("qwen3", "qwen3_moe"),
        # On CUDA, SwiGLU is megatron's fused kernel (torch.compile'd); on CPU the plain ops (exact, no compile).
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=cuda, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, tensor_model_parallel_size=tp,
        # model(labels=...) uses megatron's compiled vocab-parallel cross entropy on CUDA
        cross_entropy_loss_fusion=cuda, cross_entropy_fusion_impl="native",
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        # perform_initialization also marks TP-sharded parameters (tensor_model_parallel), which the gradient norm
        # and the optimizer rely on; the HF weights overwrite the random values.
        use_cpu_initialization=not cuda, perform_initialization=True, calculate_per_token_loss=True,
        sequence_parallel=sequence_parallel, context_parallel_size=cp, pipeline_model_parallel_size=pp,
    )
    kw.update(extra)
    # Packed micro-batches differ in length: pipeline stages exchange each activation's shape first — except with
    # the all-gather token dispatcher, which megatron refuses to pair with that (the trainer then pads every
    # micro-batch of a schedule to one length). A dense model's dispatcher setting is unused.
    kw.setdefault("moe_token_dispatcher_type", "alltoall")
    kw["variable_seq_lengths"] = pp > 1 and kw["moe_token_dispatcher_type"] != "allgather"
    kw.update(overrides)
    return TransformerConfig(**kw)


def layer_spec(config, *, grouped_experts: bool = True, attention_kernel: str = "auto", keep_attention: bool = False,
               lora: dict[str, Any] | None = None):
    """megatron's local GPT block spec (dense and MoE layers as `config.moe_layer_freq` says) with `SDPAttention`
    (its packed kernel `attention_kernel`; `keep_attention`: its `keep`) as the core attention, every norm (layers,
    q/k, final) a `FusedRMSNorm`
    and, with `grouped_experts`, the MoE layers' experts a `GroupedExperts` (else megatron's `SequentialMLP`);
    `lora`: `lora.plan`'s adapted linears."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from slime_env.trainers.megatron.attention import SDPAttention
    from slime_env.trainers.megatron.grouped_experts import GroupedExperts
    from slime_env.trainers.megatron.norm import FusedRMSNorm

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    for spec in block.layer_specs:  # dense layers may share one spec object: setting it twice is harmless
        attn = spec.submodules.self_attention.submodules
        # megatron calls the spec's core_attention itself (not through build_module): a partial carries the kernel
        attn.core_attention = functools.partial(SDPAttention, kernel=attention_kernel, keep=keep_attention)
        if config.qk_layernorm:
            attn.q_layernorm = attn.k_layernorm = FusedRMSNorm
        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = FusedRMSNorm
        experts = getattr(spec.submodules.mlp.submodules, "experts", None)
        if experts is not None and grouped_experts:
            spec.submodules.mlp.submodules.experts = ModuleSpec(module=GroupedExperts)
        if lora:
            from slime_env.trainers.megatron.lora import adapt_layer_spec

            adapt_layer_spec(spec, lora)
    block.layer_norm = FusedRMSNorm
    return block


def build_gpt(hf_config: Any, *, tp: int = 1, dtype: torch.dtype = torch.float32, post_process: bool = True,
              grouped_experts: bool = True, attention_kernel: str = "auto", keep_attention: bool = False,
              lora: dict[str, Any] | None = None, **options):
    """A randomly initialised `GPTModel` of `hf_config`'s shape on the current device (load weights with
    `convert.hf_to_mcore`, then `convert.stage_weights` under PP); `post_process=False` stops before the final norm
    and the LM head (a critic's trunk). Under pipeline parallelism (`pp` in `options`) it is this rank's stage: its
    share of the layers, the embedding on the first stage, the head on the last. `options`: `transformer_config`'s
    (ep, cp, pp, sequence_parallel, recompute, ...); `grouped_experts`: see `layer_spec` (its megatron names:
    `moe.to_grouped`); `attention_kernel`, `keep_attention`: `SDPAttention`'s packed kernel and `keep`; `lora`: the
    adapted linears (`lora.plan`),
    their adapters zero until loaded. Megatron's parallel state must be initialised (`parallel.init_parallel`) with
    the same sizes."""
    from megatron.core.models.gpt import GPTModel
    from slime_env.trainers.megatron.rope import install_rope_patch

    install_rope_patch()
    if moe.is_moe(hf_config):
        moe.install_moe_patches()
    from megatron.core import parallel_state as ps
    from slime_env.trainers.megatron import cpu_compat

    config = transformer_config(hf_config, tp=tp, dtype=dtype, **options)
    first = last = True
    if config.pipeline_model_parallel_size > 1:
        first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    with cpu_compat.building():
        model = GPTModel(config=config, transformer_layer_spec=layer_spec(config, grouped_experts=grouped_experts,
                                                                          attention_kernel=attention_kernel,
                                                                          keep_attention=keep_attention, lora=lora),
                         vocab_size=hf_config.vocab_size,
                         max_sequence_length=hf_config.max_position_embeddings, position_embedding_type="rope",
                         rotary_base=rope_theta(hf_config),
                         share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
                         pre_process=first, post_process=post_process and last, parallel_output=True)
    if torch.cuda.is_available():
        model = model.cuda(torch.cuda.current_device())
    return model


def training_features_on(model: torch.nn.Module) -> torch.nn.Module:
    """Eval mode, except the modules whose `training` flag gates a feature the RL step needs: the transformer block
    (full recompute), attention (selective recompute) and MoE routers and layers (the load-balancing loss). The
    layers themselves stay in eval mode: their flag gates only dropout (probability 0 in our config), so the
    function is the engine's either way."""
    from megatron.core.transformer.attention import Attention
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router import Router
    from megatron.core.transformer.transformer_block import TransformerBlock

    model.eval()
    for m in model.modules():
        if isinstance(m, (TransformerBlock, Attention, Router, MoELayer)):
            m.training = True
    return model


@contextlib.contextmanager
def final_hidden_states(model: Any) -> Iterator[Callable[[], torch.Tensor]]:
    """Within: `model(...)` (a `GPTModel`, or a wrapper with `.module`) returns the final norm's hidden states
    [B, T, H] where it returned logits; yields a getter of the LM head's weight [V, H] (the shared embedding when
    tied), for a head applied in chunks (`chunked_head_logprobs`)."""
    gpt = model
    while not hasattr(gpt, "output_layer") and hasattr(gpt, "module"):
        gpt = gpt.module
    layer = gpt.output_layer
    original = layer.forward
    layer.forward = lambda hidden, weight=None, runtime_gather_output=None, **_: (hidden, None)
    try:
        yield lambda: (gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights
                       else layer.weight)
    finally:
        layer.forward = original
