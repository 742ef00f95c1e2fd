"""The run's data: a split spec of the run config (`train_data`, `eval_data`, an eval set's or a warm-up's `data`)
as tasks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from slime_env import Task
from slime_env.errors import InvalidInput


def load_split(spec: Mapping[str, Any], where: str) -> list[Task]:
    """`{"path": file}` (JSONL/Parquet via load_tasks), `{"reasoning_gym": {dataset, size, seed, config}}`, or
    `{"generator": "package.module:function", **kwargs}` (a function returning tasks, e.g.
    `slime_env.envs.math.retry_env:arithmetic_tasks`)."""
    if "generator" in spec:
        from slime_env.loading import load_object

        fn = load_object(spec["generator"])
        return [Task.coerce(t, f"{where}[{i}]") for i, t in
                enumerate(fn(**{k: v for k, v in spec.items() if k != "generator"}))]
    if "path" in spec:
        from slime_env import load_tasks

        return load_tasks(spec["path"], **{k: v for k, v in spec.items() if k != "path"})
    if "reasoning_gym" in spec:
        from slime_env.envs.math.reasoning_gym_env import reasoning_gym_tasks

        rg = dict(spec["reasoning_gym"])
        return reasoning_gym_tasks(rg.pop("dataset"), rg.pop("size", 100), rg.pop("seed", 0), rg.pop("config", {}))
    raise InvalidInput(f"{where}: give 'path', 'reasoning_gym' or 'generator'")
