"""Visual envs: observations that hold images (`Message` content parts), answers a rule checks.

- `VisualReasoning-v0` (`VisualReasoningEnv`): one picture and one question (count shapes, compare two bars, read an
  hour-hand clock, find a chart's highest bar); reward 1.0 when `<answer>X</answer>` (or the turn's last word) is the
  drawn answer. Tasks: `{"prompt": question, "label": answer, "metadata": {"kind": "count", "seed": 7}}`
  (`visual_tasks` makes them); the picture is drawn again from (kind, seed) at reset.
- `VisualSearch-v0` (`VisualSearchEnv`): multi-turn, the tool returns an image. The model sees a large board shrunk to
  an overview (a red dot marks one cell; the digit in it is too small to read), calls `<zoom>ROW COL</zoom>` to get that
  cell at full resolution as an image, and answers `<answer>D</answer>`. Reward 1.0 for the digit.
"""

from __future__ import annotations

import random
import re
import zlib
from collections.abc import Mapping
from typing import Any

from slime_env.envs.vision.draw import KINDS, draw, search_scene

from slime_env import Action, Env, Message, Task
from slime_env.errors import InvalidInput

_ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)
_WORD = re.compile(r"[A-Za-z0-9]+")
_ZOOM = re.compile(r"<zoom>\s*(\d+)\s*[, ]\s*(\d+)\s*</zoom>")
SYSTEM = "Look at the image and answer the question. Reply with <answer>X</answer>."


def extract_answer(text: str) -> str | None:
    """The content of the first `<answer>...</answer>`, else the text's last word; None when there is none."""
    m = _ANSWER.search(text)
    if m:
        return m.group(1).strip()
    words = _WORD.findall(text)
    return words[-1] if words else None


def visual_tasks(n: int, seed: int = 0, kinds: str | list[str] = "count", split: str | None = None,
                 size: int = 128) -> list[Task]:
    """`n` tasks of the given picture kinds (a list or comma-separated), from `seed`. `split="train"` / `"test"` keeps
    one side of a fixed partition of (kind, picture seed) (one in five is a test picture): held-out tasks never share a
    picture with training ones."""
    kinds = [k.strip() for k in kinds.split(",")] if isinstance(kinds, str) else list(kinds)
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise InvalidInput(f"visual_tasks: kinds {bad} are not among {KINDS}")
    if split not in (None, "train", "test"):
        raise InvalidInput(f"visual_tasks: split must be 'train', 'test' or None, got {split!r}")
    rng = random.Random(seed)
    out: list[Task] = []
    while len(out) < n:
        kind, pic = rng.choice(kinds), rng.randrange(10**9)
        if split is not None and (zlib.crc32(f"{kind}:{pic}".encode()) % 5 == 0) != (split == "test"):
            continue
        _, question, answer = draw(kind, pic, size)
        out.append(Task(prompt=question, label=answer, metadata={"kind": kind, "seed": pic, "size": size},
                        id=f"{kind}-{pic}"))
    return out


class VisualReasoningEnv(Env):
    """One picture, one question, one answer (see the module docstring). `system_prompt=None` sends none."""

    def __init__(self, *, system_prompt: str | None = SYSTEM, image_size: int = 128):
        self.system_prompt = system_prompt
        self.image_size = image_size
        self.task: Task | None = None

    def sample_task(self, rng: random.Random) -> Task:
        return visual_tasks(1, rng.randrange(10**9), list(KINDS), size=self.image_size)[0]

    async def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None):
        self.task = task = self.task_from(options, seed)
        md = task.metadata
        if md.get("kind") not in KINDS or not isinstance(md.get("seed"), int):
            raise InvalidInput(f"VisualReasoning-v0 task needs metadata kind (one of {KINDS}) and an int seed, got "
                               f"{dict(md)!r}")
        image, question, answer = draw(md["kind"], md["seed"], int(md.get("size", self.image_size)))
        if task.label is not None and str(task.label) != answer:
            raise InvalidInput(f"VisualReasoning-v0 task label {task.label!r} is not the drawn answer {answer!r}")
        prompt = task.prompt if isinstance(task.prompt, str) else question
        messages = [Message("user", [image, prompt])]
        if self.system_prompt:
            messages.insert(0, Message("system", self.system_prompt))
        return messages, {"label": answer}

    async def step(self, action: Action):
        got = extract_answer(action.text)
        want = str(self.task.label if self.task.label is not None else "")
        correct = got is not None and got.lower() == want.lower()
        return [], 1.0 if correct else 0.0, True, False, {"answer": got, "correct": correct}


SEARCH_SYSTEM = ("A digit is written in one cell of a {g}x{g} grid; a red dot marks that cell, but the overview is too "
                 "small to read it. To see a cell at full size, reply <zoom>ROW COL</zoom> (1-{g}). When you can read "
                 "the digit, reply <answer>D</answer>.")


class VisualSearchEnv(Env):
    """Find a small detail in a large image by zooming (see the module docstring): the zoom tool's result is an
    image. `max_zooms` bounds the tool calls (then truncated). Tasks: `{"prompt": "...", "label": digit,
    "metadata": {"seed": 3}}`, or none (drawn from the reset seed)."""

    stop = ("</zoom>", "</answer>")

    def __init__(self, *, size: int = 512, grid: int = 4, overview: int = 128, max_zooms: int = 3):
        self.size, self.grid, self.overview, self.max_zooms = size, grid, overview, max_zooms
        self.zooms = 0

    def sample_task(self, rng: random.Random) -> Task:
        seed = rng.randrange(10**9)
        return Task(prompt="Which digit is in the marked cell?", label=search_scene(seed, self.size, self.grid)[3],
                    metadata={"seed": seed}, id=f"search-{seed}")

    async def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None):
        self.task = task = self.task_from(options, seed)
        if not isinstance(task.metadata.get("seed"), int):
            raise InvalidInput(f"VisualSearch-v0 task needs an int metadata seed, got {dict(task.metadata)!r}")
        self.image, self.row, self.col, self.digit = search_scene(task.metadata["seed"], self.size, self.grid)
        self.zooms = 0
        small = self.image.resize((self.overview, self.overview))
        question = task.prompt if isinstance(task.prompt, str) else "Which digit is in the marked cell?"
        return [Message("system", SEARCH_SYSTEM.format(g=self.grid)), Message("user", [small, question])], \
            {"label": self.digit, "cell": [self.row, self.col]}

    async def step(self, action: Action):
        zoom = _ZOOM.search(action.text)
        if zoom and not _ANSWER.search(action.text):
            self.zooms += 1
            r, c = int(zoom.group(1)), int(zoom.group(2))
            if not (1 <= r <= self.grid and 1 <= c <= self.grid):
                obs = [Message("user", f"No cell {r} {c}: rows and columns are 1-{self.grid}.")]
            else:
                cell = self.size // self.grid
                crop = self.image.crop(((c - 1) * cell, (r - 1) * cell, c * cell, r * cell))
                obs = [Message("user", [f"Cell {r} {c}:", crop])]
            truncated = self.zooms >= self.max_zooms
            return ([] if truncated else obs), 0.0, False, truncated, {"zooms": self.zooms, "cell": [r, c]}
        got = extract_answer(action.text)
        correct = got == self.digit
        return [], 1.0 if correct else 0.0, True, False, {"answer": got, "correct": correct, "zooms": self.zooms}
