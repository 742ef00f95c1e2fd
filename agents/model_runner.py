"""The paged engine's forward pass: a Llama / Qwen2 / Qwen3 model over the K/V block pool, decode in CUDA graphs.

The model's own modules do the arithmetic (embedding, norms, projections, MLP, LM head; the rotary tables are
the model's rotary embedding evaluated once for every position), so the weights stay the model's parameters:
an in-place weight update is seen by the next step, eager or replayed. Tokens are packed (T, hidden): a step's
decoding tokens first (one per running sequence), then the new tokens of sequences being prefilled.
Attention reads and writes the pool through `agents.paged_attention`.

A decode-only step has fixed shapes for a given batch size, so it is captured once per size of a ladder
(`graph_sizes`) into a CUDA graph whose inputs are views of one device buffer; a batch is padded up to the next
captured size, padded rows writing into the reserved scratch block. The pool and the graphs can be dropped
(`release()`) to give the GPU's memory to a colocated trainer and rebuilt (`resume()`); graphs are then captured
again as sizes come up.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from agents import paged_attention as pa
from agents.kv_blocks import SCRATCH
from agents.packed_forward import _rope

GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def attention_dims(model: Any) -> tuple[int, int, int, int]:
    """(layers, query heads, K/V heads, head dim) of a Llama-family model."""
    attn = model.model.layers[0].self_attn
    d = attn.head_dim
    return len(model.model.layers), attn.q_proj.weight.shape[0] // d, attn.k_proj.weight.shape[0] // d, d


def kv_bytes_per_token(model: Any, dtype: torch.dtype) -> int:
    layers, _, kv_heads, d = attention_dims(model)
    return 2 * layers * kv_heads * d * torch.empty((), dtype=dtype).element_size()


class ModelRunner:
    """Runs packed steps of `model` against a pool of `num_blocks` K/V blocks (see the module docstring).

    `max_rows` block-table rows (one per running sequence) plus one scratch row; `max_model_len` bounds positions
    (the rotary tables and the block tables' width). `graphs`: capture decode steps in CUDA graphs (CUDA only).
    """

    def __init__(self, model: Any, *, num_blocks: int, block_size: int, max_rows: int, max_model_len: int,
                 graphs: bool, use_triton: bool):
        self.model, self.block_size, self.max_rows = model, block_size, max_rows
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.layers, self.heads, self.kv_heads, self.head_dim = attention_dims(model)
        self.scale = model.model.layers[0].self_attn.scaling
        self.qk_norm = hasattr(model.model.layers[0].self_attn, "q_norm")
        self.rope = _rope(model.model.layers[0].self_attn)
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.num_blocks = num_blocks
        self.use_triton = use_triton
        self.graphs_enabled = graphs and self.device.type == "cuda"
        self.scratch_row = max_rows
        # The block tables: a host mirror the engine edits, copied to the device before a step uses it.
        self.tables = np.zeros((max_rows + 1, self.max_blocks), dtype=np.int32)
        self.tables_dev = torch.zeros((max_rows + 1, self.max_blocks), dtype=torch.int32, device=self.device)
        self._cos = self._sin = None
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        self.graphs: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = {}  # size: (graph, logits, its index)
        self._graph_pool = None
        self._rope_tables()
        self.resume()

    # --- memory ---------------------------------------------------------------------------------------------
    def resume(self) -> None:
        """Allocate the K/V pool (after `release`, or at start)."""
        if self.k_cache:
            return
        shape = (self.num_blocks, self.block_size, self.kv_heads, self.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        self.v_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        if self.graphs_enabled:
            # The static inputs of every decode graph: ids, positions, slots, context lengths, block-table rows.
            cap = next((s for s in GRAPH_SIZES if s >= self.max_rows), GRAPH_SIZES[-1])
            self._static = torch.zeros((5, cap), dtype=torch.int64, device=self.device)
            self._host = torch.zeros((5, cap), dtype=torch.int64).pin_memory()

    def release(self) -> None:
        """Free the K/V pool and the graphs (their memory goes back to the allocator)."""
        self.graphs.clear()
        self._graph_pool = None
        self.k_cache, self.v_cache = [], []
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def pool_bytes(self) -> int:
        return 2 * self.layers * self.num_blocks * self.block_size * self.kv_heads * self.head_dim * \
            torch.empty((), dtype=self.dtype).element_size()

    def _rope_tables(self) -> None:
        inner = self.model.model
        positions = torch.arange(self.max_model_len, device=self.device)[None]
        probe = torch.zeros((), dtype=self.dtype, device=self.device)
        with torch.inference_mode():
            cos, sin = inner.rotary_emb(probe, positions)
        self._cos, self._sin = cos[0], sin[0]

    # --- block tables ---------------------------------------------------------------------------------------
    def upload_tables(self, rows: int, cols: int) -> None:
        """Copy the host block tables' first `rows` rows and `cols` columns (and the scratch row) to the device."""
        if rows and cols:
            self.tables_dev[:rows, :cols].copy_(torch.from_numpy(self.tables[:rows, :cols]), non_blocking=False)

    # --- steps ----------------------------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, n_dec: int,
                dec_ctx: torch.Tensor | None, dec_rows: torch.Tensor | None, prefill: pa.Prefill | None,
                last: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the packed tokens at `last`; the first `n_dec` tokens decode one step each (their
        context lengths and block-table rows in `dec_ctx`, `dec_rows`), the rest are `prefill`'s."""
        inner = self.model.model
        x = inner.embed_tokens(ids)
        cos, sin = self._cos[positions], self._sin[positions]
        tokens = x.shape[0]
        for i, layer in enumerate(inner.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(tokens, self.heads, self.head_dim)
            k = attn.k_proj(h).view(tokens, self.kv_heads, self.head_dim)
            v = attn.v_proj(h).view(tokens, self.kv_heads, self.head_dim)
            if self.qk_norm:  # Qwen3: RMSNorm over each head before the rotary embedding
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = self.rope(q, k, cos, sin, unsqueeze_dim=1)
            pa.store(self.k_cache[i], self.v_cache[i], k, v, slots)
            parts = []
            if n_dec:
                parts.append(pa.decode(q[:n_dec], self.k_cache[i], self.v_cache[i], self.tables_dev, dec_ctx,
                                       dec_rows, self.scale, use_triton=self.use_triton))
            if prefill is not None:
                parts.append(pa.prefill(q[n_dec:], self.k_cache[i], self.v_cache[i], self.tables_dev, prefill,
                                        self.scale, use_triton=self.use_triton))
            o = parts[0] if len(parts) == 1 else torch.cat(parts)
            x = x + attn.o_proj(o.reshape(tokens, self.heads * self.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.lm_head(inner.norm(x[last])).float()

    def decode(self, ids: list[int], positions: list[int], slots: list[int], ctx: list[int],
               rows: list[int]) -> torch.Tensor:
        """Logits (B, vocab) of one decoding step of B sequences: a CUDA-graph replay when one fits."""
        n = len(ids)
        size = next((s for s in GRAPH_SIZES if s >= n), None) if self.graphs_enabled else None
        if size is None or size > self._static.shape[1]:
            t = torch.tensor([ids, positions, slots, ctx, rows], dtype=torch.int64).to(self.device, non_blocking=True)
            return self.forward(t[0], t[1], t[2], n, t[3], t[4], None, torch.arange(n, device=self.device))
        if size not in self.graphs:
            self._capture(size)
        host = self._host
        host[:, n:size] = self._padding(size - n)
        host[:, :n] = torch.tensor([ids, positions, slots, ctx, rows])
        # The whole buffer, not host[:, :size]: a non-contiguous pinned source is staged through a temporary that
        # can be freed before the asynchronous copy has read it (garbage ids reached the embedding that way).
        self._static.copy_(host, non_blocking=True)
        graph, out, _ = self.graphs[size]
        graph.replay()
        return out[:n]

    def _padding(self, n: int) -> torch.Tensor:
        """Inputs of padded graph rows: token 0 at position 0, written to the scratch block, scratch table row."""
        pad = torch.zeros((5, n), dtype=torch.int64)
        pad[2] = SCRATCH * self.block_size
        pad[3] = 1
        pad[4] = self.scratch_row
        return pad

    def _capture(self, size: int) -> None:
        s = self._static
        s[:, :size].copy_(self._padding(size).to(self.device))
        # Every tensor the graph reads must outlive it: a replay reads whatever now sits at the captured address.
        last = torch.arange(size, device=self.device)

        def body():
            return self.forward(s[0, :size], s[1, :size], s[2, :size], size, s[3, :size], s[4, :size], None, last)

        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            body()  # warm-up: kernels compiled and cuBLAS workspaces made outside the capture
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            out = body()
        self._graph_pool = graph.pool()
        self.graphs[size] = (graph, out, last)


def pool_blocks(model: Any, *, block_size: int, dtype: torch.dtype, device: torch.device, memory_fraction: float,
                max_tokens: int | None, min_tokens: int) -> int:
    """How many K/V blocks to allocate: `memory_fraction` of the device's free memory (CUDA) or `max_tokens`
    worth, whichever is smaller; never fewer than `min_tokens` worth (one full-length sequence) plus scratch."""
    per_block = kv_bytes_per_token(model, dtype) * block_size
    if device.type == "cuda":
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(device)
        blocks = int(free * memory_fraction) // per_block
    else:
        blocks = math.inf
    if max_tokens is not None:
        blocks = min(blocks, -(-max_tokens // block_size))
    blocks = max(blocks, -(-min_tokens // block_size)) + 1  # + the scratch block
    if blocks == math.inf:
        raise ValueError("give max_kv_tokens on a CPU (there is no free-memory reading to size the pool from)")
    return int(blocks)
