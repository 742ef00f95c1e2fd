"""Search task files users already have: Search-R1's training parquet and plain `{question, answers}` JSONL."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slime_env import Task
from slime_env.errors import InvalidInput
from slime_env.task_files import read_rows


def search_row_to_task(row: Any, where: str, n: int) -> Task:
    """Search-R1 parquet (`prompt` chat messages, `reward_model.ground_truth.target`) or JSONL
    `{"question", "answers" | "golden_answers" | "answer"}` as a Search-v0 task."""
    if not isinstance(row, Mapping):
        raise InvalidInput(f"{where}: expected an object, got {type(row).__name__}")
    if "reward_model" in row:
        try:
            golds = row["reward_model"]["ground_truth"]["target"]
        except (KeyError, TypeError):
            raise InvalidInput(f"{where}: reward_model.ground_truth.target is missing") from None
        prompt = row.get("prompt")
        if prompt is None:
            raise InvalidInput(f"{where}: no 'prompt'")
        if not isinstance(prompt, str):
            prompt = [dict(m) for m in prompt]
        metadata = {"data_source": row.get("data_source"), **dict(row.get("extra_info") or {})}
    else:
        if "question" not in row:
            raise InvalidInput(f"{where}: no 'question' (or Search-R1's 'reward_model'); fields: {sorted(row)}")
        golds = row.get("answers", row.get("golden_answers", row.get("answer")))
        prompt = str(row["question"])
        metadata = {k: v for k, v in row.items() if k not in ("question", "answers", "golden_answers", "answer")}
    if golds is None:
        raise InvalidInput(f"{where}: no gold answers")
    golds = [golds] if isinstance(golds, str) else [str(g) for g in list(golds)]
    task_id = row.get("id", (row.get("extra_info") or {}).get("index") if isinstance(row.get("extra_info"), Mapping)
                      else None)
    return Task.coerce({"prompt": prompt, "label": golds, "metadata": metadata,
                        "id": n if task_id is None else task_id}, where)


def load_search_tasks(path: str | Path) -> list[Task]:
    """Every row of a Search-R1 parquet or a question/answers JSONL file as a task; errors name the row."""
    return [search_row_to_task(row, where, n) for where, n, row in read_rows(path)]


def search_tasks(n: int | None = None, seed: int = 0, split: str | None = None) -> list[Task]:
    """The demo corpus's questions (`demo_questions`) as Search-v0 tasks, shuffled by `seed`, at most `n` (a
    `train_data: {generator: slime_env.envs.search:search_tasks}` split). `split="train"` / `"test"` keeps one side of a
    fixed partition by *topic* (a hash of the reference topic: about one in five is a test topic), so a held-out
    question's answer never appears as the answer of a training question or of SFT data: solving it needs the search."""
    import random
    import zlib

    from slime_env.envs.search.corpus import demo_questions

    if split not in (None, "train", "test"):
        raise InvalidInput(f"split must be 'train', 'test' or None, got {split!r}")
    rows = demo_questions(n=10**9)
    tasks = []
    for i, row in enumerate(rows):
        topic = row["passage_id"].rsplit("-", 1)[0]
        if split is None or (zlib.crc32(topic.encode()) % 5 == 0) == (split == "test"):
            tasks.append(Task(prompt=row["question"], label=row["answers"], id=f"demo-{i}",
                              metadata={"topic": topic, "passage_id": row["passage_id"]}))
    random.Random(seed).shuffle(tasks)
    if n is not None and n > len(tasks):
        raise InvalidInput(f"search_tasks: n={n} but the demo corpus has {len(tasks)} questions"
                           + (f" on the {split} side" if split else ""))
    return tasks if n is None else tasks[:n]
