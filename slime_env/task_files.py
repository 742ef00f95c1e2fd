"""Load tasks from JSONL or Parquet files with configurable keys (as slime's `--input-key` & co)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from slime_env.errors import InvalidInput
from slime_env.types import Task


def coerce_tasks(spec: str | Path | Sequence[Any], where: str = "tasks") -> list[Task]:
    """A task list from a `.jsonl` / `.parquet` path (`load_tasks`) or a sequence of tasks, prompts or dicts;
    an empty one, or a bad item, is an `InvalidInput` naming `where` (and the item's index)."""
    if isinstance(spec, (str, Path)):
        tasks = load_tasks(spec)
    elif isinstance(spec, Sequence):
        tasks = [Task.coerce(t, f"{where}[{i}]") for i, t in enumerate(spec)]
    else:
        raise InvalidInput(f"{where}: a path or a list of tasks, got {type(spec).__name__}")
    if not tasks:
        raise InvalidInput(f"{where}: no tasks")
    return tasks


def load_tasks(path: str | Path, *, input_key: str = "prompt", label_key: str | None = "label",
               metadata_key: str | None = "metadata", id_key: str | None = "id") -> list[Task]:
    """Every row of a `.jsonl` / `.json` (one object per line) or `.parquet` file as a `Task`.

    `input_key` holds the prompt (text or chat messages), `label_key` the label, `metadata_key` a dict
    of metadata (`metadata["env_id"]` picks a per-task env). Rows without an id get their row number,
    so resuming over the same file recognises them. A bad row raises `InvalidInput` naming the file
    and line (Parquet: row).
    """
    return [_task(row, where, n, input_key, label_key, metadata_key, id_key) for where, n, row in read_rows(path)]


def read_rows(path: str | Path) -> Iterator[tuple[str, int, Any]]:
    """`(where, n, row)` for every row of a `.jsonl`/`.json` or `.parquet` file; `where` is "file:line"
    (Parquet: "file: row n") for error messages. InvalidInput if the file is missing or a line is not JSON."""
    path = Path(path)
    if not path.is_file():
        raise InvalidInput(f"dataset file {path} does not exist")
    return _parquet_rows(path) if path.suffix == ".parquet" else _jsonl_rows(path)


def _jsonl_rows(path: Path) -> Iterator[tuple[str, int, Any]]:
    with path.open(encoding="utf-8") as f:
        n = 0
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise InvalidInput(f"{path}:{lineno}: not valid JSON: {e}") from None
            yield f"{path}:{lineno}", n, row
            n += 1


def _parquet_rows(path: Path) -> Iterator[tuple[str, int, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise InvalidInput(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    for n, row in enumerate(pq.read_table(path).to_pylist()):
        yield f"{path}: row {n}", n, row


def _task(row: Any, where: str, n: int, input_key: str, label_key: str | None, metadata_key: str | None,
          id_key: str | None) -> Task:
    if not isinstance(row, Mapping):
        raise InvalidInput(f"{where}: expected a JSON object, got {type(row).__name__}")
    if input_key not in row:
        raise InvalidInput(f"{where}: no {input_key!r} field (fields: {sorted(row)}); set input_key=")
    metadata = row.get(metadata_key) if metadata_key else None
    if metadata is not None and not isinstance(metadata, Mapping):
        raise InvalidInput(f"{where}: {metadata_key!r} must be an object, got {type(metadata).__name__}")
    task_id = row.get(id_key) if id_key else None
    return Task.coerce({"prompt": row[input_key], "label": row.get(label_key) if label_key else None,
                        "metadata": metadata or {}, "id": n if task_id is None else task_id}, where)
