"""Multi-agent episodes: `MultiAgentEnv` and `run_multi_agent_episode`, one token ledger per agent.

An env with several agents follows PettingZoo's two conventions behind one interface: `acting()`
names the agents that must act now — one agent for turn-based games (AEC: `agent_selection`), several
for simultaneous moves (Parallel) — and `step` takes one action per acting agent. Every agent sees
the game through its own chat: `reset` and `step` return observations per agent (what that agent is
shown), rewards per agent (an agent may be rewarded on a step it did not act in: zero-sum outcomes),
and per-agent `terminated` / `truncated` (an agent that is out stops acting; the others go on).

The runner keeps, for every agent, exactly what `run_episode` keeps for one: its prompt, the ids it
generated (mask 1), everything inserted between its turns (mask 0: other agents' moves, env messages,
template tokens), its per-turn rewards and a status. Agents that act together generate concurrently.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from slime_env.episode_state import EpisodeEnd, EpisodeState, TurnAborted, merge_env_sampling, take_turn
from slime_env.errors import InvalidInput
from slime_env.ledger import TokenLedger
from slime_env.parsers import get_parser
from slime_env.policy import Policy
from slime_env.renderers.template import TemplateRenderer
from slime_env.trajectory import Trajectory
from slime_env.types import Action, Message, Task, coerce_messages, coerce_reward

Observations = Mapping[str, Sequence[Message | Mapping[str, Any]]]


class MultiAgentEnv:
    """The async multi-agent env contract (see the module docstring).

    `agents`: every agent id the env may use, in seat order. `roles` (optional): agent id -> role name,
    recorded in each trajectory (e.g. "x" / "o"); `parser`, `tools`, `stop` as for `Env`; `sampling_params` as for
    `Env` (read once `reset` returns), for every agent, or per agent as `{agent_id: params}` (e.g. a greedy opponent).
    - `reset(seed=, options=)` -> `(observations, info)`: each agent's opening messages (every agent
      in `agents` gets some, its system prompt and first view).
    - `acting()` -> the agents that must act now (empty: the episode is over).
    - `step(actions)` -> `(observations, rewards, terminated, truncated, info)`, each a mapping by agent
      id (missing means no message / 0.0 / False); `actions` holds one `Action` per acting agent.
    Every acting agent must have been shown something since its last turn (its opponent's move, "your
    turn"); an env that does not is an error the episode records.
    """

    agents: tuple[str, ...] = ()
    roles: Mapping[str, str] = {}
    parser: ClassVar[str | None] = None
    tools: Sequence[Mapping[str, Any]] | None = None
    stop: Sequence[str] = ()
    sampling_params: Mapping[str, Any] | None = None

    async def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None):
        raise NotImplementedError

    def acting(self) -> Sequence[str]:
        raise NotImplementedError

    async def step(self, actions: Mapping[str, Action]):
        raise NotImplementedError

    async def close(self) -> None:
        return None


class _Seat:
    """One agent's episode state: its ledger and conversation (an `EpisodeState` that never calls the env)."""

    def __init__(self, agent: str, policy: Policy, task: Task, renderer: TemplateRenderer, strict: bool,
                 metadata: dict[str, Any]):
        self.agent, self.renderer = agent, renderer
        self.state = EpisodeState(None, policy, task, renderer, agent, strict, metadata)
        self.state.phase = "waiting"
        self.pending: list[Message] = []  # shown to the agent since its last turn, inserted before its next
        self.last_ids: list[int] = []
        self.early_reward = 0.0  # rewards before the agent's first turn go to that turn
        self.done = False
        self.params: dict[str, Any] = {}  # the run's sampling params, the env's own for this agent over them
        self.max_new_tokens = 0

    def start(self, messages: list[Message], tools: Any) -> None:
        ep = self.state
        ep.messages, ep.tools = messages, tools
        ep.ledger = TokenLedger(self.renderer.render_prompt(messages, tools=tools))

    def acted(self, action: Action) -> None:
        """The agent's turn is over: its reward slot opens (with what it earned before its first turn)."""
        self.last_ids = list(action.token_ids)
        self.state.turn_rewards.append(self.early_reward)
        self.early_reward = 0.0
        self.state.turn += 1

    def reward(self, value: float) -> None:
        if self.state.turn_rewards:
            self.state.turn_rewards[-1] += value
        else:
            self.early_reward += value

    def end(self, status: str, reason: str) -> None:
        if not self.done:
            self.done = True
            self.state.status, self.state.reason = status, reason
            self.state.messages.extend(self.pending)  # kept for the record; no tokens follow the last turn
            self.pending = []


async def run_multi_agent_episode(env: MultiAgentEnv, policies: Policy | Mapping[str, Policy],
                                  task: Task | Mapping[str, Any] | str, *,
                                  renderer: TemplateRenderer | Mapping[str, TemplateRenderer],
                                  max_turns: int = 16, max_new_tokens: int = 256,
                                  max_context_tokens: int | None = None, deadline_s: float | None = None,
                                  sampling_params: Mapping[str, Any] | None = None, seed: int | None = None,
                                  strict: bool | None = None, metadata: Mapping[str, Any] | None = None
                                  ) -> dict[str, Trajectory]:
    """Run one multi-agent episode; `{agent_id: Trajectory}` for every agent in `env.agents`.

    `policies` / `renderer`: one for all agents (self-play: each agent still has its own conversation
    and ledger) or one per agent id (different models, a frozen or scripted opponent). `max_turns` is
    per agent. Never raises for env, policy or budget problems: a failing env fails every agent; a
    failing policy fails its agent and aborts the others, each with the reason. Trajectories share
    `metadata["episode_id"]` and carry `metadata["role"]`. The caller owns `env` (reset here, not closed).
    """
    episode = _MultiAgentEpisode(env, policies, Task.coerce(task), renderer, strict, metadata)
    return await episode.run(seed=seed, max_turns=max_turns, max_new_tokens=max_new_tokens,
                             max_context_tokens=max_context_tokens, deadline_s=deadline_s,
                             sampling_params=sampling_params)


class _AgentFailed(Exception):
    def __init__(self, agent: str, error: BaseException):
        super().__init__(str(error))
        self.agent, self.error = agent, error


class _MultiAgentEpisode:
    """The seats of one multi-agent episode and its loop: rounds of the acting agents' turns, then the env's step."""

    def __init__(self, env: MultiAgentEnv, policies: Policy | Mapping[str, Policy], task: Task,
                 renderer: TemplateRenderer | Mapping[str, TemplateRenderer], strict: bool | None,
                 metadata: Mapping[str, Any] | None):
        agents = tuple(env.agents)
        if not agents or len(set(agents)) != len(agents):
            raise InvalidInput(f"{type(env).__name__}.agents must be distinct agent ids, got {agents!r}")
        policy_of = _per_agent(policies, agents, "policies")
        renderer_of = _per_agent(renderer, agents, "renderer")
        episode_id = str((metadata or {}).get("episode_id") or secrets.token_hex(12))
        roles = dict(getattr(env, "roles", {}) or {})
        self.env, self.task, self.name = env, task, type(env).__name__
        self.seats = {a: _Seat(a, policy_of[a], task, renderer_of[a],
                               renderer_of[a].strict if strict is None else strict,
                               {**(metadata or {}), "episode_id": episode_id, "session_id": f"{episode_id}/{a}",
                                "role": roles.get(a, a), "agents": list(agents)}) for a in agents}
        for seat in self.seats.values():
            if callable(getattr(seat.state.policy, "for_episode", None)):
                seat.state.policy = seat.state.policy.for_episode(seat.state.metadata["session_id"])
        self.parse = get_parser(env.parser)
        self.phase = "env.reset"
        self.env_s = 0.0
        self.max_turns, self.max_context_tokens, self.deadline_at = 0, None, None

    async def run(self, *, seed: int | None, max_turns: int, max_new_tokens: int, max_context_tokens: int | None,
                  deadline_s: float | None, sampling_params: Mapping[str, Any] | None) -> dict[str, Trajectory]:
        loop = asyncio.get_running_loop()
        self.max_turns, self.max_context_tokens = max_turns, max_context_tokens
        self.deadline_at = None if deadline_s is None else loop.time() + deadline_s
        t0 = time.perf_counter()
        try:
            await self._reset(seed, dict(sampling_params or {}), max_new_tokens)
            while await self._round():
                pass
            self._end_all("completed", "")
        except EpisodeEnd as end:
            self._end_all(end.status, end.reason)
        except _AgentFailed as failure:
            failed = self.seats[failure.agent]
            failed.state.phase = "policy.generate"
            failed.state.fail(failure.error)
            failed.done = True
            self._end_all("aborted", f"the episode ended: agent {failure.agent!r} failed ({failed.state.reason})")
        except TimeoutError as e:
            if self.deadline_at is not None and loop.time() >= self.deadline_at:
                self._end_all("truncated", f"deadline of {deadline_s}s exceeded during {self.phase}")
            else:
                self._fail_all(e)
        except Exception as e:  # noqa: BLE001 - an env or framework failure fails every agent, never the batch
            self._fail_all(e)
        return self._trajectories(time.perf_counter() - t0)

    async def _reset(self, seed: int | None, base: dict[str, Any], max_new_tokens: int) -> None:
        async with asyncio.timeout_at(self.deadline_at):
            t = time.perf_counter()
            observations, info = _pair(await self.env.reset(seed=seed, options={"task": self.task}), self.env)
            self.env_s += time.perf_counter() - t
        for a, seat in self.seats.items():
            opening = coerce_messages(observations.get(a, ()), f"{self.name}.reset observations[{a!r}]")
            if not opening:
                raise InvalidInput(f"{self.name}.reset gave agent {a!r} no messages")
            seat.state.info = dict(info)
            seat.start(opening, self.env.tools)
        _take_env_sampling(self.env, self.seats, base, max_new_tokens)

    async def _round(self) -> bool:
        """The acting agents' turns (concurrent) and the env's step on their actions; False once nobody acts."""
        self.phase = "env.acting"
        acting = list(self.env.acting())
        unknown = [a for a in acting if a not in self.seats]
        if unknown:
            raise InvalidInput(f"{self.name}.acting() named unknown agents {unknown}")
        acting = [a for a in acting if not self.seats[a].done]
        if not acting:
            return False
        for a in acting:
            if self.seats[a].state.turn >= self.max_turns:
                raise EpisodeEnd("truncated", f"max_turns={self.max_turns} reached by {a!r}")
        self.phase = "render observation"
        for a in acting:
            _bridge(self.seats[a], self.env, self.max_context_tokens)
        self.phase = "policy.generate"
        results = await asyncio.gather(*(self._turn(self.seats[a]) for a in acting), return_exceptions=True)
        for a, result in zip(acting, results):
            if isinstance(result, (EpisodeEnd, TimeoutError)):
                raise result
            if isinstance(result, BaseException):
                raise _AgentFailed(a, result)
        for a, action in zip(acting, results):
            self.seats[a].acted(action)
        self.phase = "env.step"
        async with asyncio.timeout_at(self.deadline_at):
            t = time.perf_counter()
            result = await self.env.step(dict(zip(acting, results)))
            self.env_s += time.perf_counter() - t
        self._apply(*_step_result(result, self.env, self.seats))
        return True

    async def _turn(self, seat: _Seat) -> Action:
        try:
            return await take_turn(seat.state, seat.params, self.parse, max_new_tokens=seat.max_new_tokens,
                                   max_context_tokens=self.max_context_tokens, deadline_at=self.deadline_at,
                                   who=seat.agent)
        except TurnAborted:
            raise EpisodeEnd("aborted", f"agent {seat.agent!r}'s generation was aborted") from None

    def _apply(self, observations: Mapping[str, list[Message]], rewards: Mapping[str, float],
               terminated: Mapping[str, Any], truncated: Mapping[str, Any], info: dict[str, Any]) -> None:
        """What the env's step shows, pays and ends, per agent."""
        for a, seat in self.seats.items():
            if seat.done:  # out of the game: what it is still shown is kept for the record only
                seat.state.messages += observations.get(a, [])
            else:
                seat.pending += observations.get(a, [])
            if a in rewards:
                seat.reward(rewards[a])
            seat.state.info = dict(info)
            if terminated.get(a):
                seat.end("completed", "")
            elif truncated.get(a):
                seat.end("truncated", "the env truncated this agent's episode")

    def _end_all(self, status: str, reason: str) -> None:
        for seat in self.seats.values():
            seat.end(status, reason)

    def _fail_all(self, error: BaseException) -> None:
        for seat in self.seats.values():
            if not seat.done:
                seat.state.phase = self.phase
                seat.state.fail(error)
                seat.done = True

    def _trajectories(self, total: float) -> dict[str, Trajectory]:
        out = {}
        for a, seat in self.seats.items():
            trajectory = seat.state.trajectory()
            generate_s = trajectory.timings["generate_s"]
            out[a] = dataclasses.replace(  # + rewards before a first turn
                trajectory, reward=float(sum(seat.state.turn_rewards) + seat.early_reward),
                timings={"total_s": total, "generate_s": generate_s, "env_s": self.env_s,
                         "framework_s": max(0.0, total - self.env_s - generate_s)})
        return out


def _per_agent(value: Any, agents: tuple[str, ...], name: str) -> dict[str, Any]:
    if isinstance(value, Mapping):
        missing = [a for a in agents if a not in value]
        if missing:
            raise InvalidInput(f"{name}: no entry for agents {missing} (have {sorted(value)})")
        return {a: value[a] for a in agents}
    return {a: value for a in agents}


def _pair(result: Any, env: MultiAgentEnv) -> tuple[Mapping[str, Any], dict[str, Any]]:
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], Mapping)):
        raise InvalidInput(f"{type(env).__name__}.reset must return ({{agent: messages}}, info)")
    return result[0], dict(result[1] or {})


