"""Renderers for vision-language models: images placed in the ids exactly as the model's own processor places them.

The chat template writes one placeholder per image (`<image>` for Idefics3 / SmolVLM, `<|vision_start|><|image_pad|>
<|vision_end|>` for Qwen2.5-VL / Qwen3-VL); the processor then replaces each placeholder with the image's run of
tokens, whose length its image processor decides (Idefics3: tiles x `image_seq_len`, with row/column tags; Qwen: the
grid's patches / merge_size²). `VisionRenderer` does the same replacement with the processor's own code
(`replace_image_token` over the image processor's outputs), per image, cached by the image's hash, then encodes the
text as every renderer does. So a prompt, a bridge after a tool that returned an image, and strict mode's full render
all agree with `processor(text=template_text, images=...)`. Every image token is inserted (loss mask 0): a policy never
samples one.

`image_inputs(images)` gives the processor's outputs for a ledger's images (`VisionInputs`), collated as the
processor collates one sequence's images, for engines and trainers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from slime_env.errors import InvalidInput, RenderError
from slime_env.images import ImagePart, VisionInputs
from slime_env.renderers.template import TemplateRenderer
from slime_env.types import Message


class VisionRenderer(TemplateRenderer):
    """A `TemplateRenderer` over a transformers multimodal processor (`processor.tokenizer`, `processor.image_token`,
    `processor.replace_image_token`). `chat_template` defaults to the processor's."""

    family = "vision"
    renders_images = True
    #: The template indexes `message['content'][0]`: every message's content is given as a list of parts.
    list_content = False
    #: Axis along which one image's arrays join the others' (Idefics3's pixel_values are [1, tiles, C, H, W]).
    join_axis: Mapping[str, int] = {}

    def __init__(self, processor: Any, *, chat_template: str | None = None, image_cache: int = 512, **kw: Any):
        if not hasattr(processor, "replace_image_token") or getattr(processor, "image_token", None) is None:
            raise InvalidInput(f"processor: {type(processor).__name__} is not a multimodal processor with an "
                               "image_token and replace_image_token (transformers >= 5.24)")
        self.processor = processor
        self.image_token = processor.image_token
        self._images: OrderedDict[str, tuple[str, dict[str, Any]]] = OrderedDict()  # sha -> (run text, arrays)
        self._image_cache = image_cache
        template = chat_template or getattr(processor, "chat_template", None)
        super().__init__(processor.tokenizer, chat_template=template, **kw)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_images"] = OrderedDict()  # rebuilt on demand on the other side
        return state

    # --- images --------------------------------------------------------------------------------
    def image_run(self, image: ImagePart) -> str:
        """The text the processor puts in place of `image`'s placeholder."""
        return self._processed(image)[0]

    def image_inputs(self, images: Sequence[ImagePart]) -> VisionInputs:
        """The processor's outputs for `images` (one sequence's, in token order), collated as the processor collates
        them, with the number of ids each image occupies."""
        import numpy as np

        per = [self._processed(im) for im in images]
        arrays: dict[str, Any] = {}
        for key in (per[0][1] if per else {}):
            arrays[key] = np.concatenate([p[1][key] for p in per], axis=self.join_axis.get(key, 0))
        return VisionInputs(images=tuple(images), arrays=arrays,
                            tokens=tuple(len(self.encode(run)) for run, _ in per))

    def _processed(self, image: ImagePart) -> tuple[str, dict[str, Any]]:
        hit = self._images.get(image.sha256)
        if hit is not None:
            self._images.move_to_end(image.sha256)
            return hit
        out, runs = self.processor._process_images([image.pil()], **image_kwargs(self.processor), return_tensors="np")
        arrays = {k: v for k, v in out.items() if k not in ("rows", "cols")}
        hit = (runs[0], arrays)
        self._images[image.sha256] = hit
        if len(self._images) > self._image_cache:
            self._images.popitem(last=False)
        return hit

    # --- rendering -----------------------------------------------------------------------------
    def template_messages(self, messages: Sequence[Message | Mapping[str, Any]]) -> list[dict]:
        dicts = super().template_messages(messages)
        for d, m in zip(dicts, messages):
            if isinstance(m, Message) and m.images:
                d["content"] = m.parts()
        return dicts

    def _guard(self, dicts: list[dict]) -> list[dict]:
        out = []
        for d in dicts:
            content = d.get("content")
            if isinstance(content, list) and d.get("role") != "assistant":
                parts = [self._guard_part(p) for p in content]
                d = {**d, "content": parts}
            out.append(d)
        return super()._guard(out)

    def _guard_part(self, part: Any) -> Any:
        if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
            guarded = super()._guard([{"role": "user", "content": part["text"]}])[0]["content"]
            return {**part, "text": guarded}
        return part

    def _render(self, dicts: list[dict], *, tools, add_generation_prompt: bool) -> str:
        runs: list[str] = []
        shown = []
        for d in dicts:
            content = d.get("content")
            if isinstance(content, list):
                parts = []
                for p in content:
                    if isinstance(p, Mapping) and p.get("type") == "image":
                        runs.append(self._run_of(p))
                        parts.append({"type": "image"})
                    else:
                        parts.append(p)
                d = {**d, "content": parts}
            elif self.list_content:
                d = {**d, "content": [{"type": "text", "text": content or ""}]}
            shown.append(d)
        text = super()._render(shown, tools=tools, add_generation_prompt=add_generation_prompt)
        pieces = text.split(self.image_token)
        if len(pieces) != len(runs) + 1:
            raise RenderError(f"{self.family} renderer: the chat template wrote {len(pieces) - 1} image placeholders "
                              f"({self.image_token!r}) for {len(runs)} images")
        out = [pieces[0]]
        for run, piece in zip(runs, pieces[1:]):
            out += [run, piece]
        return "".join(out)

    def _run_of(self, part: Mapping[str, Any]) -> str:
        image = part.get("image")
        if isinstance(image, ImagePart):
            return self.image_run(image)
        hit = self._images.get(part.get("sha256"))  # a JSON-ready part (`Message.to_dict`): decoded only if new
        return hit[0] if hit is not None else self.image_run(ImagePart.coerce(part, "message image"))


