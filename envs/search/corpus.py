"""Passages in Search-R1's corpus format, how they are shown to the model, and the offline demo corpus.

Search-R1's corpus is JSONL with `{"id": "...", "contents": "\\"Title\\"\\ntext"}` (the title is the
first line, quoted). `{"id", "title", "text"}` rows are accepted too. Retrieved passages are shown as
`Doc {i}(Title: {first line}) {rest}` lines, inside `<information>...</information>`.

The demo corpus is **not Wikipedia**: it is the Python language reference's topics that ship with
CPython (`pydoc_data.topics`), split into passages of about 100 words, with questions that ask which
reference topic a quoted sentence comes from.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slime_env.errors import InvalidInput


@dataclass(frozen=True, slots=True)
class Passage:
    """One passage: `contents` is Search-R1's `"Title"\\ntext` form; `title` and `text` split it."""

    id: str
    contents: str

    @property
    def title(self) -> str:
        return self.contents.split("\n", 1)[0]

    @property
    def text(self) -> str:
        parts = self.contents.split("\n", 1)
        return parts[1] if len(parts) > 1 else ""

    def to_document(self) -> dict[str, str]:
        return {"id": self.id, "contents": self.contents}

    @classmethod
    def from_row(cls, row: Any, where: str) -> Passage:
        if not isinstance(row, dict):
            raise InvalidInput(f"{where}: expected a JSON object, got {type(row).__name__}")
        pid = row.get("id", row.get("_id"))
        if "contents" in row:
            contents = str(row["contents"])
        elif "text" in row:
            contents = f"\"{row.get('title', '')}\"\n{row['text']}"
        else:
            raise InvalidInput(f"{where}: a passage needs 'contents' (Search-R1) or 'title' + 'text'")
        if pid is None:
            raise InvalidInput(f"{where}: a passage needs an 'id'")
        return cls(str(pid), contents)


def read_corpus(path: str | Path) -> Iterator[Passage]:
    """Passages of a corpus JSONL file; a bad line raises InvalidInput naming file and line."""
    path = Path(path)
    if not path.is_file():
        raise InvalidInput(f"corpus file {path} does not exist")
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise InvalidInput(f"{path}:{lineno}: not valid JSON: {e}") from None
                yield Passage.from_row(row, f"{path}:{lineno}")


def write_corpus(passages: Sequence[Passage], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for p in passages:
            f.write(json.dumps(p.to_document()) + "\n")
    return path


def format_passages(passages: Sequence[Passage]) -> str:
    """Search-R1's rendering: one `Doc i(Title: ...) text` line per passage."""
    return "".join(f"Doc {i}(Title: {p.title}) {p.text}\n" for i, p in enumerate(passages, 1))


def demo_corpus(words_per_passage: int = 100) -> list[Passage]:
    """The Python reference topics (`pydoc_data.topics`, shipped with CPython) as ~100-word passages."""
    from pydoc_data.topics import topics

    passages = []
    for key in sorted(topics):
        text = topics[key]
        heading = text.strip().splitlines()[0].strip()
        words = text.split()
        for start in range(0, len(words), words_per_passage):
            chunk = " ".join(words[start:start + words_per_passage])
            passages.append(Passage(f"{key}-{start // words_per_passage}", f"\"{heading}\"\n{chunk}"))
    return passages


_SENTENCE = re.compile(r"[A-Z][^.!?*=:]{60,160}[.!?]")


def demo_questions(n: int = 100, seed: int = 0) -> list[dict[str, Any]]:
    """Questions over the demo corpus: which reference topic does this sentence come from?

    Rows `{"question", "answers", "passage_id"}`; the answers are the topic heading (as the passages'
    titles show it) and its short key (`assert`).
    """
    from pydoc_data.topics import topics

    rng = random.Random(seed)
    candidates = []
    for p in demo_corpus():
        key = p.id.rsplit("-", 1)[0]
        for sentence in _SENTENCE.findall(p.text):
            candidates.append((p, key, " ".join(sentence.split())))
    rng.shuffle(candidates)
    rows, seen = [], set()
    for p, key, sentence in candidates:
        if sentence in seen or key not in topics:
            continue
        seen.add(sentence)
        rows.append({"question": f"Which section of the Python language reference says: \"{sentence}\"",
                     "answers": [p.title.strip('"'), key], "passage_id": p.id})
        if len(rows) >= n:
            break
    return rows
