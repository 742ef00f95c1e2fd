"""Hugging Face <-> megatron-core weights for Llama (SmolLM2), Qwen2/2.5 (qkv bias), Qwen3 (q/k norm) and
Qwen3-MoE (Qwen3's attention, sparse MLPs: `moe.py`).

Pure functions over state dicts; no model is built here. Megatron's layout differs from HF's in two
fused projections: `linear_qkv` stores, per KV group, that group's query heads then its key then its
value (so a TP rank owns whole KV groups), and `linear_fc1` stores gate then up — per TP rank, so a rank
holds `[gate_r; up_r]`. Row-parallel weights (`linear_proj`, `linear_fc2`) split along the input
dimension, the embedding and the output layer along the vocabulary; norms are replicated. Experts are never
split over TP; their megatron names number them globally (`moe.local_experts` takes one EP rank's share).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from slime_env.trainers.megatron import moe

FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe"}


def model_family(hf_config: Any) -> str:
    """"llama", "qwen2", "qwen3" or "qwen3_moe" for a Hugging Face config; other model types are refused by name."""
    family = FAMILIES.get(getattr(hf_config, "model_type", None))
    if family is None:
        raise ValueError(f"model type {getattr(hf_config, 'model_type', None)!r} is not supported by the Megatron "
                         f"trainer; supported: {sorted(FAMILIES)}")
    return family


def attention_dims(c: Any) -> tuple[int, int, int]:
    """(attention heads, KV heads, head dim) of an HF config."""
    heads = c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return heads, kv, head_dim


def _qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: Any) -> torch.Tensor:
    heads, kv, d = attention_dims(c)
    rest = q.shape[1:]
    q = q.reshape(kv, heads // kv * d, *rest)
    k, v = k.reshape(kv, d, *rest), v.reshape(kv, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _split_qkv(qkv: torch.Tensor, c: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    heads, kv, d = attention_dims(c)
    rest = qkv.shape[1:]
    g = qkv.reshape(kv, (heads // kv + 2) * d, *rest)
    q, k, v = torch.split(g, [heads // kv * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _shard(x: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    return torch.chunk(x, size, dim=dim)[rank].contiguous() if size > 1 else x


def hf_to_mcore(hf: Mapping[str, torch.Tensor], hf_config: Any, *, tp_rank: int = 0, tp_size: int = 1
                ) -> dict[str, torch.Tensor]:
    """Megatron state dict of TP rank `tp_rank` from a full HF state dict (MoE experts: fused or per-expert
    layout, all of them, numbered globally). Missing HF weights raise a KeyError naming them."""
    family = model_family(hf_config)
    sparse = moe.sparse_layers(hf_config)
    if any(sparse):
        hf = moe.fused_layout(hf, hf_config)
    missing = [k for k in _required_hf_keys(hf_config) if k not in hf]
    if missing:
        raise KeyError(f"HF state dict lacks {len(missing)} weight(s) of {hf_config.model_type}: {missing[:4]}")
    def s(x: torch.Tensor, dim: int) -> torch.Tensor:
        return _shard(x, dim, tp_rank, tp_size)

    out = {"embedding.word_embeddings.weight": s(hf["model.embed_tokens.weight"], 0),
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not getattr(hf_config, "tie_word_embeddings", False):
        out["output_layer.weight"] = s(hf["lm_head.weight"], 0)
    for i in range(hf_config.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        a = h + "self_attn."
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
        out[m + "self_attention.linear_qkv.weight"] = s(_qkv(hf[a + "q_proj.weight"], hf[a + "k_proj.weight"],
                                                            hf[a + "v_proj.weight"], hf_config), 0)
        if a + "q_proj.bias" in hf:
            out[m + "self_attention.linear_qkv.bias"] = s(_qkv(hf[a + "q_proj.bias"], hf[a + "k_proj.bias"],
                                                              hf[a + "v_proj.bias"], hf_config), 0)
        out[m + "self_attention.linear_proj.weight"] = s(hf[a + "o_proj.weight"], 1)
        if family in ("qwen3", "qwen3_moe"):
            out[m + "self_attention.q_layernorm.weight"] = hf[a + "q_norm.weight"]
            out[m + "self_attention.k_layernorm.weight"] = hf[a + "k_norm.weight"]
        if sparse[i]:
            out.update(moe.experts_to_mcore(hf, i))
            continue
        gate, up = hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([s(gate, 0), s(up, 0)], dim=0)
        out[m + "mlp.linear_fc2.weight"] = s(hf[h + "mlp.down_proj.weight"], 1)
    return out


def mcore_to_hf(shards: Sequence[Mapping[str, torch.Tensor]], hf_config: Any) -> dict[str, torch.Tensor]:
    """Full HF state dict from the megatron state dicts of every TP rank, in rank order (one for TP=1).
    Tied embeddings are written once (`model.embed_tokens.weight`), as `save_pretrained` does. MoE experts are
    read from the first shard, numbered globally, and written in transformers' fused in-memory layout."""
    family = model_family(hf_config)
    sparse = moe.sparse_layers(hf_config)
    tp = len(shards)
    def cat(name: str, dim: int) -> torch.Tensor:
        return torch.cat([sh[name] for sh in shards], dim=dim) if tp > 1 else shards[0][name]

    first = shards[0]
    out = {"model.embed_tokens.weight": cat("embedding.word_embeddings.weight", 0),
           "model.norm.weight": first["decoder.final_layernorm.weight"]}
    if not getattr(hf_config, "tie_word_embeddings", False):
        out["lm_head.weight"] = cat("output_layer.weight", 0)
    for i in range(hf_config.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        a = h + "self_attn."
        out[h + "input_layernorm.weight"] = first[m + "input_layernorm.weight"]
        out[h + "post_attention_layernorm.weight"] = first[m + "pre_mlp_layernorm.weight"]
        q, k, v = _split_qkv(cat(m + "self_attention.linear_qkv.weight", 0), hf_config)
        out[a + "q_proj.weight"], out[a + "k_proj.weight"], out[a + "v_proj.weight"] = q, k, v
        if m + "self_attention.linear_qkv.bias" in first:
            q, k, v = _split_qkv(cat(m + "self_attention.linear_qkv.bias", 0), hf_config)
            out[a + "q_proj.bias"], out[a + "k_proj.bias"], out[a + "v_proj.bias"] = q, k, v
        out[a + "o_proj.weight"] = cat(m + "self_attention.linear_proj.weight", 1)
        if family in ("qwen3", "qwen3_moe"):
            out[a + "q_norm.weight"] = first[m + "self_attention.q_layernorm.weight"]
            out[a + "k_norm.weight"] = first[m + "self_attention.k_layernorm.weight"]
        if sparse[i]:
            out.update(moe.experts_to_hf(first, i, hf_config.num_experts))
            continue
        gates, ups = zip(*(torch.chunk(sh[m + "mlp.linear_fc1.weight"], 2, dim=0) for sh in shards))
        out[h + "mlp.gate_proj.weight"] = torch.cat(gates, 0) if tp > 1 else gates[0]
        out[h + "mlp.up_proj.weight"] = torch.cat(ups, 0) if tp > 1 else ups[0]
        out[h + "mlp.down_proj.weight"] = cat(m + "mlp.linear_fc2.weight", 1)
    return out


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def stage_weights(state: Mapping[str, torch.Tensor], *, offset: int, layers: int, first: bool, last: bool,
                  tied: bool) -> dict[str, torch.Tensor]:
    """A pipeline stage's share of a megatron state dict numbered over the whole model: layers `offset` to
    `offset + layers - 1` renumbered from 0 (megatron numbers a stage's layers locally), the embedding on the first
    stage, the final norm and the output layer on the last — which, with tied embeddings and no embedding of its
    own, holds a copy of the embedding (megatron sums the two copies' gradients)."""
    out = {}
    for name, t in state.items():
        m = _LAYER.match(name)
        if m:
            if offset <= int(m.group(1)) < offset + layers:
                out[f"decoder.layers.{int(m.group(1)) - offset}.{name[m.end():]}"] = t
        elif name.startswith("embedding.") and first or not name.startswith("embedding.") and last:
            out[name] = t
    if last and tied and not first:
        out["output_layer.weight"] = state["embedding.word_embeddings.weight"]
    return out


def renumber_layers(state: Mapping[str, torch.Tensor], offset: int) -> dict[str, torch.Tensor]:
    """A stage's megatron names with its layers numbered over the whole model (`stage_weights`' inverse naming)."""
    return {(f"decoder.layers.{int(m.group(1)) + offset}.{k[m.end():]}" if (m := _LAYER.match(k)) else k): t
            for k, t in state.items()}


def _required_hf_keys(c: Any) -> list[str]:
    keys = ["model.embed_tokens.weight", "model.norm.weight"]
    if not getattr(c, "tie_word_embeddings", False):
        keys.append("lm_head.weight")
    sparse = moe.sparse_layers(c)
    for i in range(c.num_hidden_layers):
        h = f"model.layers.{i}."
        keys += [h + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                                 "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight")]
        keys += moe.required_hf_keys(c, i) if sparse[i] else [
            h + n for n in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")]
    return keys
