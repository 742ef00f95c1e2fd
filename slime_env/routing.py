"""Routed experts of MoE models, for routing replay (R3): which experts chose each generated token.

A MoE engine and the trainer route the same tokens differently (kernels, batch composition, precision): on
Qwen3-MoE ~10% of top-k decisions differ per forward, and RL on such a model drifts. With routing replay the
trainer uses the engine's choices for the forward passes whose logits enter the loss.

`RoutedExperts` is `[tokens, layers, top_k]` expert ids (int16, SGLang's per-token shape; dense layers of a
partly-MoE model hold 0, as SGLang's capture buffer does). Row `j` of a `Generation`'s routed experts is the
routing of the forward pass that *sampled* token `j`, i.e. the forward over the token before it (row
`prompt_len - 1 + j` of SGLang's whole-stream `meta_info.routed_experts`). The trainer replays it at the
position whose logits give that token's log-prob. `RoutingRecord` keeps them per generated token of a
response (absent for inserted tokens, which the trainer routes itself).

Core module: numpy only (transformers' dependency), imported lazily; never torch.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from slime_env.errors import InvalidInput
from slime_env.fast_pickle import fast_pickle

NO_EXPERT = -1  # a position the engine did not route (prompt / inserted tokens, lost routing): the trainer routes it


def _np():
    import numpy as np

    return np


@fast_pickle
@dataclass(frozen=True, slots=True)
class RoutedExperts:
    """`[num_tokens, num_layers, top_k]` expert ids as little-endian int16 bytes, row-major (compact, picklable)."""

    num_tokens: int
    num_layers: int
    top_k: int
    data: bytes

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.top_k < 1 or self.num_tokens < 0:
            raise InvalidInput(f"routed experts: shape [{self.num_tokens}, {self.num_layers}, {self.top_k}] is not "
                               "[tokens >= 0, layers >= 1, top_k >= 1]")
        if len(self.data) != 2 * self.num_tokens * self.num_layers * self.top_k:
            raise InvalidInput(f"routed experts: {len(self.data)} bytes for shape "
                               f"[{self.num_tokens}, {self.num_layers}, {self.top_k}] int16")

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.num_tokens, self.num_layers, self.top_k

    def __len__(self) -> int:
        return self.num_tokens

    @classmethod
    def from_array(cls, rows: Any, where: str = "routed_experts") -> RoutedExperts:
        """From a `[tokens, layers, top_k]` integer array (numpy, torch or nested lists); InvalidInput naming
        `where` for another shape, a non-integer type or ids outside int16."""
        np = _np()
        if hasattr(rows, "detach"):  # a torch tensor
            rows = rows.detach().cpu().numpy()
        try:
            arr = np.asarray(rows)
        except ValueError as e:  # ragged nested lists
            raise InvalidInput(f"{where}: not a [tokens, layers, top_k] array ({e})") from None
        if arr.ndim != 3:
            raise InvalidInput(f"{where}: expected a [tokens, layers, top_k] array, got shape {tuple(arr.shape)}")
        if arr.size and arr.dtype.kind not in "iu":
            raise InvalidInput(f"{where}: expert ids must be integers, got dtype {arr.dtype}")
        if arr.size and (int(arr.min()) < NO_EXPERT or int(arr.max()) > np.iinfo(np.int16).max):
            raise InvalidInput(f"{where}: expert ids must lie in [-1, 32767], got [{int(arr.min())}, {int(arr.max())}]")
        n, layers, k = arr.shape
        return cls(int(n), int(layers), int(k), arr.astype("<i2").tobytes())

    def to_numpy(self) -> Any:
        """A read-only `[tokens, layers, top_k]` int16 numpy view."""
        return _np().frombuffer(self.data, dtype="<i2").reshape(self.shape)

    def slice(self, start: int, end: int) -> RoutedExperts:
        row = 2 * self.num_layers * self.top_k
        start, end = max(0, start), min(self.num_tokens, end)
        return RoutedExperts(max(0, end - start), self.num_layers, self.top_k, self.data[start * row:end * row])

    @classmethod
    def concat(cls, parts: Sequence[RoutedExperts]) -> RoutedExperts:
        first = parts[0]
        for p in parts[1:]:
            if (p.num_layers, p.top_k) != (first.num_layers, first.top_k):
                raise InvalidInput(f"routed experts of different models: [*, {p.num_layers}, {p.top_k}] after "
                                   f"[*, {first.num_layers}, {first.top_k}]")
        return cls(sum(p.num_tokens for p in parts), first.num_layers, first.top_k, b"".join(p.data for p in parts))

    def check_model(self, num_layers: int, top_k: int, num_experts: int, where: str = "routed experts") -> None:
        """InvalidInput unless these were routed by a model of `num_layers` layers, `top_k` experts per token and
        `num_experts` experts (ids in [0, num_experts), or -1 where not routed)."""
        if (self.num_layers, self.top_k) != (num_layers, top_k):
            raise InvalidInput(f"{where} have shape [*, {self.num_layers}, {self.top_k}] but the model has "
                               f"{num_layers} layers and top-{top_k} routing: routed by another model?")
        if self.num_tokens:
            arr = self.to_numpy()
            hi = int(arr.max())
            if hi >= num_experts:
                raise InvalidInput(f"{where} name expert {hi} but the model has {num_experts} experts: "
                                   "routed by another model?")

    # --- SGLang's wire form ------------------------------------------------------------------------------------
    @classmethod
    def from_sglang(cls, payload: Any, *, prompt_tokens: int, completion_tokens: int, num_layers: int,
                    top_k: int) -> RoutedExperts:
        """The generated tokens' rows of SGLang's `meta_info.routed_experts`: base64 of little-endian int32
        `[prompt + completion - 1, layers, top_k]` (the whole stream but its last token). Row `prompt - 1 + j` is
        the forward that sampled generated token `j`. InvalidInput naming what does not fit."""
        np = _np()
        if not isinstance(payload, str):
            raise InvalidInput(f"meta_info.routed_experts must be a base64 string, got {type(payload).__name__}")
        try:
            raw = base64.b64decode(payload.encode("ascii"), validate=True)
        except (ValueError, UnicodeEncodeError) as e:
            raise InvalidInput(f"meta_info.routed_experts is not base64: {e}") from None
        rows = prompt_tokens + completion_tokens - 1
        per_row = num_layers * top_k
        if len(raw) % 4 or len(raw) // 4 != max(rows, 0) * per_row:
            got = len(raw) / 4 / per_row if per_row else 0
            raise InvalidInput(f"meta_info.routed_experts holds {len(raw) // 4} int32 ids ({got:g} rows of "
                               f"{num_layers} layers x top-{top_k}); expected {rows} rows for {prompt_tokens} prompt "
                               f"+ {completion_tokens} generated tokens: wrong layers / top_k for this model?")
        arr = np.frombuffer(raw, dtype="<i4").reshape(max(rows, 0), num_layers, top_k)
        return cls.from_array(arr[prompt_tokens - 1:prompt_tokens - 1 + completion_tokens], "meta_info.routed_experts")

    def to_sglang(self, prompt_tokens: int) -> str:
        """SGLang's `meta_info.routed_experts` for a generation of these rows after `prompt_tokens` prompt tokens:
        base64 of int32 `[prompt + completion - 1, layers, top_k]`. Rows this record does not have (the prompt's
        tokens but its last) are -1."""
        np = _np()
        n = prompt_tokens + self.num_tokens - 1
        out = np.full((max(n, 0), self.num_layers, self.top_k), NO_EXPERT, dtype="<i4")
        if self.num_tokens:
            out[prompt_tokens - 1:] = self.to_numpy()
        return base64.b64encode(out.tobytes()).decode("ascii")

    # --- JSON -----------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": "int16", "data": base64.b64encode(self.data).decode("ascii")}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RoutedExperts:
        try:
            n, layers, k = (int(x) for x in d["shape"])
            return cls(n, layers, k, base64.b64decode(d["data"]))
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidInput(f"routed experts record is malformed: {e!r}") from None


@fast_pickle
@dataclass(frozen=True, slots=True)
class RoutingRecord:
    """The routed experts of a response's generated tokens: `experts` rows for the response offsets in `ranges`
    (`[(start, end), ...]`, increasing, disjoint), in order. Offsets not covered (inserted tokens, generated tokens
    whose routing was lost to an abort or preemption) are routed by the trainer."""

    ranges: tuple[tuple[int, int], ...]
    experts: RoutedExperts

    def __post_init__(self) -> None:
        pos, total = 0, 0
        for start, end in self.ranges:
            if start < pos or end <= start:
                raise InvalidInput(f"routing record ranges are not increasing and disjoint: {self.ranges}")
            pos, total = end, total + end - start
        if total != self.experts.num_tokens:
            raise InvalidInput(f"routing record ranges cover {total} tokens but it holds "
                               f"{self.experts.num_tokens} rows")

    @property
    def num_tokens(self) -> int:
        return self.experts.num_tokens

    def per_response_token(self, response_length: int) -> Any:
        """`[response_length, layers, top_k]` int16 numpy: each token's routing, -1 where none was recorded."""
        np = _np()
        e = self.experts
        out = np.full((response_length, e.num_layers, e.top_k), NO_EXPERT, dtype=np.int16)
        rows, at = e.to_numpy(), 0
        for start, end in self.ranges:
            if end > response_length:
                raise InvalidInput(f"routing record covers response offsets up to {end} of {response_length}")
            out[start:end] = rows[at:at + end - start]
            at += end - start
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"ranges": [list(r) for r in self.ranges], **self.experts.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RoutingRecord:
        try:
            ranges = tuple((int(a), int(b)) for a, b in d["ranges"])
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidInput(f"routing record is malformed: {e!r}") from None
        return cls(ranges, RoutedExperts.from_dict(d))


def stream_routing(prompt_length: int, response_length: int, record: RoutingRecord | None) -> Any:
    """Per forward position of `prompt + response` (all but the last token), the routing to replay: row `i` is the
    forward over token `i`, whose logits give token `i + 1`'s log-prob — slime's `rollout_routed_experts` layout
    `[len(tokens) - 1, layers, top_k]`, -1 where the trainer routes itself. None without a record."""
    if record is None:
        return None
    np = _np()
    per = record.per_response_token(response_length)
    out = np.full((max(0, prompt_length + response_length - 1), *per.shape[1:]), NO_EXPERT, dtype=np.int16)
    out[max(0, prompt_length - 1):] = per[max(0, 1 - prompt_length):]  # no forward precedes a first token
    return out
