"""`GroupStream`: groups generated continuously, across batch boundaries — the rollout side of fully asynchronous
training (AReaL's rollout controller, slime's `examples/fully_async`).

A new group starts whenever a running one finishes, as long as (a) at most `in_flight` episodes run and (b) the
staleness bound can still be met: a group started under weight version v will be trained on at the earliest by
the step after `taken + outstanding` groups, so it is admitted only while `taken + outstanding < (v +
max_staleness + 1) * per_step` (AReaL's capacity rule). Finished groups wait, in completion order, until `take`;
a group whose oldest tokens are more than `max_staleness` versions older than the trainer is dropped there (counted,
returned in `Batch.dropped`, its task run again) — never handed to a trainer.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

from slime_env.errors import InvalidInput
from slime_env.rollout.groups import Batch, Group, RunningGroup
from slime_env.rollout.metrics import batch_metrics

SUSPENDED_FOR_UPDATE = "suspended for a weight update"
CLOSED = "aborted: the run ended"


def group_weight_version(group: Group, default: int | None = None) -> int | None:
    """The oldest weight version any token of the group was generated with (`metadata["weight_versions"]`, per
    generate call), or `default` when no version is an integer (an engine that reports none)."""
    versions = []
    for t in group.trajectories:
        for v in t.metadata.get("weight_versions", ()):
            try:
                versions.append(int(v))
            except (TypeError, ValueError):
                continue
    return min(versions) if versions else default


class GroupStream:
    """Keeps the manager's groups running (see the module docstring); made by `RolloutManager.stream`.

    `set_version(v)` tells it the engines' weight version (call it after each update; it starts admissible groups).
    `take(k, trainer_version)` returns a `Batch` of k accepted groups (fewer only when the tasks ran out).
    `pause(interrupt)` starts no group until `resume()`: "finish" lets running episodes go on (an engine's update
    waits for its running requests), "resume" aborts them — finished turns and the partial turn are kept, and
    `resume()` continues them under the new weights (the manager needs `partial_rollout=True`). `close()` aborts
    and closes everything still running. An exception escaping a group ends the stream: `take` raises it.
    """

    def __init__(self, manager: Any, *, in_flight: int, per_step: int, max_staleness: int | None = None,
                 version: int = 0):
        if in_flight < manager.n:
            raise InvalidInput(f"in_flight={in_flight} cannot hold one group of {manager.n} episodes")
        self.manager, self.runner = manager, manager.runner
        self.max_groups = in_flight // manager.n
        self.per_step, self.max_staleness, self.version = per_step, max_staleness, version
        self.running: dict[asyncio.Future, RunningGroup] = {}
        self.suspended: deque[RunningGroup] = deque()
        self.ready: deque[Group] = deque()
        self.filtered: list[Group] = []
        self.started_at: dict[int, int] = {}
        # Groups trained on so far, as the admission rule counts them: a stream that starts at version v (a resumed
        # run) comes after v steps' worth.
        self.taken = version * per_step
        self.paused = self.closed = False
        self.error: BaseException | None = None
        self._wake = asyncio.Event()
        self._t_last = time.perf_counter()

    # --- control ---------------------------------------------------------------------------------------------
    def set_version(self, version: int) -> None:
        self.version = version
        self._refill()

    async def pause(self, interrupt: str = "finish") -> None:
        self.paused = True
        if interrupt == "finish":
            return
        if interrupt != "resume":
            raise InvalidInput(f"interrupt {interrupt!r}: 'finish' or 'resume'")
        if not self.runner.partial_rollout:
            raise InvalidInput("interrupt 'resume' needs a manager made with partial_rollout=True")
        episodes = [ep for rg in list(self.running.values()) for ep in rg.episodes]
        await asyncio.gather(*(ep.abort(SUSPENDED_FOR_UPDATE) for ep in episodes))
        # An aborted episode generates nothing more until it is resumed: the update waits only for generations in
        # flight to return their partial tokens, not for episodes inside a (maybe slow) env step — those suspend
        # when their step returns, and a group that suspends after the update is resumed at once (`_done`).
        while any(ep.generating for ep in episodes):
            await asyncio.sleep(0.005)

    def resume(self) -> None:
        self.paused = False
        while self.suspended and not self.closed:
            self._start(self.suspended.popleft())
        self._refill()

    async def take(self, k: int, trainer_version: int) -> Any:
        """k accepted groups no staler than the bound, in completion order, as a `Batch`."""
        accepted: list[Group] = []
        stale: list[Group] = []
        while len(accepted) < k:
            while self.ready and len(accepted) < k:
                group = self.ready.popleft()
                v = group_weight_version(group, self.started_at.get(group.group_index))
                if self.max_staleness is not None and v is not None and trainer_version - v > self.max_staleness:
                    group.accepted = False
                    group.filter_reason = (f"stale: generated with weights {v}, the trainer is at {trainer_version} "
                                           f"(max_staleness {self.max_staleness}); its task runs again")
                    stale.append(group)
                    self.manager.requeue(group.group_index)
                    continue
                accepted.append(group)
                self.taken += 1  # counted at once: the admission rule below must see it
            if len(accepted) >= k:
                break
            if self.error is not None:
                raise self.error
            self._refill()
            if not (self.running or self.suspended or self.ready):
                break  # the tasks ran out
            self._wake.clear()
            await self._wake.wait()
        dropped, self.filtered = [*self.filtered, *stale], []
        now = time.perf_counter()
        metrics = batch_metrics(accepted, dropped, now - self._t_last, carried=len(self.suspended),
                                queued=self.manager.queued())
        self._t_last = now
        metrics["rollout/groups_stale"] = float(len(stale))
        return Batch(groups=accepted, dropped=dropped, metrics=metrics)

    async def close(self) -> None:
        """Abort what runs, close every env; groups not taken are not trained (their tasks rerun on a resume).
        Waits for generations in flight to return, not for env steps: those are cancelled."""
        self.closed = self.paused = True
        running = list(self.running.items())
        episodes = [ep for _, rg in running for ep in rg.episodes]
        await asyncio.gather(*(ep.abort(CLOSED) for ep in episodes), return_exceptions=True)
        while any(ep.generating for ep in episodes):
            await asyncio.sleep(0.005)
        for fut, _ in running:
            fut.cancel()
        await asyncio.gather(*(fut for fut, _ in running), return_exceptions=True)
        for rg in [*(rg for _, rg in running), *self.suspended]:
            await self.runner.close_envs(rg)
        self.suspended.clear()

    # --- internals --------------------------------------------------------------------------------------------
    def outstanding(self) -> int:
        return len(self.running) + len(self.suspended) + len(self.ready)

    def _admissible(self) -> bool:
        if len(self.running) >= self.max_groups:
            return False
        if self.max_staleness is None:
            return True
        return self.taken + self.outstanding() < (self.version + self.max_staleness + 1) * self.per_step

    def _refill(self) -> None:
        while not (self.paused or self.closed) and self.error is None and self._admissible():
            index = self.manager.next_index()
            if index is None:
                return
            rg = self.runner.new(index)
            self.started_at[index] = self.version
            self._start(rg)

    def _start(self, rg: RunningGroup) -> None:
        fut = asyncio.ensure_future(self.runner.run(rg))
        rg.future = fut
        self.running[fut] = rg
        fut.add_done_callback(self._done)

    def _done(self, fut: asyncio.Future) -> None:
        rg = self.running.pop(fut)
        self._wake.set()
        if self.closed:
            return
        if fut.cancelled():
            self.error = self.error or RuntimeError(f"group {rg.group_index} was cancelled")
            return
        if fut.exception() is not None:
            self.error = self.error or fut.exception()
            return
        group = fut.result()
        if group is None:  # suspended by an abort: resumed after the update (at once if that is over)
            if self.paused:
                self.suspended.append(rg)
            else:
                self._start(rg)
            return
        self.manager.judge(group)
        (self.ready if group.accepted else self.filtered).append(group)
        self._refill()
