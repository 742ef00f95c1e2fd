"""Final-answer extraction from model text: `\\boxed{}`, `<answer>`, `Answer: ...` and GSM8K's `#### ...`.

`last_number` (opt-in, not in `FORMATS`) takes the last number in the text, for models too small to use a
format. The last occurrence in the text wins, across whichever formats are enabled: models restate, correct
themselves, and quote the prompt's example format before answering. `\\boxed{}` is matched with
balanced braces (`\\boxed{\\frac{1}{2}}`), and `\\fbox{}` counts as a box.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

FORMATS = ("boxed", "answer_tag", "answer_colon", "hash")
ALL_FORMATS = (*FORMATS, "last_number")  # last_number: lenient, opt-in (small models rarely use tags)
_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ANSWER_COLON = re.compile(r"(?im)^[ \t*#>]*(?:final\s+)?answer\s*[:：]\s*(.+?)\s*$")
_HASH = re.compile(r"(?m)^[ \t]*####[ \t]*(.+?)[ \t]*$")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_answer(text: str, formats: Sequence[str] = FORMATS) -> str | None:
    """The last final answer in `text` among `formats` (names in `FORMATS`), stripped; None if none."""
    unknown = set(formats) - set(ALL_FORMATS)
    if unknown:
        raise ValueError(f"unknown answer formats {sorted(unknown)}; known: {ALL_FORMATS}")
    best: tuple[int, str] | None = None
    for fmt in formats:
        for pos, value in _FINDERS[fmt](text):
            if best is None or pos >= best[0]:
                best = (pos, value)
    if best is None:
        return None
    value = best[1].strip()
    return value or None


def _boxed(text: str) -> list[tuple[int, str]]:
    out = []
    for m in _BOX.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            out.append((m.start(), text[m.end():i - 1]))
    return out


def _answer_tag(text: str) -> list[tuple[int, str]]:
    out = []
    for m in _ANSWER_TAG.finditer(text):
        inner = m.group(1)
        boxed = _boxed(inner)  # "<answer>\boxed{3}</answer>": the box is the answer
        out.append((m.start(), boxed[-1][1] if boxed else inner))
    return out


def _answer_colon(text: str) -> list[tuple[int, str]]:
    out = []
    for m in _ANSWER_COLON.finditer(text):
        value = m.group(1).strip().rstrip(".")
        boxed = _boxed(value)
        out.append((m.start(), boxed[-1][1] if boxed else value.strip("$ ")))
    return out


def _hash(text: str) -> list[tuple[int, str]]:
    return [(m.start(), m.group(1).replace(",", "")) for m in _HASH.finditer(text)]


def _last_number(text: str) -> list[tuple[int, str]]:
    return [(m.start(), m.group(0).replace(",", "")) for m in _NUMBER.finditer(text)][-1:]


_FINDERS = {"boxed": _boxed, "answer_tag": _answer_tag, "answer_colon": _answer_colon, "hash": _hash,
            "last_number": _last_number}


def gold_answer(label: object) -> str:
    """A dataset label as the gold answer string: boxed or `####` labels are unwrapped, numbers stringified."""
    if isinstance(label, (list, tuple)) and label:
        label = label[0]
    text = str(label).strip() if label is not None else ""
    inner = extract_answer(text, ("boxed", "hash")) if ("\\boxed" in text or "####" in text) else None
    return inner if inner is not None else text.strip("$ ")
