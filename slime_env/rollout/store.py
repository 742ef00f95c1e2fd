"""Append-only trajectory store with a manifest, safe to resume after a crash or `kill -9`.

`groups.jsonl` gets one line per finished group (all its trajectories), written with one `write`
and flushed to the OS as soon as the group finishes; a half-written last line (the process died
mid-write) is cut off on resume. A group is persisted whole or not at all, so resuming re-runs
exactly the groups that were not written: no episode lost, none duplicated. `manifest.json` holds
the run's configuration; resuming with a different one is refused, naming the field.
With `parquet=True`, each batch is also written as `batch-NNNNN.parquet`, one row per trajectory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from slime_env.errors import InvalidInput

GROUPS = "groups.jsonl"
MANIFEST = "manifest.json"


class RolloutStore:
    def __init__(self, out_dir: str | Path, config: dict[str, Any], *, resume: bool = False, parquet: bool = False):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.parquet = parquet
        self.path = self.dir / GROUPS
        manifest = self.dir / MANIFEST
        self.done: dict[int, dict[str, Any]] = {}
        if manifest.exists() or self.path.exists():
            if not resume:
                raise InvalidInput(f"{self.dir} already holds a rollout; pass resume=True (--resume) to continue it "
                                   "or choose a new output directory")
            old = json.loads(manifest.read_text()) if manifest.exists() else {}
            for key, value in config.items():
                if key in old.get("config", {}) and old["config"][key] != value:
                    raise InvalidInput(f"cannot resume {self.dir}: {key} was {old['config'][key]!r}, now {value!r}")
            self.done = self._recover()
        tmp = manifest.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": 1, "config": config}, indent=1))
        os.replace(tmp, manifest)
        self._file = self.path.open("a", encoding="utf-8")
        self.batches = len(list(self.dir.glob("batch-*.parquet")))

    def _recover(self) -> dict[int, dict[str, Any]]:
        """Groups already written (by group_index), cutting a partial trailing line."""
        if not self.path.exists():
            return {}
        done: dict[int, dict[str, Any]] = {}
        good = 0
        with self.path.open("rb") as f:
            for line in f:
                if not line.endswith(b"\n"):
                    break  # the process died while writing this line
                try:
                    record = json.loads(line)
                except ValueError:
                    break
                done[int(record["group_index"])] = {k: record[k] for k in ("accepted", "task_id")}
                good += len(line)
        with self.path.open("r+b") as f:
            f.truncate(good)
        return done

    def append(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._file.flush()  # in the kernel now: survives kill -9 of this process
        self.done[int(record["group_index"])] = {"accepted": record["accepted"], "task_id": record["task_id"]}

    def write_parquet(self, rows: list[dict[str, Any]]) -> Path | None:
        if not self.parquet or not rows:
            return None
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = self.dir / f"batch-{self.batches:05d}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        self.batches += 1
        return path

    def close(self) -> None:
        self._file.close()


def read_groups(out_dir: str | Path) -> list[dict[str, Any]]:
    """Every complete group record of a rollout directory, in the order written."""
    records = []
    with (Path(out_dir) / GROUPS).open(encoding="utf-8") as f:
        for line in f:
            if line.endswith("\n"):
                records.append(json.loads(line))
    return records
