"""The engine-bound layout of a model's weights: the names, tensors and dtype an engine server loads.

A trainer holds its weights in its model's in-memory layout. For most models that is the checkpoint layout too, but
transformers >= 5 keeps a MoE layer's experts fused (`mlp.experts.gate_up_proj` [E, 2F, H], `mlp.experts.down_proj`
[E, H, F]), while checkpoint files, SGLang, vLLM and `serve-engine` name every expert's matrices
(`mlp.experts.{e}.gate_proj.weight` [F, H], `up_proj` [F, H], `down_proj` [H, F]). A tied LM head is saved once (the
engine ties it itself).

- `WeightLayout.of(hf_config, dtype)` decides it for one model, and `engine_tensors(weights)` gives the (name,
  tensor) pairs every weight channel that leaves the trainer's process sends (`slime_env.trainers.weight_sync`);
  `save_folder(path, weights)` writes the same pairs as a model folder.
- `load_state(model, weights, partial)` is the way back: a transformers model takes either layout (the embedded engine
  and `serve-engine` load what SGLang would be sent); `model_state(weights, model)` converts a whole state dict.

Which model types fuse their experts, and what their checkpoints call each expert's matrices, is the `EXPERTS`
registry: a fused tensor of a model type it does not name is refused by name, never sent under a name no engine has.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# model_type -> the checkpoint names of one expert's (gate, up, down) matrices under `mlp.experts.{e}.`
EXPERTS: dict[str, tuple[str, str, str]] = {
    "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
    "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
}
_FUSED = re.compile(r"^(.*\.mlp\.experts\.)(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def dedup_tied(weights: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The tensors of `weights` with one copy of those that share storage (tied embeddings), in order."""
    seen: set[tuple[int, int]] = set()
    out = []
    for name, t in weights.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen and t.numel():
            continue
        seen.add(key)
        out.append((name, t))
    return out


