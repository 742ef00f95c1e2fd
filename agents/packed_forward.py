"""One forward pass over the new tokens of many sequences at once, packed, against the engine's batch K/V buffers.

The continuous engine's step feeds every decoding row its last sampled token and every row joining the batch
its whole new prompt (the part its session's cached prefix lacks) — in the same pass. Everything but attention
is per token, so those tokens run as one packed (tokens × hidden) matrix: a joining row costs its tokens, not a
pass of its own (on a CPU that pass is mostly the weights streamed from memory, ~40 ms for SmolLM2-135M in fp32).
Attention is per row against the buffers, in batched calls per layer: the decoding rows (one query each, the
whole batch as a view of the buffers, grouped-query heads as a query group — no copy of the cache), the joining
rows (their queries padded to the longest, causal within their own tokens), and each long fresh prompt on its
own (a causal kernel without a mask).

The model's own modules do the work (norms, projections, rotary embedding, MLP, LM head); this file only
routes tensors between them, for the decoder layout those modules share in Llama, Qwen2 and Qwen3
(`packable(model)` says whether a model has it; others use the engine's two-pass path). Exact: equal to the
model's own forward within float rounding (tests/test_engine_continuous.py compares them).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

_FAMILIES = {"llama", "qwen2", "qwen3"}
# A fresh prompt this long attends on its own with a causal kernel (no mask): ~2x faster than the masked
# batched call at 2,000 tokens on a CPU; shorter ones join the batched call (one call for many rows).
SOLO_TOKENS = 64


def packable(model: Any) -> bool:
    """Whether `model` is a decoder this module can run: a Llama / Qwen2 / Qwen3 causal LM with full attention in
    every layer (no sliding window) and the usual module names."""
    config = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    if config is None or inner is None or getattr(config, "model_type", None) not in _FAMILIES:
        return False
    if getattr(config, "use_sliding_window", False):
        return False
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return False
    layers = getattr(inner, "layers", None)
    if not layers or not all(hasattr(inner, name) for name in ("embed_tokens", "rotary_emb", "norm")):
        return False
    attn = layers[0].self_attn
    return all(hasattr(attn, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")) \
        and hasattr(model, "lm_head")


@dataclass
class Plan:
    """Where each packed token goes. Decoding tokens come first (one per row in `dec_slots`), then each joining
    row's tokens in order. Tensors are on the model's device."""
    ids: torch.Tensor          # (T,) token ids
    positions: torch.Tensor    # (T,) position of each token in its sequence
    slots: torch.Tensor        # (T,) batch row whose buffers take the token's K/V
    columns: torch.Tensor      # (T,) buffer column of the token
    rows: int                  # rows of the buffers in use (decoding attention runs over all of them)
    width: int                 # columns in use after this step (every row's last token sits at width - 1)
    dec_slots: torch.Tensor    # (D,) rows decoding one token
    dec_mask: torch.Tensor | None  # (rows, 1, 1, width) bool: the columns each row attends to
    join_slots: torch.Tensor   # (A,) rows joining together (those not in `solo`)
    join_tokens: torch.Tensor  # packed indices of their tokens
    join_index: tuple[torch.Tensor, torch.Tensor]  # (row in 0..A-1, query in 0..L-1) of each of those tokens
    join_mask: torch.Tensor | None  # (A, 1, L, width) bool
    solo: list[tuple[int, int, int]]  # (first packed index, tokens, slot): long fresh prompts, causal on their own
    last: torch.Tensor         # packed index of each row's last token: decoding rows, then joining rows


def plan(*, device: torch.device, rows: int, width: int, decoding: list[tuple[int, int, int]],
         joining: list[tuple[int, list[int], int]], row_mask: torch.Tensor) -> Plan:
    """decoding: (slot, token, position) per row decoding one token (its K/V goes to column width - 1);
    joining: (slot, new token ids, cached length) per row joining (its new tokens end at column width - 1);
    row_mask: (rows, width) the columns each row attends to after this step."""
    ids, pos, slots, cols = [], [], [], []
    for slot, token, position in decoding:
        ids.append(token)
        pos.append(position)
        slots.append(slot)
        cols.append(width - 1)
    join_row, join_q, join_tokens, last, solo, grouped = [], [], [], list(range(len(decoding))), [], []
    for slot, new, cached in joining:
        q = len(new)
        if cached == 0 and q >= SOLO_TOKENS:
            solo.append((len(ids), q, slot))
        else:
            join_row.extend([len(grouped)] * q)
            join_q.extend(range(q))
            join_tokens.extend(range(len(ids), len(ids) + q))
            grouped.append((slot, new, cached))
        ids.extend(new)
        pos.extend(range(cached, cached + q))
        slots.extend([slot] * q)
        cols.extend(range(width - q, width))
        last.append(len(ids) - 1)

    def t(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long).to(device, non_blocking=True)

    join_mask = None
    if grouped:
        longest = max(len(new) for _, new, _ in grouped)
        q_len = torch.tensor([len(new) for _, new, _ in grouped])
        start = width - q_len - torch.tensor([cached for _, _, cached in grouped])  # first column of the row
        j = torch.minimum(torch.arange(longest)[None, :], q_len[:, None] - 1)  # padded queries copy the last one
        query_col = width - q_len[:, None] + j                                   # (A, L)
        col = torch.arange(width)[None, None, :]
        join_mask = ((col >= start[:, None, None]) & (col <= query_col[:, :, None]))[:, None].to(device)
    dec_mask = row_mask.bool()[:, None, None, :] if decoding else None
    return Plan(ids=t(ids), positions=t(pos), slots=t(slots), columns=t(cols), rows=rows, width=width,
                dec_slots=t([s for s, _, _ in decoding]), dec_mask=dec_mask,
                join_slots=t([s for s, _, _ in grouped]), join_tokens=t(join_tokens),
                join_index=(t(join_row), t(join_q)), join_mask=join_mask, solo=solo, last=t(last))


def forward(model: Any, p: Plan, kb: list[torch.Tensor], vb: list[torch.Tensor]) -> torch.Tensor:
    """Run the packed tokens through `model`, writing each token's K/V into the buffers (per layer
    (batch rows, kv heads, capacity, head dim)); the float32 logits of each row's last token, in `p.last`'s order."""
    inner = model.model
    x = inner.embed_tokens(p.ids)[None]                                  # (1, T, hidden)
    cos, sin = inner.rotary_emb(x, p.positions[None])
    cos, sin = cos[0], sin[0]                                            # (T, head dim)
    x = x[0]
    n_dec = len(p.dec_slots)
    for layer, kbuf, vbuf in zip(inner.layers, kb, vb):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        x = x + attn.o_proj(_attention(attn, h, cos, sin, p, kbuf, vbuf, n_dec))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    x = inner.norm(x[p.last])
    return model.lm_head(x).float()


def _attention(attn: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, p: Plan, kbuf: torch.Tensor,
               vbuf: torch.Tensor, n_dec: int) -> torch.Tensor:
    tokens, d = h.shape[0], attn.head_dim
    q = attn.q_proj(h).view(tokens, -1, d)
    k = attn.k_proj(h).view(tokens, -1, d)
    v = attn.v_proj(h).view(tokens, -1, d)
    if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head before the rotary embedding
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = family_rope(attn)(q, k, cos, sin, unsqueeze_dim=1)
    kbuf[p.slots, :, p.columns] = k.to(kbuf.dtype)
    vbuf[p.slots, :, p.columns] = v.to(vbuf.dtype)
    heads, kv_heads = q.shape[1], k.shape[1]
    group = heads // kv_heads  # query heads per K/V head (head i reads K/V head i // group)
    out = q.new_empty((tokens, heads * d))
    if n_dec:
        keys, values = kbuf[:p.rows, :, :p.width], vbuf[:p.rows, :, :p.width]
        qd = q.new_zeros((p.rows, heads, d))
        qd[p.dec_slots] = q[:n_dec]
        # One query per row: a row's `group` query heads sharing a K/V head are that head's queries.
        o = F.scaled_dot_product_attention(qd.view(p.rows, kv_heads, group, d), keys, values,
                                           attn_mask=p.dec_mask, scale=attn.scaling)
        out[:n_dec] = o.reshape(p.rows, heads * d)[p.dec_slots]
    for start, n, slot in p.solo:  # a long fresh prompt: plain causal attention over its own columns
        cols = slice(p.width - n, p.width)
        o = F.scaled_dot_product_attention(q[start:start + n].transpose(0, 1)[None], kbuf[slot:slot + 1, :, cols],
                                           vbuf[slot:slot + 1, :, cols], is_causal=True, scale=attn.scaling,
                                           enable_gqa=True)
        out[start:start + n] = o[0].transpose(0, 1).reshape(n, heads * d)
    if len(p.join_slots):
        a_idx, j_idx = p.join_index
        joining, longest = len(p.join_slots), p.join_mask.shape[2]
        qj = q.new_zeros((joining, longest, heads, d))
        qj[a_idx, j_idx] = q[p.join_tokens]
        qj = qj.permute(0, 2, 1, 3).reshape(joining, kv_heads, group * longest, d)
        mask = p.join_mask[:, :, None].expand(-1, -1, group, -1, -1).reshape(joining, 1, group * longest, p.width)
        o = F.scaled_dot_product_attention(qj, kbuf[p.join_slots, :, :p.width], vbuf[p.join_slots, :, :p.width],
                                           attn_mask=mask, scale=attn.scaling)
        o = o.reshape(joining, heads, longest, d).permute(0, 2, 1, 3)  # (A, L, heads, d)
        out[p.join_tokens] = o[a_idx, j_idx].reshape(-1, heads * d)
    return out


def family_rope(attn: Any) -> Any:
    """The model family's own `apply_rotary_pos_emb` (from its modeling module)."""
    return sys.modules[type(attn).__module__].apply_rotary_pos_emb
