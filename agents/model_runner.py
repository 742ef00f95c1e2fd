"""The paged engine's forward pass: a Llama / Qwen2 / Qwen3 model over the K/V block pool, every step a CUDA graph.

The model's own modules do the arithmetic (embedding, norms, projections, MLP, LM head; the rotary tables are
the model's rotary embedding evaluated once for every position), so the weights stay the model's parameters:
an in-place weight update is seen by the next replay. Two exceptions, one GEMM each instead of several: q, k, v,
and gate, up. At construction each layer's q/k/v weights (and biases) are re-homed into one tensor, gate/up into
another, and the modules' parameters become row slices of them (`fuse_rows`): the same `Parameter` objects, so a
weight sync's `copy_`, a broadcast into a parameter or a LoRA merge writes the fused tensor the next replay reads
(only replacing a parameter's tensor -- `param.data = ...`, `model.to(...)` -- would not). A step's tokens are
packed (T, hidden): one per decoding sequence, then the new tokens of sequences being prefilled (`Step`).
Attention reads and writes the pool through `slime_env.agents.paged_attention`, whose kernels have grids fixed by
T alone.

So a step of T tokens is shape-static once T is padded up to a size of the ladder `STEP_SIZES`: each size is
captured once into a CUDA graph (when first needed; decode-only steps have their own, without the prefill kernel)
whose inputs are views of one device buffer, filled by one host-to-device copy per step. Steps where sequences join
(the multi-turn case, where turns end and start all the time) replay too; an eager step cost ~28 ms of Python and
kernel launches for a 30-layer model, a replay ~3-4 ms. The pool, the graphs (and their memory pool), cuBLAS's
workspaces and, with `weights=True`, the weights themselves (to host memory, in place: `HostWeights`) can be dropped
(`release()`) to give the GPU's memory to a colocated trainer, and brought back (`resume()`); graphs are then
captured again as sizes come up.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from slime_env.agents import paged_attention as pa
from slime_env.agents.fused_ops import SKINNY_MAX_ROWS, skinny_linear
from slime_env.agents.kv_blocks import SCRATCH
from slime_env.agents.packed_forward import family_rope


def _ladder(top: int) -> tuple[int, ...]:
    sizes, s = [1, 2, 4, 8, 16, 24, 32, 48], 64
    while s < top:
        sizes.append(s)
        s = s + (s // 4 if s >= 256 else s // 2)
    return tuple(x for x in sizes if x < top) + (top,)


@dataclass
class Step:
    """One step, host side: `ids` / `positions` / `slots` per packed token (decoding ones first, one per decoding
    sequence, with their context lengths and block-table rows in `dec_ctx` / `dec_rows`), then the prefilled
    sequences' new tokens (`q_start`, `q_len`, `ctx_len`, `rows` per sequence); `last`: the packed indices whose
    logits are wanted."""
    ids: list[int]
    positions: list[int]
    slots: list[int]
    dec_ctx: list[int]
    dec_rows: list[int]
    q_start: list[int]
    q_len: list[int]
    ctx_len: list[int]
    rows: list[int]
    last: list[int]


def attention_dims(model: Any) -> tuple[int, int, int, int]:
    """(layers, query heads, K/V heads, head dim) of a Llama-family model."""
    attn = model.model.layers[0].self_attn
    d = attn.head_dim
    return len(model.model.layers), attn.q_proj.weight.shape[0] // d, attn.k_proj.weight.shape[0] // d, d


def fuse_rows(linears: list[Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias or None) of `linears` stacked by output rows, so that one GEMM computes all their outputs.
    Each module's `weight` / `bias` Parameter stays the same object but becomes a row slice of the stacked tensor
    (its values kept): an in-place write into a parameter is a write into the stack. Already so (a second runner on
    the same model): the stack is that storage, nothing is copied."""
    biases = [m.bias for m in linears]
    if any(b is None for b in biases) != all(b is None for b in biases):
        raise ValueError("fuse_rows: either every projection has a bias or none has")
    return _stack([m.weight for m in linears]), (None if biases[0] is None else _stack(biases))


