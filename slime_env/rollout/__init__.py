"""Rollouts at scale: `RolloutManager` (groups, over-sampling, dynamic filters, partial rollouts,
persistence and resume), dataset loading, env servers and the Ray backend (`[ray]` extra)."""

from slime_env.rollout.dataset import load_tasks
from slime_env.rollout.filters import get_filter, nonzero_std
from slime_env.rollout.manager import Batch, Group, RolloutManager
from slime_env.rollout.store import read_groups

__all__ = ["Batch", "Group", "RolloutManager", "get_filter", "load_tasks", "nonzero_std", "read_groups"]
