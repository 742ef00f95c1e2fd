"""`VisionPolicy`: the embedded engine (`TransformersPolicy`, continuous batching, prefix cache) on a vision-language
model whose language model the engine already runs (Idefics3 / SmolVLM: a Llama decoder).

How images reach a token-in engine: each image's features (vision tower + connector, computed once per image and
weight version) get a block of *virtual ids* past the vocabulary, and the request's image-token positions are
rewritten to them in order. The language model's embedding (`ImageEmbedding`, the same weight) looks virtual ids up
in that table and real ids up as before, so every path of the engine — packed forward, two-pass prefill, chunked
prefill, decoding — runs unchanged, and its log-probs are the model's own forward with the features merged in
(`Idefics3Model.inputs_merger`, up to float rounding). Virtual ids belong to the image's content hash, never reused:
the per-session prefix cache compares ids, so two different images behind the same placeholder ids never match,
and the same image's cached KV is reused.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from slime_env import Generation
from slime_env.agents.transformers_policy import TransformersPolicy, _check_ids
from slime_env.errors import InvalidInput
from slime_env.images import ImagePart
from slime_env.renderers.vision import image_kwargs


class ImageEmbedding(torch.nn.Embedding):
    """The language model's token embedding (same `weight`), plus rows of image features for ids >= the vocabulary
    size. Real ids cost what they did; a batch with virtual ids adds one lookup per image block it names."""

    def __init__(self, base: torch.nn.Embedding):
        torch.nn.Module.__init__(self)
        self.num_embeddings, self.embedding_dim = base.num_embeddings, base.embedding_dim
        self.padding_idx, self.max_norm, self.norm_type = base.padding_idx, None, 2.0
        self.scale_grad_by_freq, self.sparse = False, False
        self.weight = base.weight
        self.blocks: dict[int, torch.Tensor] = {}  # first virtual id -> (tokens, hidden) features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        virtual = ids >= self.num_embeddings
        if not bool(virtual.any()):
            return F.embedding(ids, self.weight, self.padding_idx)
        out = F.embedding(ids.clamp(max=self.num_embeddings - 1), self.weight, self.padding_idx)
        v = ids[virtual]
        rows = torch.empty((v.numel(), self.embedding_dim), dtype=out.dtype, device=out.device)
        starts = torch.tensor(sorted(self.blocks), device=ids.device)
        which = torch.searchsorted(starts, v, right=True) - 1
        for k in which.unique().tolist():
            start = int(starts[k])
            sel = which == k
            rows[sel] = self.blocks[start][v[sel] - start].to(out.dtype)
        out[virtual] = rows
        return out


class VisionPolicy(TransformersPolicy):
    """A `TransformersPolicy` on `model` (an `Idefics3ForConditionalGeneration`, e.g. `vision_models.stitched_smolvlm`)
    with `processor` (its image processor makes the pixel inputs). `generate(input_ids, params, images=[...])`: the
    images of the whole ledger in token order (`ImagePart`s); the ids hold each image's token run as the processor
    writes it. `model` is the whole VLM (weight updates, trainers' copies); the engine runs its language model.
    Weight updates take the whole model's names and clear the image features."""

    def __init__(self, model: Any, processor: Any, *, feature_cache_tokens: int = 1 << 18, **kwargs: Any):
        if not hasattr(model, "model") or not hasattr(model.model, "text_model") or \
                not hasattr(model.model, "get_image_features"):
            raise InvalidInput(f"VisionPolicy: model {type(model).__name__} is not an Idefics3-style VLM "
                               "(model.text_model + get_image_features); Qwen-VL runs on SGLang (SGLangPolicy)")
        if kwargs.get("batching", "continuous") != "continuous":
            raise InvalidInput("VisionPolicy: batching must be 'continuous' (images ride on the prefix-cached engine)")
        from transformers import LlamaForCausalLM

        self.vlm = model.eval()
        self.processor = processor
        self.image_token_id = int(model.config.image_token_id)
        text = model.model.text_model
        with torch.device("meta"):
            view = LlamaForCausalLM(model.config.text_config)
        view.model, view.lm_head = text, model.lm_head  # the VLM's own modules: one copy of the weights
        if not isinstance(text.embed_tokens, ImageEmbedding):
            text.embed_tokens = ImageEmbedding(text.embed_tokens)
        self.embedding: ImageEmbedding = text.embed_tokens
        self._features: OrderedDict[str, tuple[int, int]] = OrderedDict()  # sha -> (first virtual id, tokens)
        self._next_id = self.embedding.num_embeddings
        self._budget = feature_cache_tokens
        self._in_use: dict[str, int] = {}
        self._lock = threading.Lock()
        kwargs.setdefault("paged", False)
        super().__init__(view.eval(), processor.tokenizer, **kwargs)
        self.model = self.vlm  # the engine keeps the view it was given; everything else sees the whole model

    async def generate(self, input_ids: Sequence[int], sampling_params: Mapping[str, Any], *,
                       rid: str | None = None, session: str | None = None,
                       images: Sequence[ImagePart] = ()) -> Generation:
        ids = _check_ids(input_ids, self.embedding.num_embeddings)
        images = [ImagePart.coerce(im, f"images[{i}]") for i, im in enumerate(images)]
        wanted = ids.count(self.image_token_id)
        if not images:
            if wanted:
                raise InvalidInput(f"input_ids hold {wanted} image tokens but no images were given")
            return await self._generate_continuous(ids, sampling_params, rid, session, asyncio.get_running_loop())
        loop = asyncio.get_running_loop()
        for im in images:
            self._in_use[im.sha256] = self._in_use.get(im.sha256, 0) + 1
        try:
            blocks = await loop.run_in_executor(self._executor, self._blocks, images)
            ids = _virtual_ids(ids, self.image_token_id, blocks)
            return await self._generate_continuous(ids, sampling_params, rid, session, loop)
        finally:
            for im in images:
                self._in_use[im.sha256] -= 1
                if not self._in_use[im.sha256]:
                    del self._in_use[im.sha256]

    @torch.inference_mode()
    def _blocks(self, images: list[ImagePart]) -> list[tuple[int, int]]:
        """(first virtual id, tokens) of each image, computing the features of those not cached."""
        with self._lock:
            out = []
            for im in images:
                hit = self._features.get(im.sha256)
                if hit is None:
                    feats = self.image_features(im)
                    hit = (self._next_id, feats.shape[0])
                    self._next_id += feats.shape[0]
                    self.embedding.blocks[hit[0]] = feats
                    self._features[im.sha256] = hit
                self._features.move_to_end(im.sha256)
                out.append(hit)
            self._evict()
            return out

    def image_features(self, image: ImagePart) -> torch.Tensor:
        """(tokens, hidden) features of `image` as the model merges them into its embeddings."""
        arrays = pixel_inputs(self.processor, image)
        dtype = self.embedding.weight.dtype
        pv = torch.from_numpy(arrays["pixel_values"]).to(self.device, dtype)
        mask = torch.from_numpy(arrays["pixel_attention_mask"]).to(self.device) \
            if "pixel_attention_mask" in arrays else None
        return self.vlm.model.get_image_features(pv, mask).pooler_output[0]

    def _evict(self) -> None:
        total = sum(n for _, n in self._features.values())
        for sha in list(self._features):
            if total <= self._budget:
                break
            if sha in self._in_use:
                continue
            start, n = self._features.pop(sha)
            self.embedding.blocks.pop(start, None)
            total -= n

    def invalidate_images(self) -> None:
        """Forget every image's features (new weights): the next request computes them again, under new ids."""
        with self._lock:
            self._features.clear()
            self.embedding.blocks.clear()

    def _load(self, weights: Mapping[str, torch.Tensor] | str, partial: bool = False) -> None:
        super()._load(weights, partial)  # the whole VLM's names (vision tower and connector included)
        self.invalidate_images()


def pixel_inputs(processor: Any, image: ImagePart) -> dict[str, Any]:
    """The processor's pixel arrays for one image (numpy), as its `__call__` makes them."""
    out = processor.image_processor([image.pil()], **image_kwargs(processor), return_tensors="np")
    return {k: v for k, v in out.items() if k not in ("rows", "cols")}


def _virtual_ids(ids: list[int], image_token: int, blocks: list[tuple[int, int]]) -> list[int]:
    """`ids` with the k-th image token replaced by the k-th row of the images' blocks, in order."""
    total = sum(n for _, n in blocks)
    positions = [i for i, t in enumerate(ids) if t == image_token]
    if len(positions) != total:
        raise InvalidInput(f"input_ids hold {len(positions)} image tokens but the {len(blocks)} images given make "
                           f"{total}: images must be the ledger's, in token order")
    out = list(ids)
    rows = (start + j for start, n in blocks for j in range(n))
    for i, v in zip(positions, rows):
        out[i] = v
    return out
