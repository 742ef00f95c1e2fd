"""Asynchronous training for `slime-env train`: where each step's batch comes from, and what it cost.

`async: {mode: off}` (the default) generates a batch, trains on it, syncs, repeats — unchanged. `overlap` (slime's
`train_async.py`): batch k + 1 is generated while step k trains, then the weights sync, so every batch is one
version old. `full` (AReaL, slime's `examples/fully_async`): a `GroupStream` keeps `in_flight` episodes running at
all times, across steps and weight updates; a step takes the first `prompts_per_step` groups to finish, none more
than `max_staleness` versions behind the trainer (older ones are dropped, counted and rerun). A weight update
either lets in-flight requests finish (`interrupt: finish`) or aborts and resumes them under the new weights
(`resume`: an episode then holds turns of two versions, `metadata["weight_versions"]` per generate call).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from slime_env.trainers.sections import parse_section

from slime_env.errors import InvalidInput
from slime_env.rollout.heap import quiet_gc
from slime_env.rollout.stream import group_weight_version

MODES = ("off", "overlap", "full")


@dataclass
class AsyncConfig:
    """The run config's `async:` section (see docs/async.md)."""

    mode: str = "off"
    max_staleness: int = 1
    in_flight: int = 256
    interrupt: str = "finish"

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None, where: str = "async") -> AsyncConfig:
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


class BusyMeter:
    """How long the engines had at least one generation in flight, and how many tokens came back (the policy
    wrapped by `wrap`); `hold()` … `release()` brackets a weight update, whose waiting requests are not work."""

    def __init__(self) -> None:
        self.busy_s = 0.0
        self.tokens = 0
        self._live = 0
        self._since = 0.0
        self._held = False

    def wrap(self, policy: Any) -> Any:
        return _Metered(policy, self)

    def enter(self) -> None:
        if self._live == 0 and not self._held:
            self._since = time.perf_counter()
        self._live += 1

    def exit(self, tokens: int) -> None:
        self._live -= 1
        self.tokens += tokens
        if self._live == 0 and not self._held:
            self.busy_s += time.perf_counter() - self._since

    def hold(self) -> None:
        if self._live and not self._held:
            self.busy_s += time.perf_counter() - self._since
        self._held = True

    def release(self) -> None:
        self._held = False
        if self._live:
            self._since = time.perf_counter()

    def busy(self) -> float:
        """Busy seconds so far, the running interval included."""
        live = time.perf_counter() - self._since if self._live and not self._held else 0.0
        return self.busy_s + live


class _Metered:
    """A policy (or an episode's view of it) whose generate calls the meter times; everything else passes through."""

    def __init__(self, inner: Any, meter: BusyMeter):
        self._inner, self._meter = inner, meter

    async def generate(self, input_ids: Any, sampling_params: Any, **kwargs: Any) -> Any:
        self._meter.enter()
        tokens = 0
        try:
            gen = await self._inner.generate(input_ids, sampling_params, **kwargs)
            tokens = len(getattr(gen, "token_ids", ()))
            return gen
        finally:
            self._meter.exit(tokens)

    def for_episode(self, session_id: str) -> Any:
        view = getattr(self._inner, "for_episode", None)
        return _Metered(view(session_id), self._meter) if callable(view) else self

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def staleness_metrics(groups: list[Any], trainer_version: int) -> dict[str, Any]:
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
    """`mode: off`: each step generates its batch with the current weights (today's loop)."""

    def __init__(self, manager: Any, per_step: int):
        self.manager, self.per_step = manager, per_step

    async def next(self, step: int, last: bool) -> Any:
        return await self.manager.generate_batch(self.per_step)

    async def before_sync(self) -> None:
        return None

    def after_sync(self, version: int) -> None:
        return None

    async def close(self) -> None:
        return None


class OverlapSource(BatchSource):
    """`mode: overlap`: batch k + 1 is generated while step k trains; the weights sync once both are done."""

    def __init__(self, manager: Any, per_step: int):
        super().__init__(manager, per_step)
        self.pending: asyncio.Task | None = None

    async def next(self, step: int, last: bool) -> Any:
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

    async def close(self) -> None:
        if self.pending is not None and not self.pending.done():
            self.pending.cancel()  # generate_batch aborts its episodes (their tasks go back to the queue)
            await asyncio.gather(self.pending, return_exceptions=True)
        self.pending = None


class StreamSource(BatchSource):
    """`mode: full`: batches come from a `GroupStream` that never stops generating but for the weight update."""

    def __init__(self, manager: Any, per_step: int, config: AsyncConfig, version: int):
        super().__init__(manager, per_step)
        self.interrupt = config.interrupt
        self.stream = manager.stream(in_flight=config.in_flight, per_step=per_step,
                                     max_staleness=config.max_staleness, version=version)
        # The stream runs outside `generate_batch`, which quiets the collector for a batch: quiet it for the run.
        self._quiet = quiet_gc(manager.quiet_gc)
        self._quiet.__enter__()

    async def next(self, step: int, last: bool) -> Any:
        return await self.stream.take(self.per_step, trainer_version=step - 1)  # take() starts what it needs

    async def before_sync(self) -> None:
        await self.stream.pause(self.interrupt)

    def after_sync(self, version: int) -> None:
        self.stream.version = version
        self.stream.resume()

    async def close(self) -> None:
        await self.stream.close()
        if self._quiet is not None:
            self._quiet.__exit__(None, None, None)
            self._quiet = None


def make_source(config: AsyncConfig, manager: Any, per_step: int, version: int) -> BatchSource:
    if config.mode == "overlap":
        return OverlapSource(manager, per_step)
    if config.mode == "full":
        return StreamSource(manager, per_step, config, version)
    return BatchSource(manager, per_step)
