"""The batch source of `slime-env train`: where each step's batch comes from — the async mode lives here only.

`async: {mode: off}` (the default) generates a batch, trains on it, syncs, repeats. `overlap` (slime's
`train_async.py`): batch k + 1 is generated while step k trains, then the weights sync, so every batch is one
version old. `full` (AReaL, slime's `examples/fully_async`): a `GroupStream` keeps `in_flight` episodes running at
all times, across steps and weight updates; a step takes the first `prompts_per_step` groups to finish, none more
than `max_staleness` versions behind the trainer (older ones are dropped, counted and rerun). A weight update
either lets in-flight requests finish (`interrupt: finish`) or aborts and resumes them under the new weights
(`resume`: an episode then holds turns of two versions, `metadata["weight_versions"]` per generate call). vLLM
engines do `resume` without aborting anything: their `/pause?mode=keep` freezes the requests in flight, which go on
under the new weights, one call then spanning two versions (`metadata["weight_version_spans"]`).

Each mode is a class in `SOURCES` keeping the `BatchSource` contract (`slime_env.trainers.run.roles`): which tasks
the rollout manager gets and how it runs them (`tasks`, `manager_options`), the batches (`next`), what a weight
update does to the generation in flight (`before_sync` / `after_sync`), its metrics, and what a checkpoint must keep
(`state` / `restore`: the groups a `full` run trained on, which a resumed run skips).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from slime_env.errors import InvalidInput
from slime_env.rollout.heap import quiet_gc
from slime_env.rollout.stream import group_weight_version
from slime_env.trainers.config_fields import parse_section

if TYPE_CHECKING:
    import contextlib

    from slime_env.rollout import Batch, Group, RolloutManager
    from slime_env.rollout.stream import GroupStream
    from slime_env.types import Task

MODES = ("off", "overlap", "full")


@dataclass(frozen=True)
class AsyncConfig:
    """The run config's `async:` section (see docs/async.md)."""

    mode: str = "off"
    max_staleness: int = 1
    in_flight: int = 256
    interrupt: str = "finish"

    @classmethod
    def from_dict(cls, raw: object, where: str = "async") -> AsyncConfig:
        cfg = parse_section(cls, raw, where)
        if cfg.mode not in MODES:
            raise InvalidInput(f"{where}.mode: {cfg.mode!r} is not one of {MODES}")
        if cfg.interrupt not in ("finish", "resume"):
            raise InvalidInput(f"{where}.interrupt: {cfg.interrupt!r} is not 'finish' or 'resume'")
        if not isinstance(cfg.max_staleness, int) or cfg.max_staleness < 0:
            raise InvalidInput(f"{where}.max_staleness: an integer >= 0, got {cfg.max_staleness!r}")
        if not isinstance(cfg.in_flight, int) or cfg.in_flight < 1:
            raise InvalidInput(f"{where}.in_flight: an integer >= 1, got {cfg.in_flight!r}")
        return cfg

    def check(self, group_size: int, *, offload: bool, where: str) -> None:
        """What the mode needs of the rest of the run: no engine memory released while it generates (`offload`
        of an embedded engine), room in flight for one group of `group_size`."""
        if self.mode != "off" and offload:
            raise InvalidInput(f"{where}: trainer.offload frees the embedded engine's memory while the trainer runs; "
                               f"async mode {self.mode!r} generates meanwhile: use one or the other")
        if self.mode == "full" and self.in_flight < group_size:
            raise InvalidInput(f"{where}: async.in_flight ({self.in_flight}) cannot hold one group of "
                               f"n_samples_per_prompt={group_size}")


def staleness_metrics(groups: list[Group], trainer_version: int) -> dict[str, Any]:
    """Staleness (trainer version − the oldest weight version of a group's tokens) over the groups trained on:
    mean, max, a histogram, and the share of episodes whose turns came from more than one version."""
    values = [trainer_version - v for g in groups if (v := group_weight_version(g)) is not None]
    trajs = [t for g in groups for t in g.trajectories]
    mixed = sum(len({v for v in t.metadata.get("weight_versions", ()) if v is not None}) > 1 for t in trajs)
    out: dict[str, Any] = {"async/mixed_version_episodes": mixed / max(len(trajs), 1)}
    if values:
        out.update({"async/staleness_mean": sum(values) / len(values), "async/staleness_max": float(max(values)),
                    "async/staleness_hist": {str(k): n for k, n in sorted(Counter(values).items())}})
    return out


class BatchSource:
    """`mode: off`: each step generates its batch with the current weights."""

    generates_while_training = False  # whether engines generate while the trainer steps (no memory to release then)

    def __init__(self, config: AsyncConfig, per_step: int):
        self.config, self.per_step = config, per_step
        self.manager: RolloutManager | None = None
        self.engine_resumes = False  # the engines keep requests in flight through a weight update (vLLM pause keep)
        self.done_groups = 0  # the groups of the steps before `start` (a resumed run's): never run again

    def tasks(self, train_tasks: Sequence[Task], steps: int, start: int) -> list[Task]:
        """The rollout manager's tasks: one batch of `per_step` per step, cycling through the split. Indexed from the
        run's first step whatever `start` is: a resumed run skips the groups of the steps before it, so its groups
        and episodes keep the indices (and the env and sampling seeds) the uninterrupted run gives them."""
        n = self.per_step
        self.done_groups = start * n
        return [train_tasks[i % len(train_tasks)] for i in range((steps + 1) * n)]

    def manager_options(self) -> dict[str, Any]:
        """`RolloutManager` keywords the mode decides (after `tasks`)."""
        return {"skip": list(range(self.done_groups))} if self.done_groups else {}

    def attach(self, manager: RolloutManager, version: int) -> None:
        """Generate with `manager`; the engines hold weight version `version`."""
        self.manager = manager

    async def next(self, step: int, last: bool) -> Batch:
        return await self.manager.generate_batch(self.per_step)

    def trained(self, batch: Batch) -> None:
        """`batch` is in the trainer's weights now (synced or not)."""

    async def before_sync(self) -> None:
        return None

    def after_sync(self, version: int) -> None:
        return None

    def metrics(self, batch: Batch, step: int) -> dict[str, Any]:
        return {}

    def state(self) -> dict[str, Any] | None:
        """What a checkpoint keeps for a resumed run (None: nothing)."""
        return None

    def restore(self, state: Mapping[str, Any]) -> None:
        """A resumed run's `state()` of its checkpoint (before `tasks`)."""

    async def close(self) -> None:
        return None