def image_kwargs(processor: Any) -> dict[str, Any]:
    """The image-processor kwargs the processor's own `__call__` uses (its defaults merged with the tokenizer's), in
    transformers 5.17 (`_merge_kwargs(ModelProcessorKwargs, ...)`) and 5.24 (`_merge_kwargs(...)`) alike."""
    import inspect
    import sys

    merge = processor._merge_kwargs
    if "ModelProcessorKwargs" not in inspect.signature(merge).parameters:
        kwargs = merge(tokenizer_init_kwargs=processor.tokenizer.init_kwargs)["images_kwargs"]
    else:  # the processor module's own *ProcessorKwargs class (a TypedDict) holds its defaults
        from transformers.processing_utils import ProcessingKwargs

        kinds = [obj for c in type(processor).__mro__ for name, obj in vars(sys.modules[c.__module__]).items()
                 if name.endswith("ProcessorKwargs") and isinstance(getattr(obj, "_defaults", None), dict)]
        kwargs = merge(kinds[0] if kinds else ProcessingKwargs,
                       tokenizer_init_kwargs=processor.tokenizer.init_kwargs)["images_kwargs"]
    kwargs.pop("return_tensors", None)
    return kwargs


class Idefics3Renderer(VisionRenderer):
    """Idefics3 and SmolVLM (`<|im_start|>User:<image>...<end_of_utterance>\\nAssistant:`): each `<image>` becomes
    `<fake_token_around_image><global-img>` + `image_seq_len` x `<image>` + `<fake_token_around_image>` (plus one
    tagged run per tile when the image processor splits images). Turns end with `<end_of_utterance>`."""

    family = "idefics3"
    list_content = True
    join_axis = {"pixel_values": 1, "pixel_attention_mask": 1}
    rewrites_history = ("writes ': ' before an assistant turn's content: a turn generated without a leading space "
                        "re-renders with one",)

    def template_messages(self, messages: Sequence[Message | Mapping[str, Any]]) -> list[dict]:
        # The generation prompt is `Assistant:` and history is `Assistant: {content}`: the model's own leading space
        # is the template's, so it leaves the content (as SmolVLM's processor is given it).
        dicts = super().template_messages(messages)
        for d in dicts:
            if d.get("role") == "assistant" and isinstance(d.get("content"), str) and d["content"].startswith(" "):
                d["content"] = d["content"][1:]
        return dicts

    def _default_stop_ids(self) -> list[int]:
        vocab = self.tokenizer.get_vocab()
        return [vocab[t] for t in ("<end_of_utterance>", "<|im_end|>", "<|endoftext|>") if t in vocab]


class QwenVLRenderer(VisionRenderer):
    """Qwen2-VL, Qwen2.5-VL and Qwen3-VL (ChatML): each `<|vision_start|><|image_pad|><|vision_end|>` gets
    (grid_t x grid_h x grid_w) / merge_size² `<|image_pad|>`. Turns end with `<|im_end|>`."""

    family = "qwen_vl"

    def _default_stop_ids(self) -> list[int]:
        vocab = self.tokenizer.get_vocab()
        return [vocab[t] for t in ("<|im_end|>", "<|endoftext|>") if t in vocab]