def _stack(params: list[torch.Tensor]) -> torch.Tensor:
    first = params[0]
    shape = (sum(p.shape[0] for p in params), *first.shape[1:])
    at, storage = first.storage_offset(), first.untyped_storage().data_ptr()
    adjacent = True
    for p in params:
        adjacent = adjacent and p.is_contiguous() and p.untyped_storage().data_ptr() == storage and \
            p.storage_offset() == at
        at += p.numel()
    if adjacent:
        return first.detach().as_strided(shape, first.stride(), first.storage_offset())
    stacked = torch.cat([p.detach() for p in params])
    at = 0
    for p in params:
        # `.data`, not a new Parameter: whoever holds the parameter (state_dict views taken later, an optimizer,
        # a LoRA merge's name lookup) keeps writing the tensor the engine reads.
        p.data = stacked[at:at + p.shape[0]]
        at += p.shape[0]
    return stacked


def kv_bytes_per_token(model: Any, dtype: torch.dtype) -> int:
    layers, _, kv_heads, d = attention_dims(model)
    return 2 * layers * kv_heads * d * torch.empty((), dtype=dtype).element_size()


class ModelRunner:
    """Runs packed steps of `model` against a pool of `num_blocks` K/V blocks (see the module docstring).

    `max_rows` block-table rows (one per running sequence) plus one scratch row; `max_model_len` bounds positions
    (the rotary tables and the block tables' width); `max_step_tokens` bounds a step. `graphs`: replay steps from
    CUDA graphs (CUDA only); otherwise every step runs eagerly at its exact size.
    """

    def __init__(self, model: Any, *, num_blocks: int, block_size: int, max_rows: int, max_model_len: int,
                 max_step_tokens: int, graphs: bool, use_triton: bool):
        self.model, self.block_size, self.max_rows = model, block_size, max_rows
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.layers, self.heads, self.kv_heads, self.head_dim = attention_dims(model)
        self.scale = model.model.layers[0].self_attn.scaling
        self.qk_norm = hasattr(model.model.layers[0].self_attn, "q_norm")
        layers = model.model.layers
        with torch.no_grad():
            self.qkv = [fuse_rows([x.self_attn.q_proj, x.self_attn.k_proj, x.self_attn.v_proj]) for x in layers]
            self.gate_up = [fuse_rows([x.mlp.gate_proj, x.mlp.up_proj]) for x in layers]
        if self.device.type == "cuda":  # the unfused weights' blocks, cached by the allocator, go back for the pool
            torch.cuda.empty_cache()
        self._split = [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim]
        self.rope = family_rope(model.model.layers[0].self_attn)
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.num_blocks = num_blocks
        self.use_triton = use_triton
        # The fused elementwise kernels (slime_env.agents.fused_ops) go with the Triton attention, for SiLU-gated MLPs
        # in 16-bit dtypes. Not in float32: there the engine equals the model's forward exactly with the modules, while
        # with the fused kernels SmolLM2's real weights showed greedy log-probs up to 0.1 away on an H100 (the attention
        # kernels alone: exact) — see bench/fused_ops_precision.py; in bf16 the modules' own rounding dominates.
        self.fused = use_triton and getattr(model.config, "hidden_act", None) == "silu" and \
            self.dtype in (torch.bfloat16, torch.float16)
        # Steps of at most 16 tokens (a small batch decoding) run their projections through
        # `fused_ops.skinny_linear`, which reads the weights faster than cuBLAS at such shapes (16-bit, CUDA).
        self.skinny = self.fused and self.device.type == "cuda"
        self.graphs_enabled = graphs and self.device.type == "cuda"
        self.sizes = _ladder(max_step_tokens)
        self.scratch_row = max_rows
        # The block tables: a host mirror the engine edits, copied to the device before a step uses it.
        tables = torch.zeros((max_rows + 1, self.max_blocks), dtype=torch.int32)
        self._tables_host = tables.pin_memory() if self.graphs_enabled else tables
        self.tables = self._tables_host.numpy()
        self.tables_dev = torch.zeros((max_rows + 1, self.max_blocks), dtype=torch.int32, device=self.device)
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        self.graphs: dict[tuple[int, bool], tuple[Any, torch.Tensor]] = {}  # (step size, prefill): (graph, logits)
        self._graph_pool = None
        self._host_weights = HostWeights(model, self.device)
        self._layout(max_step_tokens)
        self._rope_tables()
        self.resume()

    # --- memory ---------------------------------------------------------------------------------------------
    def resume(self) -> None:
        """The weights back (if released) and the K/V pool allocated (after `release`, or at start)."""
        self.restore_weights()
        if self.k_cache:
            return
        shape = (self.num_blocks, self.block_size, self.kv_heads, self.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        self.v_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]

    def restore_weights(self) -> None:
        """The weights back on the device with the values they had at `release(weights=True)` (else nothing)."""
        if self._host_weights.held:
            self._host_weights.restore()

    def release(self, weights: bool = False) -> None:
        """Free the K/V pool, the graphs and their memory pool, cuBLAS's workspaces and (`weights`) the weights; what
        the caching allocator then holds unused goes back to the driver."""
        self.graphs.clear()
        self._graph_pool = None
        self.k_cache, self.v_cache = [], []
        if weights:
            self._host_weights.offload()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):  # one per stream that ran a GEMM, ~32 MiB each
                torch._C._cuda_clearCublasWorkspaces()
            torch.cuda.empty_cache()

    def pool_bytes(self) -> int:
        return 2 * self.layers * self.num_blocks * self.block_size * self.kv_heads * self.head_dim * \
            torch.empty((), dtype=self.dtype).element_size()

    def _rope_tables(self) -> None:
        positions = torch.arange(self.max_model_len, device=self.device)[None]
        probe = torch.zeros((), dtype=self.dtype, device=self.device)
        with torch.inference_mode():
            cos, sin = self.model.model.rotary_emb(probe, positions)
        self._cos, self._sin = cos[0], sin[0]

    # --- the static inputs ------------------------------------------------------------------------------------
    def _layout(self, max_tokens: int) -> None:
        """One int64 buffer holds every step input; each field is a slice of it (on the host a pinned mirror)."""
        rows, tiles = self.max_rows, pa.max_tiles(max_tokens, self.max_rows)
        fields = [("ids", max_tokens), ("positions", max_tokens), ("slots", max_tokens), ("dec_ctx", rows),
                  ("dec_rows", rows), ("q_start", rows), ("q_len", rows), ("ctx_len", rows), ("rows", rows),
                  ("tile_seq", tiles), ("tile_m", tiles), ("last", rows)]
        self._fields, at = {}, 0
        for name, n in fields:
            self._fields[name] = (at, n)
            at += n
        self._static = torch.zeros(at, dtype=torch.int64, device=self.device)
        self._host = torch.zeros(at, dtype=torch.int64)
        if self.graphs_enabled:
            self._host = self._host.pin_memory()
        self._host_np = self._host.numpy()

    def _views(self, buffer: Any, size: int, prefill: bool = True) -> dict[str, Any]:
        """Each field of `buffer` cut to what a step of `size` tokens uses; without `prefill` (a decode-only step) no
        tiles, so the prefill kernel is not launched at all."""
        rows = min(size, self.max_rows)
        tiles = pa.max_tiles(size, self.max_rows) if prefill else 0
        lengths = {"ids": size, "positions": size, "slots": size, "tile_seq": tiles, "tile_m": tiles}
        out = {}
        for name, (at, _) in self._fields.items():
            out[name] = buffer[at:at + lengths.get(name, rows)]
        return out

    def _fill(self, step: Step, size: int) -> None:
        """The host buffer's fields for `step` padded to `size`: padding tokens write into the scratch block,
        padding decode entries have context 0, padding tiles sequence -1, padding `last` entries index token 0."""
        v = self._views(self._host_np, size)
        tile_seq, tile_m = pa.tiles_for(step.q_len)
        for name, values, pad in (("ids", step.ids, 0), ("positions", step.positions, 0),
                                  ("slots", step.slots, SCRATCH * self.block_size), ("dec_ctx", step.dec_ctx, 0),
                                  ("dec_rows", step.dec_rows, self.scratch_row), ("q_start", step.q_start, 0),
                                  ("q_len", step.q_len, 0), ("ctx_len", step.ctx_len, 0),
                                  ("rows", step.rows, self.scratch_row), ("tile_seq", tile_seq, -1),
                                  ("tile_m", tile_m, 0), ("last", step.last, 0)):
            field = v[name]
            k = len(values)
            field[:k] = values
            field[k:] = pad

    # --- block tables ---------------------------------------------------------------------------------------
    def upload_tables(self, rows: int) -> None:
        """Copy the host block tables' first `rows` rows to the device: whole rows (contiguous, asynchronous from
        pinned memory; the host edits them again only after the step's results came back)."""
        if rows:
            self.tables_dev[:rows].copy_(self._tables_host[:rows], non_blocking=True)

    # --- steps ----------------------------------------------------------------------------------------------
    def run(self, step: Step) -> torch.Tensor:
        """Float32 logits (len(step.last), vocab) of one step: a CUDA-graph replay, or eagerly at its exact size."""
        n = len(step.ids)
        size = next((s for s in self.sizes if s >= n), None)
        if not self.graphs_enabled or size is None:
            size = n
        # Decode-only steps (most of a long generation) get graphs of their own without the prefill kernel, whose
        # fixed grid of mostly idle programs cost ~0.1 ms a layer at 512 tokens (an 8B model on an H100).
        key = (size, bool(step.q_len))
        self._fill(step, size)
        if not self.graphs_enabled:
            self._static[:self._host.numel()].copy_(self._host)
            return self._forward(self._views(self._static, *key))[:len(step.last)]
        if key not in self.graphs:
            self._capture(*key)
            self._fill(step, size)  # the capture ran on padding inputs
        # The whole buffer in one copy: a non-contiguous pinned source would be staged through a temporary that
        # can be freed before the asynchronous copy has read it.
        self._static.copy_(self._host, non_blocking=True)
        graph, out = self.graphs[key]
        graph.replay()
        return out[:len(step.last)]

    def _forward(self, v: dict[str, torch.Tensor]) -> torch.Tensor:
        """The model on the packed tokens of `v` (views of the device buffer); float32 logits at `v["last"]`."""
        inner = self.model.model
        meta = pa.Meta(v["dec_ctx"], v["dec_rows"], v["q_start"], v["q_len"], v["ctx_len"], v["rows"],
                       v["tile_seq"], v["tile_m"])
        x = inner.embed_tokens(v["ids"])
        cos, sin = self._cos[v["positions"]], self._sin[v["positions"]]
        if self.fused:
            return self._forward_fused(x, cos, sin, v, meta)
        tokens = x.shape[0]
        for i, layer in enumerate(inner.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q, k, v_ = self._qkv(h, i)
            if self.qk_norm:  # Qwen3: RMSNorm over each head before the rotary embedding
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = self.rope(q, k, cos, sin, unsqueeze_dim=1)
            pa.store(self.k_cache[i], self.v_cache[i], k, v_, v["slots"])
            o = pa.attention(q, self.k_cache[i], self.v_cache[i], self.tables_dev, meta, self.scale,
                             use_triton=self.use_triton)
            x = x + attn.o_proj(o.reshape(tokens, self.heads * self.head_dim))
            gate, up = F.linear(layer.post_attention_layernorm(x), *self.gate_up[i]).chunk(2, -1)
            x = x + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)
        return self.model.lm_head(inner.norm(x[v["last"]])).float()

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.skinny and x.shape[0] <= SKINNY_MAX_ROWS:
            return skinny_linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def _qkv(self, h: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer i's q, k, v of the normed tokens `h` from one GEMM: (T, heads, dim) views of its output."""
        q, k, v = self._linear(h, *self.qkv[i]).split(self._split, -1)
        t, d = h.shape[0], self.head_dim
        return q.view(t, self.heads, d), k.view(t, self.kv_heads, d), v.view(t, self.kv_heads, d)

    def _forward_fused(self, x, cos, sin, v, meta) -> torch.Tensor:
        """The same layers with `slime_env.agents.fused_ops`: each norm fused with the residual add before it, the q/k
        norms and rotary embedding fused with the K/V store, SiLU fused with the gate's product."""
        from slime_env.agents import fused_ops as fo

        layers, tokens = self.model.model.layers, x.shape[0]
        norms = [layer.input_layernorm for layer in layers]
        res, h = fo.add_rms_norm(x, None, norms[0].weight, norms[0].variance_epsilon)
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            q, k, v_ = self._qkv(h, i)
            qn, kn = (attn.q_norm, attn.k_norm) if self.qk_norm else (None, None)
            fo.rope_store(q, k, v_, cos, sin, self.k_cache[i], self.v_cache[i], v["slots"],
                          qn.weight if qn is not None else None, kn.weight if kn is not None else None,
                          qn.variance_epsilon if qn is not None else 0.0)
            o = pa.attention(q, self.k_cache[i], self.v_cache[i], self.tables_dev, meta, self.scale, use_triton=True)
            post = layer.post_attention_layernorm
            o = self._linear(o.reshape(tokens, self.heads * self.head_dim), attn.o_proj.weight, attn.o_proj.bias)
            res, h = fo.add_rms_norm(res, o, post.weight, post.variance_epsilon)
            nxt = norms[i + 1] if i + 1 < len(layers) else self.model.model.norm
            gate, up = self._linear(h, *self.gate_up[i]).chunk(2, -1)
            down = self._linear(fo.silu_mul(gate, up), mlp.down_proj.weight, mlp.down_proj.bias)
            res, h = fo.add_rms_norm(res, down, nxt.weight, nxt.variance_epsilon)
        head = self.model.lm_head
        return self._linear(h[v["last"]], head.weight, head.bias).float()

    def _capture(self, size: int, prefill: bool) -> None:
        # Capture on padding inputs: every token writes into the scratch block, no tile runs.
        self._fill(Step([], [], [], [], [], [], [], [], [], []), size)
        self._static.copy_(self._host)
        views = self._views(self._static, size, prefill)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(views)  # warm-up: kernels compiled and cuBLAS workspaces made outside the capture
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a trainer in another thread of this process (asynchronous training) keeps launching work
        # while this thread captures; the default (global) mode would fail its calls during the capture.
        with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode="thread_local"):
            out = self._forward(views)
        self._graph_pool = graph.pool()
        self.graphs[size, prefill] = (graph, out)


