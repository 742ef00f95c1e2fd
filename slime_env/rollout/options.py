"""`RolloutManager`'s options, in four groups: each episode, the groups, the store, where the work runs.

`RolloutManager(tasks, policy=..., renderer=..., episode=EpisodeOptions(max_turns=4), groups=GroupOptions(
n_samples_per_prompt=8))`. The options are also taken one by one as keywords (`max_turns=4`), the spelling of earlier
versions, which `fold_options` puts into their group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any


@dataclass(frozen=True)
class EpisodeOptions:
    """The limits of each episode (`run_episode`'s): turns, tokens per generation, context, a wall-clock deadline,
    strict observation checks (None: the renderer's default)."""

    max_turns: int = 8
    max_new_tokens: int = 1024
    max_context_tokens: int | None = None
    deadline_s: float | None = None
    strict: bool | None = None


@dataclass(frozen=True)
class GroupOptions:
    """How groups are sampled and accepted: `n_samples_per_prompt` episodes per task, at most `max_concurrency`
    episodes in flight, `over_sampling` groups started per wanted one, `dynamic_filter` (a callable
    `fn(group) -> bool`, "nonzero_std", or an import path), `partial_rollout` (groups cut by a full batch are suspended
    and resumed; `mask_offpolicy` masks what older weights generated), `skip`: group indices never to run."""

    n_samples_per_prompt: int = 8
    max_concurrency: int = 256
    over_sampling: float = 1.0
    dynamic_filter: Any = None
    partial_rollout: bool = False
    mask_offpolicy: bool = False
    skip: Sequence[int] = ()


@dataclass(frozen=True)
class StoreOptions:
    """Delivered groups appended to `out_dir/groups.jsonl` (and Parquet rows with `parquet`); `resume` skips the
    groups already written."""

    out_dir: str | None = None
    resume: bool = False
    parquet: bool = False


@dataclass(frozen=True)
class ExecutionOptions:
    """Where the work runs: envs in this process or in `ray_actors` Ray actors per env id (`backend="ray"`), groups in
    `workers` driver processes, the garbage collector quieted while a batch runs (`quiet_gc`), a progress bar."""

    backend: str = "local"
    ray_actors: int = 2
    ray_actor_options: Mapping[str, Any] | None = None
    workers: int = 0
    quiet_gc: bool = True
    progress: bool = False


GROUPS = {"episode": EpisodeOptions, "groups": GroupOptions, "store": StoreOptions, "execution": ExecutionOptions}


def fold_options(given: Mapping[str, Any], flat: Mapping[str, Any]) -> dict[str, Any]:
    """The four option groups from `given` (group name -> options or None) and `flat` keywords (one option each,
    put into its group). TypeError for a keyword no group has, or an option set both ways."""
    owner = {f.name: group for group, cls in GROUPS.items() for f in fields(cls)}
    unknown = sorted(set(flat) - set(owner))
    if unknown:
        raise TypeError(f"RolloutManager() got unexpected keyword argument(s) {unknown}")
    out = {}
    for group, cls in GROUPS.items():
        mine = {k: v for k, v in flat.items() if owner[k] == group}
        base = given.get(group)
        if base is not None and mine:
            raise TypeError(f"RolloutManager(): {sorted(mine)} given both as keywords and in {group}=")
        out[group] = replace(base or cls(), **mine)
    return out
