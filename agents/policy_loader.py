"""`load_policy`: the one place where the engine server and the train loop turn a model name into a policy (the
embedded SmolLM2, the stitched SmolVLM, or a Hugging Face folder; a vision folder gets a `VisionPolicy`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slime_env.agents.default_model import default_model_path, load_default_model, resolve_device


def load_policy(model: str, *, max_batch_size: int = 16, batch_window_s: float = 0.02, device: str = "auto",
                dtype: str = "auto", seed: int | None = None,
                paged_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """(`TransformersPolicy`, model folder) for `model`: "default" (the embedded SmolLM2), "smolvlm" (the stitched
    SmolVLM, `vision_models.stitched_smolvlm`) or a Hugging Face model folder, on `device` in `dtype` ("auto":
    bfloat16 on CUDA, float32 on CPU); `paged_options` go to the paged engine where it runs. An Idefics3 / SmolVLM
    folder gets a `VisionPolicy` (images in the ledger). The one place where the engine server and the train loop
    load a model."""
    from slime_env.agents.transformers_policy import TransformersPolicy
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device, torch_dtype = resolve_device(device, dtype)
    if model == "smolvlm":
        from slime_env.agents.vision_models import smolvlm_path

        model = str(smolvlm_path())
    if model != "default" and _is_vision_folder(model):
        from slime_env.agents.vision_policy import VisionPolicy
        from transformers import AutoModelForImageTextToText, AutoProcessor

        m = AutoModelForImageTextToText.from_pretrained(model, dtype=torch_dtype).to(device).eval()
        return VisionPolicy(m, AutoProcessor.from_pretrained(model), max_batch_size=max_batch_size,
                            batch_window_s=batch_window_s, seed=seed), model
    if model == "default":
        m, tok = load_default_model(device, torch_dtype)
        path = str(default_model_path())
    else:
        m = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype).to(device).eval()
        tok, path = AutoTokenizer.from_pretrained(model), model
    return TransformersPolicy(m, tok, max_batch_size=max_batch_size, batch_window_s=batch_window_s, seed=seed,
                              paged_options=paged_options), path


def _is_vision_folder(model: str) -> bool:
    """Whether `model` is a local folder of an Idefics3 / SmolVLM model (what `VisionPolicy` runs)."""
    import json

    config = Path(model) / "config.json"
    try:
        return json.loads(config.read_text()).get("model_type") in ("idefics3", "smolvlm")
    except (OSError, ValueError):
        return False