class HostWeights:
    """The model's tensors on `device` (parameters and buffers) moved to host memory and back, in place.

    Each distinct storage is copied into a host buffer (pinned on CUDA; kept for the next release) and resized to
    nothing, which frees its device memory while every view of it stays the same object: the parameters, the fused
    q/k/v and gate/up stacks (`fuse_rows`), a state dict taken earlier. `restore` re-allocates each storage and copies
    the bytes back, so the views read the same values again (at new addresses: CUDA graphs must be captured anew).
    A storage that cannot be resized (memory another process shares) stays on the device."""

    def __init__(self, model: Any, device: torch.device):
        self.model, self.device = model, device
        self._host: dict[str, torch.Tensor] = {}  # by the name of the first tensor seen in that storage
        self._held: list[tuple[Any, torch.Tensor]] = []  # (device storage, its bytes on the host) while offloaded

    @property
    def held(self) -> bool:
        return bool(self._held)

    def offload(self) -> int:
        """Move every storage to the host; the device bytes freed."""
        if self._held:
            return 0
        seen: set[int] = set()
        cuda = self.device.type == "cuda"
        for name, t in itertools.chain(self.model.named_parameters(), self.model.named_buffers()):
            storage = t.untyped_storage()
            if t.device != self.device or storage.nbytes() == 0 or storage.data_ptr() in seen \
                    or not storage.resizable():
                continue
            seen.add(storage.data_ptr())
            host = self._host.get(name)
            if host is None or host.numel() != storage.nbytes():
                host = self._host[name] = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=cuda)
            host.copy_(_as_bytes(storage), non_blocking=cuda)
            self._held.append((storage, host))
        if cuda:
            torch.cuda.synchronize(self.device)
        for storage, _ in self._held:
            storage.resize_(0)
        return sum(host.numel() for _, host in self._held)

    def restore(self) -> None:
        cuda = self.device.type == "cuda"
        for storage, host in self._held:
            storage.resize_(host.numel())
            _as_bytes(storage).copy_(host, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize(self.device)
        self._held = []


def _as_bytes(storage: Any) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


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
