"""Renderers: the token ledger's bridge between chat messages and token ids.

`get_renderer(tokenizer)` picks the family from the tokenizer's chat template (or pass
`family="chatml" | "qwen3" | "qwen3_5" | "qwen3_6" | "llama3" | "deepseek_r1" | "deepseek_v31" | "glm45" |
"minimax_m2" | "gpt_oss" | "template"`, or an import path). Register your own with `register_renderer(name, cls)`.
Vision-language models: pass the model's processor instead of its tokenizer (`family="idefics3"` / `"smolvlm"` /
`"qwen_vl"`, or "auto" from the processor's image token): `slime_env.renderers.vision`.
"""

from __future__ import annotations

from typing import Any

from slime_env.errors import InvalidInput
from slime_env.loading import load_object
from slime_env.renderers.families import (
    ChatMLRenderer,
    DeepSeekR1Renderer,
    DeepSeekV31Renderer,
    GLM45Renderer,
    GptOssRenderer,
    Llama3Renderer,
    MiniMaxM2Renderer,
    Qwen3Renderer,
    Qwen35Renderer,
    Qwen36Renderer,
)
from slime_env.renderers.template import TemplateRenderer, VerifiedPrefix
from slime_env.renderers.vision import Idefics3Renderer, QwenVLRenderer, VisionRenderer

_FAMILIES: dict[str, type[TemplateRenderer]] = {
    "template": TemplateRenderer,
    "chatml": ChatMLRenderer,
    "qwen2.5": ChatMLRenderer,
    "smollm2": ChatMLRenderer,
    "qwen3": Qwen3Renderer,
    "llama3": Llama3Renderer,
    "deepseek_r1": DeepSeekR1Renderer,
    "qwen3_5": Qwen35Renderer,
    "qwen3_6": Qwen36Renderer,
    "deepseek_v31": DeepSeekV31Renderer,
    "glm45": GLM45Renderer,
    "minimax_m2": MiniMaxM2Renderer,
    "gpt_oss": GptOssRenderer,
    "idefics3": Idefics3Renderer,
    "smolvlm": Idefics3Renderer,
    "qwen_vl": QwenVLRenderer,
}
_VISION_FAMILIES = {"<image>": "idefics3", "<|image_pad|>": "qwen_vl"}


def register_renderer(name: str, cls: type[TemplateRenderer]) -> None:
    """Make `cls` selectable as `family=name`."""
    _FAMILIES[name] = cls


def detect_family(chat_template: str) -> str:
    """Guess the family from a chat template's text."""
    if "<|im_start|>" in chat_template:
        if "<function=" in chat_template and "<think>" in chat_template:  # Qwen3.5 / 3.6: XML calls, thinking
            return "qwen3_6" if "args_value | string if args_value is string" in chat_template else "qwen3_5"
        return "qwen3" if "enable_thinking" in chat_template or "<think>" in chat_template else "chatml"
    if "<|start_header_id|>" in chat_template:
        return "llama3"
    if "<｜Assistant｜>" in chat_template:
        return "deepseek_v31" if "<｜tool▁sep｜>' + tool['function']['arguments']" in chat_template else "deepseek_r1"
    if "<|observation|>" in chat_template and "<arg_key>" in chat_template:
        return "glm45"
    if "]~b]ai" in chat_template:
        return "minimax_m2"
    if "<|channel|>" in chat_template and "<|start|>" in chat_template:
        return "gpt_oss"
    return "template"


def get_renderer(tokenizer: Any, family: str = "auto", **kwargs: Any) -> TemplateRenderer:
    """A renderer for `tokenizer`. `family`: "auto", a registered name, or "pkg.mod:Class"."""
    if family == "auto" and getattr(tokenizer, "image_token", None) in _VISION_FAMILIES:  # a VLM's processor
        family = _VISION_FAMILIES[tokenizer.image_token]
    if family == "auto":
        family = detect_family(kwargs.get("chat_template") or getattr(tokenizer, "chat_template", "") or "")
    if family in _FAMILIES:
        cls = _FAMILIES[family]
    elif "." in family or ":" in family:
        cls = load_object(family)
    else:
        raise InvalidInput(f"unknown renderer family {family!r}; known: {sorted(_FAMILIES)}")
    return cls(tokenizer, **kwargs)


__all__ = ["ChatMLRenderer", "DeepSeekR1Renderer", "DeepSeekV31Renderer", "GLM45Renderer", "GptOssRenderer",
           "Idefics3Renderer", "Llama3Renderer", "MiniMaxM2Renderer", "Qwen35Renderer", "Qwen36Renderer",
           "Qwen3Renderer", "QwenVLRenderer", "TemplateRenderer", "VerifiedPrefix", "VisionRenderer", "detect_family",
           "get_renderer", "register_renderer"]
