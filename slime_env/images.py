"""Images in chat messages: `ImagePart` (one validated image, held as PNG bytes with its content hash) and
`VisionInputs` (the images of one ledger, in token order, with the processor's outputs for them).

A message's content may be a list of parts: text (str or `{"type": "text", "text": ...}`) and images (a PIL image,
an `HxWxC` uint8 array, a path, raw bytes, a `data:` URL, or `{"type": "image", "image": any of those}`).
`ImagePart.coerce` validates one (size caps below) and names the field on error. Pillow is imported only when an
image is actually given (the `[vision]` extra).
"""

from __future__ import annotations

import base64
import hashlib
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slime_env.errors import InvalidInput
from slime_env.fast_pickle import fast_pickle

MAX_IMAGE_BYTES = 32 * 1024 * 1024   # an encoded image larger than this is refused (a decompression bomb guard)
MAX_IMAGE_PIXELS = 4096 * 4096       # decoded width x height above this is refused
# An image's place inside a message's text: a private-use pair around its hash. No tokenizer sees it: renderers turn
# it back into an image part before the chat template runs, and `Message.text` drops it.
SLOT_OPEN, SLOT_CLOSE = "\ue010", "\ue011"


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError:
        raise InvalidInput("images need Pillow: pip install 'slime_env[vision]'") from None
    return Image


@fast_pickle
@dataclass(frozen=True, slots=True, eq=False)
class ImagePart:
    """One image: `png` (lossless bytes of its RGB pixels), `width`, `height`, `sha256` (of the pixels and size: two
    images are equal exactly when their pixels are). Build one with `ImagePart.coerce`."""

    png: bytes
    width: int
    height: int
    sha256: str

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ImagePart) and other.sha256 == self.sha256

    def __hash__(self) -> int:
        return hash(self.sha256)

    @property
    def slot(self) -> str:
        """The text that marks this image's place in a message's `content`."""
        return f"{SLOT_OPEN}{self.sha256}{SLOT_CLOSE}"

    def pil(self) -> Any:
        """The image as an RGB `PIL.Image.Image`."""
        return _pil().open(io.BytesIO(self.png)).convert("RGB")

    def data_url(self) -> str:
        """`data:image/png;base64,...`: the form SGLang's `image_data` and JSON records take."""
        return "data:image/png;base64," + base64.b64encode(self.png).decode("ascii")

    def to_dict(self) -> dict[str, Any]:
        return {"type": "image", "image": self.data_url(), "sha256": self.sha256}

    @classmethod
    def coerce(cls, value: Any, where: str = "image") -> ImagePart:
        """An `ImagePart` from a PIL image, an `HxW` / `HxWx{1,3,4}` uint8 array, a path, encoded bytes, a `data:`
        URL or an `{"type": "image", "image": ...}` dict; InvalidInput naming `where` if it is none of those, cannot
        be decoded, or exceeds `MAX_IMAGE_BYTES` / `MAX_IMAGE_PIXELS`."""
        if isinstance(value, ImagePart):
            return value
        if isinstance(value, Mapping):
            inner = value.get("image", value.get("url", value.get("path")))
            if inner is None:
                raise InvalidInput(f"{where}: an image part needs an 'image' (or 'url' / 'path') field, got "
                                   f"fields {sorted(value)}")
            return cls.coerce(inner, f"{where}.image")
        Image = _pil()
        if isinstance(value, Image.Image):
            img = value
        elif isinstance(value, (bytes, bytearray, memoryview)):
            img = _decode(bytes(value), where)
        elif isinstance(value, str) and value.startswith("data:"):
            try:
                raw = base64.b64decode(value.split(",", 1)[1], validate=True)
            except (IndexError, ValueError):
                raise InvalidInput(f"{where}: malformed data URL") from None
            img = _decode(raw, where)
        elif isinstance(value, (str, Path)):
            path = Path(value)
            if not path.is_file():
                raise InvalidInput(f"{where}: no image file at {str(path)!r}")
            if path.stat().st_size > MAX_IMAGE_BYTES:
                raise InvalidInput(f"{where}: {path} is {path.stat().st_size} bytes, over {MAX_IMAGE_BYTES}")
            img = _decode(path.read_bytes(), where)
        elif hasattr(value, "__array_interface__") or type(value).__module__.startswith(("numpy", "torch")):
            img = _from_array(value, where)
        else:
            raise InvalidInput(f"{where}: expected a PIL image, an array, a path, bytes or a data URL, got "
                               f"{type(value).__name__}")
        if img.width * img.height > MAX_IMAGE_PIXELS or img.width < 1 or img.height < 1:
            raise InvalidInput(f"{where}: image of {img.width}x{img.height} pixels is outside 1..{MAX_IMAGE_PIXELS}")
        rgb = img.convert("RGB")
        digest = hashlib.sha256(f"{rgb.width}x{rgb.height}:".encode() + rgb.tobytes()).hexdigest()
        buf = io.BytesIO()
        rgb.save(buf, format="PNG")
        return cls(png=buf.getvalue(), width=rgb.width, height=rgb.height, sha256=digest)