class OverlapSource(BatchSource):
    """`mode: overlap`: batch k + 1 is generated while step k trains; the weights sync once both are done."""

    generates_while_training = True

    def __init__(self, config: AsyncConfig, per_step: int):
        super().__init__(config, per_step)
        self.pending: asyncio.Task | None = None

    async def next(self, step: int, last: bool) -> Batch:
        if self.pending is None:
            self.pending = asyncio.ensure_future(self.manager.generate_batch(self.per_step))
        task, self.pending = self.pending, None
        batch = await task
        if not last:  # the next batch starts now, under the weights this step starts from
            self.pending = asyncio.ensure_future(self.manager.generate_batch(self.per_step))
        return batch

    async def before_sync(self) -> None:
        if self.pending is not None:  # the engines finish the next batch under the old weights first
            await asyncio.wait([self.pending])

    def metrics(self, batch: Batch, step: int) -> dict[str, Any]:
        return {**staleness_metrics(batch.groups, step - 1),
                "async/groups_stale": batch.metrics.get("rollout/groups_stale", 0.0)}

    async def close(self) -> None:
        if self.pending is not None and not self.pending.done():
            self.pending.cancel()  # generate_batch aborts its episodes (their tasks go back to the queue)
            await asyncio.gather(self.pending, return_exceptions=True)
        self.pending = None


class StreamSource(BatchSource):
    """`mode: full`: batches come from a `GroupStream` that never stops generating but for the weight update."""

    generates_while_training = True

    def __init__(self, config: AsyncConfig, per_step: int):
        super().__init__(config, per_step)
        self.stream: GroupStream | None = None
        self._quiet: contextlib.AbstractContextManager[None] | None = None
        self.trained_groups: list[int] = []  # the group indices trained on so far (a resumed run skips them)

    def tasks(self, train_tasks: Sequence[Task], steps: int, start: int) -> list[Task]:
        # Groups finish out of order: index every group of the run; those trained on are skipped.
        total = (steps + self.config.max_staleness + 2) * self.per_step
        return [train_tasks[i % len(train_tasks)] for i in range(total)]

    def manager_options(self) -> dict[str, Any]:
        return {"skip": list(self.trained_groups), "partial_rollout": self.config.interrupt == "resume"}

    def attach(self, manager: RolloutManager, version: int) -> None:
        super().attach(manager, version)
        c = self.config
        self.stream = manager.stream(in_flight=c.in_flight, per_step=self.per_step, max_staleness=c.max_staleness,
                                     version=version)
        # The stream runs outside `generate_batch`, which quiets the collector for a batch: quiet it for the run.
        self._quiet = quiet_gc(manager.quiet_gc)
        self._quiet.__enter__()

    async def next(self, step: int, last: bool) -> Batch:
        return await self.stream.take(self.per_step, trainer_version=step - 1)  # take() starts what it needs

    def trained(self, batch: Batch) -> None:
        self.trained_groups.extend(g.group_index for g in batch.groups)

    async def before_sync(self) -> None:
        # Engines that keep the requests in flight through the update (vLLM's /pause?mode=keep) resume them under the
        # new weights themselves: no episode is aborted, the stream only stops starting new ones.
        await self.stream.pause("finish" if self.engine_resumes else self.config.interrupt)

    def after_sync(self, version: int) -> None:
        self.stream.version = version
        self.stream.resume()

    def metrics(self, batch: Batch, step: int) -> dict[str, Any]:
        return {**staleness_metrics(batch.groups, step - 1),
                "async/groups_stale": batch.metrics.get("rollout/groups_stale", 0.0),
                "async/groups": [g.group_index for g in batch.groups]}

    def state(self) -> dict[str, Any] | None:
        return {"trained_groups": self.trained_groups}

    def restore(self, state: Mapping[str, Any]) -> None:
        self.trained_groups = list(state.get("trained_groups", []))

    async def close(self) -> None:
        if self.stream is not None:
            await self.stream.close()
        if self._quiet is not None:
            self._quiet.__exit__(None, None, None)
            self._quiet = None


SOURCES: dict[str, type[BatchSource]] = {"off": BatchSource, "overlap": OverlapSource, "full": StreamSource}


def resumes_in_flight(config: AsyncConfig) -> bool:
    """Whether the mode keeps requests in flight through a weight update and resumes them (`full` with
    `interrupt: resume`): engines that can hold them themselves (vLLM's pause keep) are asked to."""
    return config.mode == "full" and config.interrupt == "resume"


def make_source(config: AsyncConfig, per_step: int) -> BatchSource:
    """The batch source of `config.mode`."""
    return SOURCES[config.mode](config, per_step)
