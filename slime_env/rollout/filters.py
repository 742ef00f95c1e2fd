"""Dynamic-sampling filters: `fn(group) -> bool` keeps or drops a finished group (DAPO-style)."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from slime_env.errors import InvalidInput
from slime_env.loading import load_object
from slime_env.trajectory import EXCLUDED_STATUSES


def nonzero_std(group: Any) -> bool:
    """Keep a group whose rewards are not all equal: all-correct or all-wrong groups carry no GRPO signal."""
    rewards = [t.reward for t in group.trajectories if t.status not in EXCLUDED_STATUSES]
    return len(rewards) >= 2 and statistics.pstdev(rewards) > 0


FILTERS: dict[str, Callable[[Any], bool]] = {"nonzero_std": nonzero_std}


def get_filter(spec: str | Callable[[Any], bool] | None) -> Callable[[Any], bool] | None:
    """None, a built-in name ("nonzero_std"), an import path, or a callable."""
    if spec is None or callable(spec):
        return spec
    if spec in FILTERS:
        return FILTERS[spec]
    if "." in spec or ":" in spec:
        return load_object(spec)
    raise InvalidInput(f"unknown dynamic filter {spec!r}; built-in: {sorted(FILTERS)}")
