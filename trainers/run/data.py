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
    if not isinstance(spec, Mapping):
        raise InvalidInput(f"{where}: expected a mapping (path, reasoning_gym or generator), got {spec!r}")
    if "generator" in spec:
        import inspect

        from slime_env.loading import load_object

        try:
            fn = load_object(spec["generator"])
        except InvalidInput as e:
            raise InvalidInput(f"{where}.generator: {e}") from None
        kwargs = {k: v for k, v in spec.items() if k != "generator"}
        try:
            inspect.signature(fn).bind(**kwargs)
        except TypeError as e:
            raise InvalidInput(f"{where}: {spec['generator']} does not take {sorted(kwargs)}: {e}") from None
        except ValueError:  # no signature to check against
            pass
        return [Task.coerce(t, f"{where}[{i}]") for i, t in enumerate(fn(**kwargs))]
    if "path" in spec:
        from slime_env import load_tasks

        return load_tasks(spec["path"], **{k: v for k, v in spec.items() if k != "path"})
    if "reasoning_gym" in spec:
        from slime_env.envs.math.reasoning_gym_env import reasoning_gym_tasks

        rg = spec["reasoning_gym"]
        if not isinstance(rg, Mapping) or "dataset" not in rg:
            raise InvalidInput(f"{where}.reasoning_gym.dataset: missing (a reasoning-gym dataset name, e.g. chain_sum)")
        unknown = sorted(set(rg) - {"dataset", "size", "seed", "config"})
        if unknown:
            raise InvalidInput(f"{where}.reasoning_gym: unknown field(s) {unknown}; known: config, dataset, seed, size")
        return reasoning_gym_tasks(rg["dataset"], rg.get("size", 100), rg.get("seed", 0), rg.get("config", {}))
    raise InvalidInput(f"{where}: give 'path', 'reasoning_gym' or 'generator'")
