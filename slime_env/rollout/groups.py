"""Running one group: the n episodes of one task, from making their envs to the finished `Group`.

`GroupRunner` is what the rollout manager (and each of its worker processes, `slime_env.rollout.workers`) uses to
run a group; the manager adds what spans groups — batches, the queue, filters, the store, aborts — and imports
this module, never the other way round.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from slime_env.agent_env import AgentEnv, GatewayPool
from slime_env.env import Env
from slime_env.errors import InvalidInput
from slime_env.multi_agent import MultiAgentEnv, run_multi_agent_episode
from slime_env.registry import make
from slime_env.renderers.template import TemplateRenderer
from slime_env.runner import Episode
from slime_env.trajectory import STATUSES, Trajectory
from slime_env.types import Task


@dataclass
class Group:
    """The `n_samples_per_prompt` trajectories of one task, in sample order.

    `group_index` is the task's position in the dataset; trajectory k has `metadata["index"] ==
    group_index * n + k`. `accepted` is False when the dynamic filter dropped it (`filter_reason`).
    A multi-agent env gives n trajectories per trained agent, agent after agent (each agent's n samples
    consecutive: a GRPO group per agent), sharing `metadata["episode_id"]` per sample.
    """

    group_index: int
    task: Task
    env_id: str
    trajectories: list[Trajectory]
    accepted: bool = True
    filter_reason: str = ""

    def status_counts(self) -> dict[str, int]:
        counts = dict.fromkeys(STATUSES, 0)
        for t in self.trajectories:
            counts[t.status] += 1
        return counts

    def to_slime_samples(self) -> list[dict[str, Any]]:
        """slime `Sample` dicts, positional (the n samples of this group, in order); failed ones removed-safe."""
        return [t.to_slime_sample() for t in self.trajectories]

    def to_record(self) -> dict[str, Any]:
        return {"group_index": self.group_index, "task_id": self.task.id, "env_id": self.env_id,
                "accepted": self.accepted, "filter_reason": self.filter_reason,
                "status_counts": self.status_counts(), "trajectories": [t.to_dict() for t in self.trajectories]}


@dataclass
class Batch:
    """One `generate_batch` result: accepted groups (exactly the number asked for, unless the data ran
    out), the groups the filter dropped on the way, and metrics a trainer can log."""

    groups: list[Group]
    dropped: list[Group] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class RunningGroup:
    """A group while it runs: its episodes (kept when a partial rollout suspends them) and envs."""
    group_index: int
    task: Task
    env_id: str
    episodes: list[Any] = field(default_factory=list)
    envs: list[Env | None] = field(default_factory=list)
    future: asyncio.Task | None = None


class GroupRunner:
    """Runs groups of `n` episodes (`new(index)`, then `await run(group)`): makes each episode's env (`env_factory`,
    a Ray env pool with `backend="ray"`, or the registry), runs the episodes — multi-agent ones through
    `run_multi_agent_episode` — closes the envs and returns the `Group`, or None when a partial-rollout abort
    suspended it (its episodes resume on the next `run`)."""

    def __init__(self, tasks: Sequence[Task], *, policy: Any, renderer: TemplateRenderer, env_id: str | None,
                 env_kwargs: Mapping[str, Any], env_factory: Callable[[Task, str], Any] | None,
                 sampling_params: Mapping[str, Any], n: int, episode_kwargs: Mapping[str, Any], seed: int,
                 train_agents: Sequence[str] | None, policy_for: Callable[[int, str], Any] | None,
                 partial_rollout: bool = False, mask_offpolicy: bool = False, backend: str = "local",
                 ray_actors: int = 2, ray_actor_options: Mapping[str, Any] | None = None):
        self.tasks, self.policy, self.renderer = tasks, policy, renderer
        self.env_id, self.env_kwargs, self.env_factory = env_id, dict(env_kwargs), env_factory
        self.sampling_params, self.n, self.episode_kwargs = dict(sampling_params), n, dict(episode_kwargs)
        self.seed, self.policy_for = seed, policy_for
        self.train_agents = list(train_agents) if train_agents is not None else None
        self.partial_rollout, self.mask_offpolicy = partial_rollout, mask_offpolicy
        self.backend, self.ray_actors, self.ray_actor_options = backend, ray_actors, dict(ray_actor_options or {})
        self._ray_pools: dict[str, Any] = {}
        self._gateways: GatewayPool | None = None

    def new(self, index: int) -> RunningGroup:
        task = self.tasks[index]
        return RunningGroup(index, task, str(task.metadata.get("env_id", self.env_id)))

    async def run(self, rg: RunningGroup) -> Group | None:
        if not rg.episodes:
            await self._start_episodes(rg)
        elif self.mask_offpolicy:
            for ep in rg.episodes:
                if ep.suspended:
                    ep.mask_offpolicy()
        results = await asyncio.gather(*(ep.run() for ep in rg.episodes))
        if any(r is None for r in results):
            return None  # suspended by an abort (partial rollout)
        await self.close_envs(rg)
        if results and isinstance(results[0], dict):  # multi-agent: each agent's n samples in a row
            agents = self.train_agents or list(results[0])
            results = [r[a] for a in agents for r in results]
        elif results and isinstance(results[0], list):  # agent sessions: each sample's main trajectory, its branches
            results = [t for r in results for t in r]
        return Group(rg.group_index, rg.task, rg.env_id, list(results))

    async def _start_episodes(self, rg: RunningGroup) -> None:
        for k in range(self.n):
            index = rg.group_index * self.n + k
            metadata = {"index": index, "group_index": rg.group_index, "sample_index": k, "env_id": rg.env_id}
            try:
                env = await self._make_env(rg.task, rg.env_id)
            except Exception as e:  # noqa: BLE001 - a broken env becomes failed trajectories, not a crash
                env = _BrokenEnv(f"making env {rg.env_id!r} raised {type(e).__name__}: {e}")
            rg.envs.append(env)
            if isinstance(env, MultiAgentEnv):
                rg.episodes.append(_MultiAgentEpisode(env, self, rg.task, metadata, self.seed * 1_000_003 + index))
                continue
            if isinstance(env, AgentEnv):
                rg.episodes.append(_AgentEpisode(env, self, rg.task, metadata))
                continue
            policy = self.policy.get("agent", self.policy.get("default")) if isinstance(self.policy, Mapping) \
                else self.policy
            rg.episodes.append(Episode(env, policy, rg.task, renderer=self.renderer, metadata=metadata,
                                       sampling_params=self.sampling_params, seed=self.seed * 1_000_003 + index,
                                       suspend_on_abort=self.partial_rollout, **self.episode_kwargs))

    async def _make_env(self, task: Task, env_id: str) -> Env:
        if self.env_factory is not None:
            env = self.env_factory(task, env_id)
            return await env if inspect.isawaitable(env) else env
        if self.backend == "ray":
            if env_id not in self._ray_pools:
                from slime_env.rollout.ray_backend import RayEnvPool

                self._ray_pools[env_id] = RayEnvPool(env_id, env_kwargs=self.env_kwargs, num_actors=self.ray_actors,
                                                     actor_options=self.ray_actor_options)
            return self._ray_pools[env_id].factory(task, env_id)
        return make(env_id, **self.env_kwargs)

    async def close_envs(self, rg: RunningGroup) -> None:
        for env in rg.envs:
            if env is not None:
                try:
                    await env.close()
                except Exception:  # noqa: BLE001 - closing is best effort; the trajectories are safe
                    pass
        rg.envs = [None] * len(rg.envs)

    async def gateway(self, env: AgentEnv) -> Any:
        """The gateway the agent episodes of `env`'s parser share (started on first use, on 127.0.0.1)."""
        if self._gateways is None:
            kw = self.episode_kwargs
            policy = self.policy.get("agent", self.policy.get("default")) if isinstance(self.policy, Mapping) \
                else self.policy
            self._gateways = GatewayPool(policy, self.renderer, strict=bool(kw.get("strict", False)),
                                         max_new_tokens=kw.get("max_new_tokens", 1024),
                                         max_context_tokens=kw.get("max_context_tokens"),
                                         overrides=self.sampling_params)
        return await self._gateways.get(env)

    def close(self) -> None:
        for pool in self._ray_pools.values():
            pool.shutdown()
        self._ray_pools.clear()

    async def close_gateways(self) -> None:
        if self._gateways is not None:
            await self._gateways.close()


class _MultiAgentEpisode:
    """One multi-agent sample of a group, with the parts of `Episode`'s interface the manager uses."""

    suspended = False
    generating = False  # it is not aborted: a weight update does not wait for it

    def __init__(self, env: MultiAgentEnv, manager: GroupRunner, task: Task, metadata: dict[str, Any], seed: int):
        self.env, self.manager, self.task, self.metadata, self.seed = env, manager, task, metadata, seed
        self.done: dict[str, Trajectory] | None = None

    async def run(self) -> dict[str, Trajectory]:
        if self.done is None:
            kw = self.manager.episode_kwargs
            policies = self.manager.policy
            if self.manager.policy_for is not None:
                base = policies if isinstance(policies, Mapping) else dict.fromkeys(self.env.agents, policies)
                index = self.metadata["index"]
                policies = {a: self.manager.policy_for(index, a) or base[a] for a in self.env.agents}
            self.done = await run_multi_agent_episode(
                self.env, policies, self.task, renderer=self.manager.renderer, max_turns=kw["max_turns"],
                max_new_tokens=kw["max_new_tokens"], max_context_tokens=kw["max_context_tokens"],
                deadline_s=kw["deadline_s"], strict=kw["strict"], sampling_params=self.manager.sampling_params,
                seed=self.seed, metadata=self.metadata)
        return self.done

    async def abort(self, reason: str) -> None:
        return None  # a multi-agent episode runs to its end (its group is delivered with the next batch)

    def mask_offpolicy(self) -> None:
        return None

    def trajectory(self) -> None:
        return None


class _AgentEpisode:
    """One sample of an `AgentEnv` group: the agent program against its own gateway session; its result is the
    sample's main trajectory followed by its side branches."""

    suspended = False
    generating = False  # its engine calls come through the gateway; a weight update does not wait for them

    def __init__(self, env: AgentEnv, manager: GroupRunner, task: Task, metadata: dict[str, Any]):
        self.env, self.manager, self.task, self.metadata = env, manager, task, metadata
        self.done: list[Trajectory] | None = None

    async def run(self) -> list[Trajectory]:
        if self.done is None:
            gateway = await self.manager.gateway(self.env)
            self.done = await self.env.run(gateway, self.task, metadata=self.metadata,
                                           deadline_s=self.manager.episode_kwargs.get("deadline_s"))
        return self.done

    async def abort(self, reason: str) -> None:
        return None  # the agent runs to its end (or its deadline)

    def mask_offpolicy(self) -> None:
        return None

    def trajectory(self) -> None:
        return None


class _BrokenEnv(Env):
    """Stands in for an env that could not be made: its episode fails with the reason."""

    def __init__(self, reason: str):
        self.reason = reason

    async def reset(self, *, seed=None, options=None):
        raise InvalidInput(self.reason)