def _decode(raw: bytes, where: str) -> Any:
    if len(raw) > MAX_IMAGE_BYTES:
        raise InvalidInput(f"{where}: encoded image of {len(raw)} bytes is over {MAX_IMAGE_BYTES}")
    Image = _pil()
    try:
        img = Image.open(io.BytesIO(raw))
        if img.width * img.height > MAX_IMAGE_PIXELS:  # checked before the pixels are decoded
            raise InvalidInput(f"{where}: image of {img.width}x{img.height} pixels is over {MAX_IMAGE_PIXELS}")
        img.load()
    except InvalidInput:
        raise
    except Exception as e:  # noqa: BLE001 - Pillow raises many types for undecodable data
        raise InvalidInput(f"{where}: cannot decode image ({type(e).__name__}: {e})") from None
    return img


def _from_array(value: Any, where: str) -> Any:
    import numpy as np

    arr = np.asarray(value.detach().cpu() if hasattr(value, "detach") else value)
    if arr.ndim == 3 and arr.shape[-1] == 1:
        arr = arr[..., 0]
    if arr.dtype != np.uint8 or not (arr.ndim == 2 or (arr.ndim == 3 and arr.shape[-1] in (3, 4))):
        raise InvalidInput(f"{where}: an image array must be uint8 of shape HxW or HxWx{{1,3,4}}, got {arr.dtype} "
                           f"{tuple(arr.shape)}")
    if arr.shape[0] * arr.shape[1] > MAX_IMAGE_PIXELS:
        raise InvalidInput(f"{where}: image of {arr.shape[1]}x{arr.shape[0]} pixels is over {MAX_IMAGE_PIXELS}")
    return _pil().fromarray(arr)


def split_content(content: Any, where: str) -> tuple[str, tuple[ImagePart, ...]]:
    """A message's content as (text with each image's slot in its place, images in order). `content` is a str or a
    list of parts; InvalidInput naming `where[i]` for a bad part."""
    if isinstance(content, str):
        return content, ()
    if isinstance(content, (bytes, Mapping)) or not isinstance(content, Sequence):
        raise InvalidInput(f"{where}: content must be a str or a list of text and image parts, got "
                           f"{type(content).__name__}")
    text, images = [], []
    for i, part in enumerate(content):
        if isinstance(part, str):
            text.append(part)
        elif isinstance(part, Mapping) and part.get("type") == "text":
            if not isinstance(part.get("text"), str):
                raise InvalidInput(f"{where}[{i}]: a text part needs a str 'text' field")
            text.append(part["text"])
        elif isinstance(part, Mapping) and part.get("type") not in (None, "image", "image_url"):
            raise InvalidInput(f"{where}[{i}]: part type {part.get('type')!r} is not 'text' or 'image'")
        else:
            if isinstance(part, Mapping) and part.get("type") == "image_url":  # the OpenAI shape
                url = part.get("image_url")
                part = url.get("url") if isinstance(url, Mapping) else url
            img = ImagePart.coerce(part, f"{where}[{i}]")
            images.append(img)
            text.append(img.slot)
    return "".join(text), tuple(images)


def content_parts(text: str, images: Sequence[ImagePart]) -> list[dict[str, Any]]:
    """The inverse of `split_content`: chat-template parts (`{"type": "text"}` / `{"type": "image"}` with the
    `ImagePart` under "image"), empty text between parts left out."""
    by_slot = {im.slot: im for im in images}
    parts: list[dict[str, Any]] = []
    rest = text
    while rest:
        at = rest.find(SLOT_OPEN)
        if at < 0:
            parts.append({"type": "text", "text": rest})
            break
        if at:
            parts.append({"type": "text", "text": rest[:at]})
        end = rest.find(SLOT_CLOSE, at)
        parts.append({"type": "image", "image": by_slot[rest[at:end + 1]]})
        rest = rest[end + 1:]
    return parts


def strip_slots(text: str) -> str:
    """`text` without image slots (what a text-only reader of a message sees)."""
    while SLOT_OPEN in text:
        at = text.find(SLOT_OPEN)
        text = text[:at] + text[text.find(SLOT_CLOSE, at) + 1:]
    return text


@fast_pickle
@dataclass(frozen=True, slots=True)
class VisionInputs:
    """The images of one ledger, in the order their tokens appear, and what the model's processor made of them:
    `arrays` (e.g. `pixel_values`, `pixel_attention_mask` or `image_grid_thw`, as numpy arrays, collated for one
    sequence) and `tokens` (the ids each image occupies). Engines and trainers use `arrays` as they are: nothing
    is processed twice."""

    images: tuple[ImagePart, ...]
    arrays: Mapping[str, Any] = field(default_factory=dict)
    tokens: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"images": [im.to_dict() for im in self.images], "tokens": list(self.tokens),
                "arrays": {k: _array_dict(v) for k, v in self.arrays.items()}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> VisionInputs:
        return cls(images=tuple(ImagePart.coerce(x, f"vision.images[{i}]") for i, x in enumerate(d["images"])),
                   arrays={k: _array_from(v) for k, v in d.get("arrays", {}).items()},
                   tokens=tuple(int(t) for t in d.get("tokens", ())))


def _array_dict(a: Any) -> dict[str, Any]:
    import numpy as np

    a = np.ascontiguousarray(a)
    return {"dtype": str(a.dtype), "shape": list(a.shape), "data": base64.b64encode(a.tobytes()).decode("ascii")}


def _array_from(d: Mapping[str, Any]) -> Any:
    import numpy as np

    return np.frombuffer(base64.b64decode(d["data"]), dtype=d["dtype"]).reshape(d["shape"]).copy()


def image_hash(images: Sequence[ImagePart]) -> str:
    """One hash of a sequence of images (order matters)."""
    return hashlib.sha256("".join(im.sha256 for im in images).encode()).hexdigest()
