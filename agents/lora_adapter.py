"""`LoRAAdapter`: a LoRA adapter as engines load it, in PEFT's format, and `MergedAdapter`: how the embedded engines
and `serve-engine` apply one (merged into their weights).

The format is PEFT's, so a folder `adapter.save(folder)` writes is what `peft.PeftModel.from_pretrained`, SGLang's
`/load_lora_adapter` and vLLM's `/v1/load_lora_adapter` load: `adapter_config.json` and `adapter_model.safetensors`
with keys `base_model.model.<module>.lora_A.weight` / `.lora_B.weight`. Trainers make adapters
(`slime_env.trainers.lora.adapter_of`); the weight channels (`slime_env.trainers.weight_sync`) carry them.

Our engines apply an adapter **merged**: W = W_base + scale * B @ A on every adapted linear layer, computed from a
copy of those base matrices kept in host memory (exact whatever the engine's dtype: no unmerge drift), then loaded
like any partial weight update (between batches: what runs finishes first, so every token's adapter is the one its
request recorded). Decoding then costs what the base model costs. SGLang and vLLM serve adapters unmerged (S-LoRA /
Punica kernels), several versions at once.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass
class LoRAAdapter:
    """One adapter version as it leaves a trainer: `tensors` under PEFT's saved names
    (`base_model.model.<module>.lora_A.weight`), `config` as PEFT's `adapter_config.json` holds it."""

    name: str
    tensors: dict[str, torch.Tensor]
    config: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, folder: str | Path, name: str | None = None) -> LoRAAdapter:
        """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors); FileNotFoundError naming it."""
        from safetensors.torch import load_file

        folder = Path(folder)
        if not (folder / ADAPTER_CONFIG).is_file() or not (folder / ADAPTER_WEIGHTS).is_file():
            raise FileNotFoundError(f"{folder} is no PEFT adapter folder ({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS})")
        return cls(name or folder.name, load_file(str(folder / ADAPTER_WEIGHTS)),
                   json.loads((folder / ADAPTER_CONFIG).read_text()))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def scaling(self) -> float:
        r, alpha = int(self.config.get("r", 8)), float(self.config.get("lora_alpha", 8))
        return alpha / r ** 0.5 if self.config.get("use_rslora") else alpha / r

    def save(self, folder: str | Path) -> Path:
        """PEFT's format: what `peft.PeftModel.from_pretrained`, SGLang and vLLM load."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous().cpu() for k, v in self.tensors.items()}, str(folder / ADAPTER_WEIGHTS),
                  metadata={"format": "pt"})
        (folder / ADAPTER_CONFIG).write_text(json.dumps(self.config, indent=2, sort_keys=True))
        return folder

    def deltas(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """{HF weight name: scaling * B @ A} for every adapted linear layer (computed in `dtype`); for a parameter peft
        adapts directly (`target_parameters`: Qwen3-MoE's fused experts and router, `_parameters`), that parameter's
        delta: a 3-D expert weight [E, out, in] gets B_e @ A_e per expert e, scaled by its rank / alpha patterns."""
        owners = self._parameters()
        out: dict[str, torch.Tensor] = {}
        for key, a in self.tensors.items():
            if not key.endswith(".lora_A.weight"):
                if not key.endswith(".lora_B.weight"):
                    raise ValueError(f"adapter {self.name}: {key} is no LoRA matrix of a linear layer (lora_A / "
                                     "lora_B); only linear target modules can be merged")
                continue
            module = key.removesuffix(".lora_A.weight")
            a, b = a.to(dtype), self.tensors[module + ".lora_B.weight"].to(dtype)
            param = owners.get(module.removeprefix("base_model.model."))
            if param is None:
                out[module.removeprefix("base_model.model.") + ".weight"] = (b @ a) * self.scaling
                continue
            r, scaling = self._rank_scaling(param)
            experts = a.shape[0] // r
            if experts == 1 and param.endswith(".weight"):  # a 2-D parameter (the router)
                out[param] = (b @ a) * scaling
            else:  # peft's ParamWrapper: A [E * r, in] (expert e: rows e*r...), B [out, r * E] (expert e: columns e::E)
                out[param] = torch.einsum("ore,eri->eoi", b.reshape(b.shape[0], r, experts),
                                          a.reshape(experts, r, a.shape[-1])) * scaling
        return out

    def _parameters(self) -> dict[str, str]:
        """{adapter module (HF names): the parameter it adapts} for peft's `target_parameters`. peft wraps a module
        once per targeted parameter, the first one innermost (`….base_layer`), in the order the module defines them
        (transformers' experts: gate_up_proj, then down_proj)."""
        targets = list(self.config.get("target_parameters") or [])
        if not targets:
            return {}
        order = ("gate_up_proj", "down_proj")
        bare = sorted((t for t in targets if "." not in t), key=lambda t: (order.index(t) if t in order else 2, t))
        modules = {k.removeprefix("base_model.model.").removesuffix(".lora_A.weight") for k in self.tensors
                   if k.endswith(".lora_A.weight")}
        linear = self.config.get("target_modules") or []
        out = {}
        for m in modules:
            owner, depth = m, 0
            while owner.endswith(".base_layer"):
                owner, depth = owner.removesuffix(".base_layer"), depth + 1
            if depth == 0 and not isinstance(linear, str) and m.rsplit(".", 1)[-1] in linear:
                continue  # a target module: a linear layer
            dotted = [t for t in targets if "." in t and owner.endswith("." + t.rsplit(".", 1)[0])]
            if dotted:
                out[m] = f"{owner}.{dotted[0].rsplit('.', 1)[1]}"
            elif bare:
                nested = sum(1 for other in modules if other.startswith(owner + ".base_layer") or other == owner)
                out[m] = f"{owner}.{bare[nested - 1 - depth] if nested <= len(bare) else bare[0]}"
        return out

    def _rank_scaling(self, param: str) -> tuple[int, float]:
        """(rank, scale) of one adapted parameter: peft's `rank_pattern` / `alpha_pattern`, else the config's
        r / alpha."""
        def pattern(which: str, default: float) -> float:
            for key, value in (self.config.get(which) or {}).items():
                if re.match(rf"(.*\.)?({key})$", param):
                    return value
            return default

        r = int(pattern("rank_pattern", int(self.config.get("r", 8))))
        alpha = float(pattern("alpha_pattern", float(self.config.get("lora_alpha", 8))))
        return r, alpha / r ** 0.5 if self.config.get("use_rslora") else alpha / r


def config_dict(peft_config: Any) -> dict[str, Any]:
    """PEFT's adapter_config.json content (sets as lists, as `PeftConfig.save_pretrained` writes them)."""
    out = peft_config.to_dict()
    for k, v in out.items():
        if isinstance(v, set):
            out[k] = sorted(v)
    return json.loads(json.dumps(out, default=str))



class MergedAdapter:
    """An engine's base copy of the matrices adapters touch (host memory, taken once, before the first merge) and
    the merged weights of a new adapter: `merged(adapter)` -> {HF name: W_base + delta} in the model's dtype."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.base: dict[str, torch.Tensor] = {}

    def merged(self, adapter: LoRAAdapter) -> dict[str, torch.Tensor]:
        deltas = adapter.deltas()
        params = dict(self.model.named_parameters())
        missing = sorted(set(deltas) - set(params))
        if missing:
            raise ValueError(f"adapter {adapter.name}: {missing[:3]} name no weight of this engine's model")
        out = {}
        for name, d in deltas.items():
            p = params[name]
            if p.shape != d.shape:
                raise ValueError(f"adapter {adapter.name}: {name} is {tuple(d.shape)}, the model's {tuple(p.shape)}")
            if name not in self.base:  # the base matrix, before any adapter touched it
                self.base[name] = p.detach().to("cpu", copy=True)
            out[name] = (self.base[name].to(p.device, torch.float32) + d.to(p.device)).to(p.dtype)
        for name in set(self.base) - set(deltas):  # adapted by an earlier adapter, not by this one: back to base
            out[name] = self.base[name].to(params[name].device)
        return out
