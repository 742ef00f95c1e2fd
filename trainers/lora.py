"""LoRA: the run config's `trainer.lora` section, the adapter a trainer trains (with `peft`), and the adapter as it
travels to engines and checkpoints.

```yaml
trainer:
  lora: {rank: 16, alpha: 32, dropout: 0.0, target_modules: all-linear}
```

- `LoRAOptions.parse(raw)` — the section, checked (a `ValueError` naming `lora.<field>`; an unknown field an
  `InvalidInput`, which is one, from `slime_env.trainers.config_fields.check_fields` as in every config section).
- `check_target_modules(options, model)` — its module names against the model's layers, read from the model's
  config on the meta device (no weights): a run checks them before it starts.
- `wrap(model, options)` — `peft.get_peft_model`: the base weights frozen, only the adapter trainable. The reference
  policy of a KL term is the same model with the adapter off (`peft`'s `disable_adapter()`), not a second copy.
- `adapter_of(model, name)` — what leaves the trainer instead of the weights: a `LoRAAdapter`
  (`slime_env.agents.lora_adapter`: PEFT's key names and `adapter_config.json`, the format engines read).
- `merged_weights(model)` — the HF state dict with the adapter folded in (full-weight sync, `export --merge`).

No run import here; the adapter format is the engines' (`slime_env.agents.lora_adapter`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slime_env.agents.lora_adapter import LoRAAdapter, config_dict

SYNC_KINDS = ("adapter", "merged")


@dataclass
class LoRAOptions:
    """`trainer.lora` (docs/lora.md)."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0  # active in `loss: sft` steps only: an RL step's ratio compares the function that sampled
    # Module names (or peft's "all-linear": every linear layer but the output head).
    target_modules: list[str] | str = "all-linear"
    use_rslora: bool = False  # scale alpha / sqrt(rank) instead of alpha / rank
    name: str = "policy"  # the adapter's name on engines: version v loads as "{name}@{v}"
    # What a weight sync sends: "adapter" (the adapter's tensors; engines apply them) or "merged" (full weights with
    # the adapter folded in, through the run's weight channel as without LoRA).
    sync: str = "adapter"
    # Adapter versions an engine server keeps loaded (the newest ones): at least the run's staleness bound + 1, so
    # every in-flight request's adapter is still there (the run raises it to that when lower).
    keep_loaded: int = 2

    @classmethod
    def parse(cls, raw: Any) -> LoRAOptions | None:
        """`None` (no LoRA) for a missing / null / false section, else the checked options."""
        if raw is None or raw is False:
            return None
        if isinstance(raw, LoRAOptions):
            return raw
        if raw is True:
            raw = {}
        if not isinstance(raw, Mapping):
            raise ValueError(f"lora must be a mapping (rank, alpha, dropout, target_modules, ...), got {raw!r}")
        from slime_env.trainers.config_fields import check_fields

        check_fields(cls, raw, "lora")
        opts = cls(**raw)
        opts.check()
        return opts

    def check(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"lora.rank must be an integer >= 1, got {self.rank!r}")
        if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) or self.alpha <= 0:
            raise ValueError(f"lora.alpha must be a number > 0, got {self.alpha!r}")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout!r}")
        t = self.target_modules
        if isinstance(t, str):
            if not t:
                raise ValueError("lora.target_modules is empty: name modules (q_proj, v_proj, ...) or 'all-linear'")
        elif not (isinstance(t, (list, tuple)) and t and all(isinstance(m, str) and m for m in t)):
            raise ValueError(f"lora.target_modules must be 'all-linear' or a non-empty list of module names, got {t!r}")
        else:
            self.target_modules = list(t)
        if self.sync not in SYNC_KINDS:
            raise ValueError(f"lora.sync {self.sync!r}: one of {SYNC_KINDS}")
        if not isinstance(self.name, str) or not self.name or "@" in self.name or "/" in self.name:
            raise ValueError(f"lora.name must be a non-empty name without '@' or '/', got {self.name!r}")
        if not isinstance(self.keep_loaded, int) or self.keep_loaded < 1:
            raise ValueError(f"lora.keep_loaded must be an integer >= 1, got {self.keep_loaded!r}")

    def peft_config(self) -> Any:
        from peft import LoraConfig

        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=float(self.dropout),
                          target_modules=self.target_modules, use_rslora=self.use_rslora, bias="none",
                          task_type="CAUSAL_LM")


def module_names(model: str) -> set[str] | None:
    """The names of `model`'s leaf modules (layers: "model.layers.0.self_attn.q_proj", ...), read from its config on
    the meta device: no weight is loaded or allocated. `model` as a run's `model:` field ("default", a folder, a
    Hugging Face repo id, read from the local cache only); None when its config cannot be read here (the model load
    reports that)."""
    from slime_env.agents.default_model import meta_model

    meta = meta_model(model)
    if meta is None:
        return None
    return {name for name, module in meta.named_modules() if name and not next(module.children(), None)}


