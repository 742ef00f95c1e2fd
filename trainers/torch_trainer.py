"""`TorchTrainer`, the reference RL trainer on a Hugging Face causal LM (CPU or one GPU); `TrainerConfig` (the run
config's `trainer:` section, `slime_env.trainers.trainer_config`) is importable from here too.

`TorchTrainer` is the RL step of `slime_env.trainers.step` (pack, old / reference log-probs, mini-batches,
micro-slices, the loss of `slime_env.trainers.algorithms`, the exact reduction, AdamW) over a `TorchBackend`
(`slime_env.trainers.backends.torch`). `save`/`load` checkpoint model, optimizer and step; `sync` pushes the new
weights to an engine through the weight channels of `slime_env.trainers.weight_sync` (in place for a
`TransformersPolicy`, from memory or a model folder for SGLang or `serve-engine`), the same ones `slime-env train`
uses.
"""

from __future__ import annotations

from pathlib import Path

import torch
from slime_env.trainers.trainer import Trainer
from slime_env.trainers.trainer_config import BACKENDS, TrainerConfig

__all__ = ["BACKENDS", "TorchTrainer", "TrainerConfig", "read_hf_weights"]


class TorchTrainer(Trainer):
    """RL updates of `model` (a transformers causal LM, CPU or one GPU): the RL step (`trainers.step`) over a
    `TorchBackend` (`trainers.backends.torch`). `ref_model`: the KL reference (default: a frozen copy of `model`,
    with LoRA the base model)."""

    def __init__(self, model: torch.nn.Module, config: TrainerConfig | None = None, *, pad_id: int,
                 ref_model: torch.nn.Module | None = None):
        from slime_env.trainers.backends.torch import TorchBackend

        super().__init__(TorchBackend(model, config, pad_id=pad_id, ref_model=ref_model))


def read_hf_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the HF folder `path/model` (a trainer checkpoint) or `path` itself (a model folder), read
    from its safetensors files; FileNotFoundError naming the folder when it holds none."""
    from safetensors.torch import load_file

    path = Path(path)
    folder = path / "model" if (path / "model").is_dir() else path
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights under {folder}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state

