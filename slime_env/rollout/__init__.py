"""Rollouts at scale: `RolloutManager` (groups, over-sampling, dynamic filters, partial rollouts,
persistence and resume; its options in four groups: `EpisodeOptions`, `GroupOptions`, `StoreOptions`,
`ExecutionOptions`), `GroupStream` (groups generated continuously under a staleness bound: asynchronous training),
`load_tasks` (from `slime_env.task_files`), env servers and the Ray backend (`[ray]` extra), and the driver process's
settings (`run_loop`: uvloop; `quiet_gc`: the garbage collector while a batch runs)."""

from slime_env.rollout.filters import get_filter, nonzero_std
from slime_env.rollout.heap import quiet_gc
from slime_env.rollout.loop import loop_name, run_loop
from slime_env.rollout.manager import Batch, Group, RolloutManager
from slime_env.rollout.options import EpisodeOptions, ExecutionOptions, GroupOptions, StoreOptions
from slime_env.rollout.store import read_groups
from slime_env.rollout.stream import GroupStream, group_weight_version
from slime_env.task_files import load_tasks

__all__ = ["Batch", "EpisodeOptions", "ExecutionOptions", "Group", "GroupOptions", "GroupStream", "RolloutManager",
           "StoreOptions", "get_filter", "group_weight_version", "load_tasks", "loop_name", "nonzero_std", "quiet_gc",
           "read_groups", "run_loop"]