def check_target_modules(options: LoRAOptions | None, model: str, where: str = "trainer.lora") -> None:
    """Every name in `target_modules` matches a layer of `model` as peft matches them (the name itself or its last
    dotted parts): a typo is refused before a run starts, by name, with the nearest layer name, instead of after the
    model load (peft refuses only when no name matches at all: a list with one typo trained the others silently)."""
    import difflib

    from slime_env.errors import InvalidInput

    if options is None or isinstance(options.target_modules, str):  # "all-linear" (peft's own choice)
        return
    names = module_names(model)
    if names is None:
        return
    leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
    for target in options.target_modules:
        if not any(n == target or n.endswith("." + target) for n in names):
            near = difflib.get_close_matches(target.rsplit(".", 1)[-1], leaves, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise InvalidInput(f"{where}.target_modules: {target!r} is not a layer of model {model!r}{hint} (its "
                               f"layers: {leaves})")


def wrap(model: torch.nn.Module, options: LoRAOptions) -> Any:
    """`model` as a `peft` model with a fresh adapter (B = 0: the function is the base model's until trained); its
    base weights frozen. ValueError naming `lora.target_modules` when none of them is in the model."""
    from peft import get_peft_model

    try:
        peft_model = get_peft_model(model, options.peft_config())
    except ValueError as e:
        raise ValueError(f"lora.target_modules {options.target_modules!r}: {e}") from None
    return peft_model


def is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def adapter_of(peft_model: Any, name: str, state: Mapping[str, torch.Tensor] | None = None) -> LoRAAdapter:
    """The current adapter of a peft model (copies of its tensors, PEFT's saved names and config). `state`: the peft
    model's state dict as full tensors (a sharded trainer's, gathered); default its own."""
    from peft import get_peft_model_state_dict

    tensors = {k: v.detach().clone() for k, v in get_peft_model_state_dict(peft_model, state_dict=state).items()}
    if not tensors:  # peft finds them by module names: a wrapper that renames modules would hide them all
        raise ValueError(f"adapter {name!r}: peft found no adapter tensor in the model's state")
    return LoRAAdapter(name, tensors, config_dict(peft_model.peft_config["default"]))


def adapter_names(peft_model: Any) -> dict[str, str]:
    """PEFT's saved name of each adapter tensor -> its parameter name in `peft_model` (the adapter name inserted):
    peft's own renaming, read off `get_peft_model_state_dict` over numbered stand-ins for the tensors."""
    from peft import get_peft_model_state_dict

    names = [k for k, _ in peft_model.named_parameters() if ".lora_" in k]
    saved = get_peft_model_state_dict(peft_model, state_dict={k: torch.tensor(i) for i, k in enumerate(names)})
    return {k: names[int(i)] for k, i in saved.items()}


def base_weights(peft_model: Any, state: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The frozen base model's HF state dict (views) out of a peft model (or out of its full `state`, as in
    `adapter_of`): no adapter tensors, no `base_layer.`."""
    import re

    state = peft_model.state_dict() if state is None else state
    # peft nests one wrapper per adapted parameter of a module (MoE experts: `experts.base_layer.base_layer.…`)
    return {re.sub(r"(\.base_layer)+\.", ".", k.removeprefix("base_model.model.")): v.detach()
            for k, v in state.items() if ".lora_" not in k}


def merged_weights(peft_model: Any, name: str = "policy",
                   state: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The HF state dict with the adapter folded in (new tensors for adapted layers, views elsewhere); `state` as in
    `adapter_of`."""
    weights = base_weights(peft_model, state)
    for k, d in adapter_of(peft_model, name, state).deltas().items():
        weights[k] = (weights[k].float() + d.to(weights[k].device)).to(weights[k].dtype)
    return weights


def adapter_folder(checkpoint: str | Path) -> Path | None:
    """The PEFT adapter folder of a LoRA checkpoint (`checkpoint/adapter`, or `checkpoint` itself), else None."""
    checkpoint = Path(checkpoint)
    for folder in (checkpoint / "adapter", checkpoint):
        if (folder / "adapter_config.json").is_file():
            return folder
    return None


def export_merged(checkpoint: str | Path, out: str | Path, base: str | None = None) -> Path:
    """`slime-env export --merge`: the HF folder of the base model with the checkpoint's adapter merged in
    (`peft`'s `merge_and_unload`), and the base's tokenizer files when it has them. `base`: the base model's folder or
    id (default: the adapter's `base_model_name_or_path`). FileNotFoundError / ValueError naming what is missing."""
    import shutil

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder = adapter_folder(checkpoint)
    if folder is None:
        raise FileNotFoundError(f"{checkpoint} holds no LoRA adapter (adapter/adapter_config.json)")
    base = base or json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{folder}/adapter_config.json names no base_model_name_or_path: pass --base")
    model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")
    merged = PeftModel.from_pretrained(model, str(folder)).merge_and_unload()
    out = Path(out)
    merged.save_pretrained(out, safe_serialization=True)
    if Path(base).is_dir():  # the tokenizer travels with the weights
        for f in Path(base).iterdir():
            if f.is_file() and (f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "vocab.json",
                                                                           "merges.txt", "chat_template.jinja")):
                shutil.copy2(f, out / f.name)
    return out