def _step_result(result: Any, env: MultiAgentEnv, seats: Mapping[str, _Seat]):
    name = type(env).__name__
    if not (isinstance(result, tuple) and len(result) == 5 and all(isinstance(r, Mapping) for r in result[:4])):
        raise InvalidInput(f"{name}.step must return ({{agent: messages}}, {{agent: reward}}, {{agent: terminated}}, "
                           f"{{agent: truncated}}, info)")
    observations, rewards, terminated, truncated, info = result
    for part, mapping in (("observations", observations), ("rewards", rewards), ("terminated", terminated),
                          ("truncated", truncated)):
        unknown = [a for a in mapping if a not in seats]
        if unknown:
            raise InvalidInput(f"{name}.step {part} name unknown agents {unknown}")
    clean_obs = {a: coerce_messages(m, f"{name}.step observations[{a!r}]") for a, m in observations.items()}
    clean_rewards = {a: coerce_reward(r, f"{name}.step rewards[{a!r}]") for a, r in rewards.items()}
    return clean_obs, clean_rewards, terminated, truncated, dict(info or {})


def _bridge(seat: _Seat, env: MultiAgentEnv, max_context_tokens: int | None) -> None:
    """Insert what the agent was shown since its last turn, and the prompt for its next one (mask 0)."""
    if seat.state.turn == 0:
        if seat.pending:  # shown before its first turn: part of its prompt
            seat.state.messages.extend(seat.pending)
            seat.state.ledger = TokenLedger(seat.renderer.render_prompt(seat.state.messages, tools=env.tools))
            seat.pending = []
        return
    if not seat.pending:
        raise InvalidInput(f"{type(env).__name__}: agent {seat.agent!r} must act but was shown nothing since its "
                           f"last turn (give it an observation, e.g. the other agents' moves)")
    obs, seat.pending = seat.pending, []
    seat.state.observe(seat.last_ids, obs, max_context_tokens, who=seat.agent)


def _take_env_sampling(env: MultiAgentEnv, seats: Mapping[str, _Seat], base: Mapping[str, Any],
                       max_new_tokens: int) -> None:
    """Each seat's sampling params and per-turn budget: the run's, with `env.sampling_params` over them (one mapping
    for every agent, or one per agent id), the renderer's stop tokens and the env's stop strings added."""
    own = getattr(env, "sampling_params", None)
    name = f"{type(env).__name__}.sampling_params"
    per_agent = isinstance(own, Mapping) and bool(own) and all(k in seats for k in own)
    for a, seat in seats.items():
        seat.params = dict(base)
        mine, where = (own.get(a), f"{name}[{a!r}]") if per_agent else (own, name)
        seat.max_new_tokens = merge_env_sampling(seat.params, mine, max_new_tokens, where)
        seat.params["stop_token_ids"] = sorted({*seat.renderer.stop_token_ids,
                                                *(seat.params.get("stop_token_ids") or ())})
        if env.stop:
            seat.params["stop"] = list(dict.fromkeys([*(seat.params.get("stop") or ()), *env.stop]))
