"""Synthetic pictures with verifiable answers, drawn with Pillow from a (kind, seed) pair: the same pair always draws
the same picture, so a task is a small JSON row and its image is made again wherever the episode runs.

Kinds: `count` (how many shapes), `bars` (which of two bars is taller), `clock` (the hour an analog clock shows),
`chart` (which labelled bar of a chart is highest), and for the zoom env `search_scene` (a large picture with one marked
cell holding a small digit).
"""

from __future__ import annotations

import random
from typing import Any

KINDS = ("count", "bars", "clock", "chart")
COLORS = [(220, 40, 40), (40, 160, 60), (40, 80, 220), (230, 160, 20), (150, 50, 180)]


def _canvas(size: int) -> tuple[Any, Any]:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), (255, 255, 255))
    return img, ImageDraw.Draw(img)


def draw(kind: str, seed: int, size: int = 128) -> tuple[Any, str, str]:
    """(PIL image, question, answer) of picture `kind` drawn from `seed` at `size` x `size` pixels."""
    rng = random.Random(f"{kind}:{seed}")
    if kind == "count":
        return _count(rng, size)
    if kind == "bars":
        return _bars(rng, size)
    if kind == "clock":
        return _clock(rng, size)
    if kind == "chart":
        return _chart(rng, size)
    raise ValueError(f"picture kind {kind!r} is not one of {KINDS}")


def _count(rng: random.Random, size: int) -> tuple[Any, str, str]:
    img, d = _canvas(size)
    n = rng.randint(1, 5)
    cells = rng.sample(range(9), n)  # a 3x3 grid of places: shapes never overlap
    step = size // 3
    for c in cells:
        x, y = (c % 3) * step + step // 2, (c // 3) * step + step // 2
        r = rng.randint(step // 5, step // 3)
        box = (x - r, y - r, x + r, y + r)
        color = rng.choice(COLORS)
        d.ellipse(box, fill=color) if rng.random() < 0.5 else d.rectangle(box, fill=color)
    return img, "How many shapes are in the image?", str(n)


def _bars(rng: random.Random, size: int) -> tuple[Any, str, str]:
    img, d = _canvas(size)
    h = rng.sample(range(size // 6, size - size // 8), 2)
    w = size // 5
    for i, height in enumerate(h):
        x = size // 5 + i * (2 * w)
        d.rectangle((x, size - height, x + w, size - 1), fill=COLORS[2])
    return img, "Which bar is taller, left or right?", "left" if h[0] > h[1] else "right"


def _clock(rng: random.Random, size: int) -> tuple[Any, str, str]:
    import math

    img, d = _canvas(size)
    hour = rng.randint(1, 12)
    c, r = size / 2, size * 0.45
    d.ellipse((c - r, c - r, c + r, c + r), outline=(0, 0, 0), width=max(1, size // 64))
    for k in range(12):  # hour ticks
        a = math.radians(k * 30)
        d.line((c + 0.85 * r * math.sin(a), c - 0.85 * r * math.cos(a), c + r * math.sin(a), c - r * math.cos(a)),
               fill=(0, 0, 0), width=max(1, size // 96))
    a = math.radians(hour * 30)
    d.line((c, c, c + 0.6 * r * math.sin(a), c - 0.6 * r * math.cos(a)), fill=(0, 0, 0), width=max(2, size // 32))
    return img, "The clock has only an hour hand. What hour does it show (1-12)?", str(hour)


def _chart(rng: random.Random, size: int) -> tuple[Any, str, str]:
    img, d = _canvas(size)
    labels = "ABCD"
    heights = rng.sample(range(size // 8, size - size // 6), 4)
    w = size // 6
    for i, height in enumerate(heights):
        x = size // 12 + i * (w + size // 14)
        d.rectangle((x, size - height - 12, x + w, size - 13), fill=COLORS[i])
        d.text((x + w // 3, size - 11), labels[i], fill=(0, 0, 0))
    return img, "Which bar of the chart (A, B, C or D) is highest?", labels[heights.index(max(heights))]


def search_scene(seed: int, size: int = 512, grid: int = 4) -> tuple[Any, int, int, str]:
    """(PIL image of `size` pixels, row, col, digit): a `grid` x `grid` board of pale cells, one marked with a red
    corner dot (visible when the picture is shrunk) and holding a small digit (readable only at full size)."""
    from PIL import ImageFont

    rng = random.Random(f"search:{seed}")
    img, d = _canvas(size)
    cell = size // grid
    for k in range(grid + 1):
        d.line((k * cell, 0, k * cell, size), fill=(200, 200, 200))
        d.line((0, k * cell, size, k * cell), fill=(200, 200, 200))
    for _ in range(grid * grid * 3):  # clutter: small grey specks everywhere
        x, y = rng.randrange(size), rng.randrange(size)
        d.rectangle((x, y, x + 1, y + 1), fill=(170, 170, 170))
    row, col, digit = rng.randrange(grid), rng.randrange(grid), str(rng.randrange(10))
    x0, y0 = col * cell, row * cell
    dot = max(4, cell // 8)
    d.ellipse((x0 + 3, y0 + 3, x0 + 3 + dot, y0 + 3 + dot), fill=(230, 30, 30))
    font = ImageFont.load_default(size=max(8, cell // 10))
    d.text((x0 + cell // 2 + rng.randint(-cell // 5, cell // 5), y0 + cell // 2 + rng.randint(-cell // 5, cell // 5)),
           digit, fill=(0, 0, 0), font=font)
    return img, row + 1, col + 1, digit
