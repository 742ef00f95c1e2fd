"""`RolloutManager`: many episodes at once, delivered as complete, valid groups of trajectories."""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import asdict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from slime_env.errors import InvalidInput
from slime_env.renderers.template import TemplateRenderer
from slime_env.rollout.filters import get_filter
from slime_env.rollout.groups import Batch, Group, GroupRunner, RunningGroup
from slime_env.rollout.heap import quiet_gc
from slime_env.rollout.metrics import batch_metrics
from slime_env.rollout.options import EpisodeOptions, ExecutionOptions, GroupOptions, StoreOptions, fold_options
from slime_env.rollout.store import RolloutStore
from slime_env.types import Task

ABORTED = "aborted by the rollout manager: the batch was full"


class RolloutManager:
    """Runs `n_samples_per_prompt` episodes per task as a group, at most `max_concurrency` episodes
    in flight, and hands out finished groups.

    Options come in four groups (`slime_env.rollout.options`): `episode=EpisodeOptions(...)` (turns, tokens,
    context, deadline, strict), `groups=GroupOptions(...)` (samples per task, concurrency, over-sampling, filter,
    partial rollouts, skip), `store=StoreOptions(...)` (out_dir, resume, parquet), `execution=ExecutionOptions(...)`
    (backend, Ray actors, workers, quiet_gc, progress); each option is also taken as a keyword of its own.

    `generate_batch(k)` returns exactly `k` accepted groups (fewer only when the tasks run out).
    `over_sampling` > 1 starts up to `ceil(k * over_sampling)` groups at once; `dynamic_filter`
    (a callable `fn(group) -> bool`, "nonzero_std", or an import path) drops groups, and new ones start
    in their place. When `k` are accepted, the groups still running are aborted through the policy:
    with `partial_rollout=True` their finished turns and partial generations are kept and resumed at
    the start of the next call (`mask_offpolicy=True` masks what the older weights generated);
    without it their tasks go back to the queue and rerun from scratch. Every episode ends with a
    status; env and policy errors become `failed` trajectories inside their group.
    With `out_dir`, delivered groups (accepted and dropped) are appended to `groups.jsonl` as they are
    delivered, and `resume=True` skips exactly the groups already written.
    `env_factory(task, env_id) -> Env` (sync or async) replaces `make(env_id, **env_kwargs)`, e.g. for
    `RemoteEnv`; `backend="ray"` runs the envs in `ray_actors` Ray actors per env id
    (`slime_env.rollout.ray_backend`), generation staying in this event loop.
    A `MultiAgentEnv` runs through `run_multi_agent_episode`: `policy` is one policy for every agent or a
    mapping agent id -> policy; `policy_for(episode_index, agent_id) -> Policy | None` overrides it per
    episode (e.g. an opponent drawn from a pool; None keeps `policy`); `train_agents` (default: all)
    says whose trajectories the groups hold.
    Its episodes are not suspended by partial rollouts: a batch that closes waits for them to finish.
    `workers=N` runs the groups in N driver processes (`slime_env.rollout.workers`): the policy, renderer and
    env factory are copied into each (they must pickle: a remote engine, not a local model); queue, filter,
    batches, store and resume stay here, so the output is the same exactly-once stream. Not with
    `partial_rollout` or `backend="ray"`. `quiet_gc` (on by default) has the garbage collector run less often
    while a batch runs (`slime_env.rollout.heap.quiet_gc`: a third of the driver's CPU per turn otherwise).
    `skip`: group indices never to run (e.g. those an asynchronous run already trained on before it resumed).
    `stream(...)` runs groups continuously instead of batch by batch (`slime_env.rollout.stream.GroupStream`).
    """

    def __init__(self, tasks: Sequence[Task | Mapping[str, Any] | str], *, policy: Any,
                 renderer: TemplateRenderer, env_id: str | None = None, env_kwargs: Mapping[str, Any] | None = None,
                 env_factory: Callable[[Task, str], Any] | None = None,
                 sampling_params: Mapping[str, Any] | None = None, seed: int = 0,
                 train_agents: Sequence[str] | None = None, policy_for: Callable[[int, str], Any] | None = None,
                 episode: EpisodeOptions | None = None, groups: GroupOptions | None = None,
                 store: StoreOptions | None = None, execution: ExecutionOptions | None = None, **options: Any):
        self.options = fold_options({"episode": episode, "groups": groups, "store": store, "execution": execution},
                                    options)
        ep, gr, st, ex = (self.options[k] for k in ("episode", "groups", "store", "execution"))
        if gr.n_samples_per_prompt < 1:
            raise InvalidInput(f"n_samples_per_prompt must be >= 1, got {gr.n_samples_per_prompt}")
        if gr.max_concurrency < gr.n_samples_per_prompt:
            raise InvalidInput(f"max_concurrency={gr.max_concurrency} cannot hold one group of "
                               f"{gr.n_samples_per_prompt}")
        if gr.over_sampling < 1.0:
            raise InvalidInput(f"over_sampling must be >= 1.0, got {gr.over_sampling}")
        self.tasks = [Task.coerce(t, f"tasks[{i}]") for i, t in enumerate(tasks)]
        if env_id is None and env_factory is None and any("env_id" not in t.metadata for t in self.tasks):
            raise InvalidInput("give env_id=, env_factory=, or metadata['env_id'] on every task")
        self.policy, self.renderer = policy, renderer
        self.env_id, self.env_kwargs, self.env_factory = env_id, dict(env_kwargs or {}), env_factory
        self.sampling_params = dict(sampling_params or {})
        self.n = gr.n_samples_per_prompt
        self.max_concurrency = gr.max_concurrency
        self.episode_kwargs = asdict(ep)
        if ex.backend not in ("local", "ray"):
            raise InvalidInput(f"backend must be 'local' or 'ray', got {ex.backend!r}")
        self.backend = ex.backend
        self.filter = get_filter(gr.dynamic_filter)
        self.over_sampling = gr.over_sampling
        self.partial_rollout = gr.partial_rollout
        self.progress = ex.progress
        self.seed = seed
        self.runner = GroupRunner(self.tasks, policy=policy, renderer=renderer, env_id=env_id,
                                  env_kwargs=self.env_kwargs,
                                  env_factory=env_factory, sampling_params=self.sampling_params, n=self.n,
                                  episode_kwargs=self.episode_kwargs, seed=seed, train_agents=train_agents,
                                  policy_for=policy_for, partial_rollout=gr.partial_rollout,
                                  mask_offpolicy=gr.mask_offpolicy, backend=ex.backend, ray_actors=ex.ray_actors,
                                  ray_actor_options=ex.ray_actor_options)
        self.store = None
        if st.out_dir is not None:
            config = {"env_id": env_id, "n_samples_per_prompt": self.n, "num_tasks": len(self.tasks),
                      "task_ids": _fingerprint(self.tasks)}
            self.store = RolloutStore(st.out_dir, config, resume=st.resume, parquet=st.parquet)
        done = (set(self.store.done) if self.store else set()) | set(gr.skip)
        self._queue: deque[int] = deque(i for i in range(len(self.tasks)) if i not in done)
        self._carry: deque[RunningGroup] = deque()  # suspended groups (partial rollout), resumed first
        self._ready: deque[Group] = deque()      # accepted beyond a batch's target, delivered next time
        self._ready_dropped: list[Group] = []    # dropped after a batch closed, delivered with the next one
        self.batches = 0
        self.workers = ex.workers
        self.quiet_gc = ex.quiet_gc
        self._pool = None
        if ex.workers:
            if gr.partial_rollout:
                raise InvalidInput("partial_rollout keeps suspended episodes in the driver: use workers=0 with it")
            if ex.backend != "local":
                raise InvalidInput("workers run envs in their own processes: use backend='local' with workers")
            from slime_env.registry import registry_specs
            from slime_env.rollout.workers import WorkerPool

            env_ids = {env_id, *(t.metadata.get("env_id") for t in self.tasks)} - {None}
            self._pool = WorkerPool(ex.workers, {
                "tasks": self.tasks, "policy": policy, "renderer": renderer, "env_id": env_id,
                "env_kwargs": self.env_kwargs, "env_factory": env_factory, "sampling_params": self.sampling_params,
                "n": self.n, "episode_kwargs": self.episode_kwargs, "seed": seed, "train_agents": train_agents,
                "policy_for": policy_for}, quiet_gc=ex.quiet_gc,
                env_specs={s.id: s for s in registry_specs() if s.id in env_ids})

    # --- public API ------------------------------------------------------------------------------
    def remaining(self) -> int:
        """Groups not delivered yet (queued, suspended or finished-but-undelivered)."""
        return len(self._queue) + len(self._carry) + len(self._ready) + len(self._ready_dropped)

    async def generate_batch(self, num_groups: int) -> Batch:
        if num_groups < 1:
            raise InvalidInput(f"num_groups must be >= 1, got {num_groups}")
        with quiet_gc(self.quiet_gc):
            return await self._generate_batch(num_groups)

    async def _generate_batch(self, num_groups: int) -> Batch:
        t0 = time.perf_counter()
        accepted: list[Group] = []
        dropped, self._ready_dropped = self._ready_dropped, []
        while self._ready and len(accepted) < num_groups:
            accepted.append(self._ready.popleft())
        limit = math.ceil(num_groups * self.over_sampling)
        running: dict[asyncio.Task, RunningGroup] = {}
        # Finished groups are queued by their done-callbacks: O(1) per group, where asyncio.wait over every
        # running group costs O(groups in flight) per completion.
        finished: deque[asyncio.Task] = deque()
        wake = asyncio.Event()

        def on_done(fut: asyncio.Task) -> None:
            finished.append(fut)
            wake.set()

        progress = self._progress(num_groups)
        try:
            while len(accepted) < num_groups:
                while (len(accepted) + len(running) < limit and (self._carry or self._queue)
                       and (len(running) + 1) * self.n <= self.max_concurrency):
                    rg = self._carry.popleft() if self._carry else self.runner.new(self._queue.popleft())
                    rg.future = asyncio.ensure_future(self._run_group(rg))
                    rg.future.add_done_callback(on_done)
                    running[rg.future] = rg
                if not running:
                    break  # no tasks left
                while not finished:
                    wake.clear()
                    await wake.wait()
                while finished:
                    group = running.pop(finished.popleft()).future.result()
                    self._judge(group)
                    if not group.accepted:
                        dropped.append(group)
                    elif len(accepted) < num_groups:
                        accepted.append(group)
                        if progress:
                            progress[0].advance(progress[1])
                    else:
                        self._ready.append(group)
            await self._abort(running)
        except asyncio.CancelledError:
            # The caller gave up on this batch (e.g. an asynchronous run ending): stop its episodes instead of
            # leaving them running for nobody; their tasks go back to the queue (or stay suspended).
            await asyncio.shield(self._abort(running))
            raise
        finally:
            if progress:
                progress[0].stop()
        for group in [*accepted, *dropped]:
            if self.store:
                self.store.append(group.to_record())
        self.batches += 1
        if self.store:
            self.store.write_parquet([_flat_row(g, t) for g in accepted for t in g.trajectories])
        metrics = batch_metrics(accepted, dropped, time.perf_counter() - t0,
                                carried=len(self._carry), queued=len(self._queue))
        return Batch(groups=accepted, dropped=dropped, metrics=metrics)

    async def run(self, batch_size: int | None = None) -> AsyncIterator[Group]:
        """Every remaining task, as accepted groups (dropped ones are persisted, not yielded)."""
        while self.remaining():
            batch = await self.generate_batch(batch_size or self.remaining())
            for group in batch.groups:
                yield group
            if not batch.groups and not batch.dropped:
                break

    def stream(self, *, in_flight: int, per_step: int, max_staleness: int | None = None, version: int = 0) -> Any:
        """A `GroupStream` over this manager's tasks: groups kept running across batch boundaries, `per_step` taken
        at a time, none staler than `max_staleness` weight versions (asynchronous training). Not with `workers`;
        the manager's own `generate_batch` must not run beside it."""
        from slime_env.rollout.stream import GroupStream

        if self._pool is not None:
            raise InvalidInput("stream() runs groups in this process: use workers=0 with it")
        return GroupStream(self, in_flight=in_flight, per_step=per_step, max_staleness=max_staleness, version=version)

    def next_index(self) -> int | None:
        """The next group index to run (suspended groups are the stream's own business), or None when none is left."""
        return self._queue.popleft() if self._queue else None

    def queued(self) -> int:
        """Group indices waiting to start."""
        return len(self._queue)

    def requeue(self, index: int) -> None:
        """Run group `index` again, first (its result was not used: e.g. too stale to train on)."""
        self._queue.appendleft(index)

    def judge(self, group: Group) -> None:
        """Apply the dynamic filter: `group.accepted` False (with `filter_reason`) when it drops the group."""
        self._judge(group)

    async def close(self) -> None:
        """Abort and close what is still suspended; close the store. Undelivered groups rerun on resume."""
        while self._carry:
            rg = self._carry.popleft()
            for ep in rg.episodes:
                ep.trajectory()
            await self.runner.close_envs(rg)
        if self.store:
            self.store.close()
        self.runner.close()
        await self.runner.close_gateways()
        if self._pool is not None:
            await self._pool.close()

    # --- internals -------------------------------------------------------------------------------
    async def _run_group(self, rg: RunningGroup) -> Group | None:
        if self._pool is not None:  # a worker process runs it and sends the whole group back
            return await self._pool.run_group(rg.group_index)
        return await self.runner.run(rg)

    def _judge(self, group: Group) -> None:
        if self.filter is None:
            return
        try:
            keep = bool(self.filter(group))
        except Exception as e:  # noqa: BLE001 - a filter bug drops the group, visibly
            group.accepted, group.filter_reason = False, f"filter raised {type(e).__name__}: {e}"
            return
        if not keep:
            group.accepted, group.filter_reason = False, f"dropped by {getattr(self.filter, '__name__', 'filter')}"

    async def _abort(self, running: dict[asyncio.Task, RunningGroup]) -> None:
        """Abort groups still running once the batch is full; keep (partial) or requeue their tasks."""
        if not running:
            return
        if self._pool is not None:
            await asyncio.gather(*(self._pool.abort(rg.group_index, ABORTED) for rg in running.values()))
        await asyncio.gather(*(ep.abort(ABORTED) for rg in running.values() for ep in rg.episodes))
        for fut, rg in running.items():
            group = await fut
            if group is None:  # suspended (partial rollout): resumed first next time
                self._carry.append(rg)
            elif any(t.status == "aborted" and t.reason == ABORTED for t in group.trajectories):
                self._queue.appendleft(rg.group_index)  # cut short without partial rollouts: rerun from scratch
            else:  # it finished before the abort reached it: deliver it next time
                self._judge(group)
                (self._ready if group.accepted else self._ready_dropped).append(group)

    def _progress(self, total: int):
        if not self.progress:
            return None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        bar = Progress(TextColumn(f"batch {self.batches}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                       transient=True)
        task_id = bar.add_task("groups", total=total)
        bar.start()
        return bar, task_id


def _fingerprint(tasks: Sequence[Task]) -> str:
    import hashlib

    h = hashlib.sha256()
    for t in tasks:
        h.update(str(t.id).encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def _flat_row(group: Group, t: Any) -> dict[str, Any]:
    return {"group_index": group.group_index, "index": t.metadata.get("index"), "task_id": group.task.id,
            "env_id": group.env_id, "status": t.status, "reason": t.reason, "reward": t.reward,
            "prompt_ids": t.prompt_ids, "response_ids": t.response_ids, "loss_mask": t.loss_mask,
            "rollout_logprobs": t.rollout_logprobs, "turn_rewards": t.turn_rewards, "num_turns": t.num_turns}
