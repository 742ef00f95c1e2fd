"""Loading math datasets in the layouts people have: slime's `{"prompt", "label"}`, chat-format prompts,
GSM8K's `{"question", "answer": "... #### 72"}` and MATH's `{"problem", "solution": "... \\boxed{}"}`."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slime_env import Task
from slime_env.errors import InvalidInput
from slime_env.task_files import read_rows
from slime_env.envs.math.extract import extract_answer


def math_row_to_task(row: Any, where: str, n: int) -> Task:
    """One row in any of the module's layouts as a `Task` (label = the gold answer string)."""
    if not isinstance(row, Mapping):
        raise InvalidInput(f"{where}: expected a JSON object, got {type(row).__name__}")
    metadata = dict(row.get("metadata") or {})
    if "prompt" in row:
        label = row.get("label", row.get("answer"))
        prompt = row["prompt"]
    elif "question" in row and "answer" in row:  # GSM8K
        answer = str(row["answer"])
        label = extract_answer(answer, ("hash",)) if "####" in answer else answer.strip()
        metadata.setdefault("solution", answer)
        prompt = row["question"]
    elif "problem" in row and ("answer" in row or "solution" in row):  # MATH / DeepScaleR
        label = row.get("answer")
        if label is None:
            label = extract_answer(str(row["solution"]), ("boxed",))
        prompt = row["problem"]
    else:
        raise InvalidInput(f"{where}: no known math layout (need prompt+label, question+answer or "
                           f"problem+answer/solution); fields: {sorted(row)}")
    if label is None or str(label).strip() == "":
        raise InvalidInput(f"{where}: no gold answer found")
    task_id = row.get("id", row.get("idx", n))
    return Task.coerce({"prompt": prompt, "label": str(label), "metadata": metadata, "id": task_id}, where)


def load_math_tasks(path: str | Path) -> list[Task]:
    """Every row of a JSONL/Parquet file as a math `Task`; errors name the file and line."""
    return [math_row_to_task(row, where, n) for where, n, row in read_rows(path)]