def per_expert(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` with fused expert tensors written one matrix per expert (views, no copy); others as they are."""
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        hit = _FUSED.match(name)
        if hit is None:
            out[name] = t
        elif hit.group(2) == "gate_up_proj":
            for e, w in enumerate(t):
                gate, up = w.chunk(2, dim=0)  # [gate; up] along the rows, as transformers fuses them
                out[f"{hit.group(1)}{e}.gate_proj.weight"], out[f"{hit.group(1)}{e}.up_proj.weight"] = gate, up
        else:
            for e, w in enumerate(t):
                out[f"{hit.group(1)}{e}.down_proj.weight"] = w
    return out


def fused(weights: Mapping[str, torch.Tensor], experts: Mapping[str, int]) -> dict[str, torch.Tensor]:
    """`weights` with per-expert matrices stacked into fused tensors: `experts` maps each fused layer's prefix
    (`model.layers.{i}.mlp.experts.`) to its number of experts. A missing matrix is a KeyError naming it; a layer
    already fused, and every other tensor, passes through."""
    out = {k: v for k, v in weights.items() if not ((hit := _PER_EXPERT.match(k)) and hit.group(1) in experts)}
    for prefix, n in experts.items():
        if f"{prefix}gate_up_proj" in out or not any(k.startswith(prefix) for k in weights):
            continue
        try:
            out[prefix + "gate_up_proj"] = torch.stack([torch.cat([weights[f"{prefix}{e}.gate_proj.weight"],
                                                                   weights[f"{prefix}{e}.up_proj.weight"]], 0)
                                                        for e in range(n)])
            out[prefix + "down_proj"] = torch.stack([weights[f"{prefix}{e}.down_proj.weight"] for e in range(n)])
        except KeyError as missing:
            raise KeyError(f"expert weight {missing} of {prefix[:-1]} is missing") from None
    return out


@dataclass(frozen=True)
class WeightLayout:
    """How one model's weights look on the way to an engine (see the module docstring).

    `config`: the model's HF config (its `model_type` and `tie_word_embeddings`, and the `config.json` a model folder
    needs); `dtype`: the dtype tensors are cast to on the way (None: the trainer's own)."""

    config: Any = field(default=None, compare=False)
    dtype: torch.dtype | None = None

    @classmethod
    def of(cls, config: Any, dtype: torch.dtype | None = None) -> WeightLayout:
        return cls(config, dtype)

    @property
    def model_type(self) -> str | None:
        return getattr(self.config, "model_type", None)

    @property
    def tied(self) -> bool:
        return bool(getattr(self.config, "tie_word_embeddings", False))

    def engine_tensors(self, weights: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """The (name, tensor) pairs an engine server loads: experts one matrix each, one copy of tied tensors (no
        `lm_head.weight` when the embeddings are tied), cast to `dtype`. Views where no cast is needed."""
        kept = dict(dedup_tied(weights))
        if self.tied and "model.embed_tokens.weight" in kept:
            kept.pop("lm_head.weight", None)
        fused_names = [n for n in kept if _FUSED.match(n)]
        if fused_names:
            if self.model_type not in EXPERTS:
                raise ValueError(f"{fused_names[0]}: model type {self.model_type!r} keeps its experts fused and "
                                 f"slime_env does not know its checkpoint names (known: {sorted(EXPERTS)}); an "
                                 "engine would not find these weights")
            kept = per_expert(kept)
        return [(n, t if self.dtype is None else t.to(self.dtype)) for n, t in kept.items()]

    def save_folder(self, path: str | Path, weights: Mapping[str, torch.Tensor]) -> Path:
        """`engine_tensors(weights)` as a model folder (one safetensors file and the config): what
        `update_weights_from_disk` loads, and what the Megatron trainer's checkpoints hold."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file({n: t.detach().to("cpu").contiguous() for n, t in self.engine_tensors(weights)},
                  str(path / "model.safetensors"), metadata={"format": "pt"})
        if self.config is not None:
            self.config.save_pretrained(str(path))
        return path


def model_state(weights: Mapping[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A whole state dict in `model`'s own layout (per-expert matrices stacked where the model fuses them)."""
    return fused(weights, {hit.group(1): t.shape[0] for k, t in model.state_dict().items()
                           if (hit := _FUSED.match(k)) and hit.group(2) == "gate_up_proj"})


@torch.no_grad()
def load_state(model: torch.nn.Module, weights: Mapping[str, torch.Tensor], *, partial: bool = False
               ) -> tuple[list[str], list[str]]:
    """Load `weights` (either layout) into `model` in place; returns (missing, unexpected) names as
    `load_state_dict(strict=False)` does. Per-expert matrices go straight into their slice of the model's fused
    tensor, so a part of an update (one bucket: some experts of a layer) loads as well as a whole one; a fused tensor
    counts as missing unless every one of its matrices came."""
    params = model.state_dict()
    direct: dict[str, torch.Tensor] = {}
    filled: dict[str, int] = {}
    for name, t in weights.items():
        hit = _PER_EXPERT.match(name)
        target = hit and hit.group(1) + ("down_proj" if hit.group(3) == "down_proj" else "gate_up_proj")
        if not hit or target not in params:
            direct[name] = t
            continue
        whole, e = params[target], int(hit.group(2))
        rows = whole.shape[1] // 2 if hit.group(3) != "down_proj" else whole.shape[1]
        part = whole[e, rows:] if hit.group(3) == "up_proj" else whole[e, :rows]
        if e >= whole.shape[0] or part.shape != t.shape:
            raise RuntimeError(f"{name}: shape {tuple(t.shape)} does not fit {target} {tuple(whole.shape)}")
        part.copy_(t)
        filled[target] = filled.get(target, 0) + 1
    missing, unexpected = model.load_state_dict(direct, strict=False)
    complete = {k for k, n in filled.items() if n == params[k].shape[0] * (2 if k.endswith("gate_up_proj") else 1)}
    missing = [k for k in missing if k not in complete and not (partial and k in filled)]
    return missing, list(unexpected)
