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

from slime_env.errors import InvalidInput
from slime_env.ledger import TokenLedger
from slime_env.parsers import get_parser
from slime_env.policy import Policy
from slime_env.renderers.template import TemplateRenderer
from slime_env.runner import _Episode, _merge_env_sampling
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
    """One agent's episode state: its ledger and conversation (an `_Episode` that never calls the env)."""

    def __init__(self, agent: str, env: MultiAgentEnv, policy: Policy, task: Task, renderer: TemplateRenderer,
                 strict: bool, metadata: dict[str, Any]):
        self.agent, self.renderer = agent, renderer
        self.state = _Episode(env, policy, task, renderer, agent, strict, metadata)
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
    task = Task.coerce(task)
    agents = tuple(env.agents)
    if not agents or len(set(agents)) != len(agents):
        raise InvalidInput(f"{type(env).__name__}.agents must be distinct agent ids, got {agents!r}")
    policy_of = _per_agent(policies, agents, "policies")
    renderer_of = _per_agent(renderer, agents, "renderer")
    episode_id = str((metadata or {}).get("episode_id") or secrets.token_hex(12))
    roles = dict(getattr(env, "roles", {}) or {})
    seats = {a: _Seat(a, env, policy_of[a], task, renderer_of[a],
                      renderer_of[a].strict if strict is None else strict,
                      {**(metadata or {}), "episode_id": episode_id, "session_id": f"{episode_id}/{a}",
                       "role": roles.get(a, a), "agents": list(agents)}) for a in agents}
    for a, seat in seats.items():
        if callable(getattr(seat.state.policy, "for_episode", None)):
            seat.state.policy = seat.state.policy.for_episode(seat.state.metadata["session_id"])
    base = dict(sampling_params or {})
    parse = get_parser(env.parser)
    loop = asyncio.get_running_loop()
    deadline_at = None if deadline_s is None else loop.time() + deadline_s
    t0 = time.perf_counter()
    env_s = 0.0
    phase = "env.reset"
    try:
        async with asyncio.timeout_at(deadline_at):
            t = time.perf_counter()
            observations, info = _pair(await env.reset(seed=seed, options={"task": task}), env)
            env_s += time.perf_counter() - t
        for a, seat in seats.items():
            opening = coerce_messages(observations.get(a, ()), f"{type(env).__name__}.reset observations[{a!r}]")
            if not opening:
                raise InvalidInput(f"{type(env).__name__}.reset gave agent {a!r} no messages")
            seat.state.info = dict(info)
            seat.start(opening, env.tools)
        _take_env_sampling(env, seats, base, max_new_tokens)
        while True:
            phase = "env.acting"
            acting = list(env.acting())
            unknown = [a for a in acting if a not in seats]
            if unknown:
                raise InvalidInput(f"{type(env).__name__}.acting() named unknown agents {unknown}")
            acting = [a for a in acting if not seats[a].done]
            if not acting:
                break
            for a in acting:
                if seats[a].state.turn >= max_turns:
                    raise _End("truncated", f"max_turns={max_turns} reached by {a!r}")
            phase = "render observation"
            for a in acting:
                _bridge(seats[a], env, max_context_tokens)
            phase = "policy.generate"
            results = await asyncio.gather(*(_generate(seats[a], env, max_context_tokens, deadline_at)
                                             for a in acting), return_exceptions=True)
            for a, result in zip(acting, results):
                if isinstance(result, (_End, TimeoutError)):
                    raise result
                if isinstance(result, BaseException):
                    raise _AgentFailed(a, result)
            actions = {}
            for a in acting:
                ep = seats[a].state
                ids = ep.close_turn()
                seats[a].last_ids = ids
                parsed = parse(ep.last_content) if parse is not None else None
                actions[a] = Action(text=ep.last_content, token_ids=tuple(ids),
                                    tool_calls=parsed.tool_calls if parsed else (),
                                    parse_errors=parsed.errors if parsed else (),
                                    finish_reason=ep.finish_reasons[-1], agent_id=a, turn=ep.turn)
                ep.parse_errors += len(actions[a].parse_errors)
                ep.turn_rewards.append(seats[a].early_reward)
                seats[a].early_reward = 0.0
                ep.turn += 1
            phase = "env.step"
            async with asyncio.timeout_at(deadline_at):
                t = time.perf_counter()
                result = await env.step(actions)
                env_s += time.perf_counter() - t
            observations, rewards, terminated, truncated, info = _step_result(result, env, seats)
            for a, seat in seats.items():
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
        for seat in seats.values():
            seat.end("completed", "")
    except _End as end:
        for seat in seats.values():
            seat.end(end.status, end.reason)
    except _AgentFailed as failure:
        failed = seats[failure.agent]
        failed.state.phase = "policy.generate"
        failed.state.fail(failure.error)
        failed.done = True
        for seat in seats.values():
            seat.end("aborted", f"the episode ended: agent {failure.agent!r} failed ({failed.state.reason})")
    except TimeoutError as e:
        if deadline_at is not None and loop.time() >= deadline_at:
            for seat in seats.values():
                seat.end("truncated", f"deadline of {deadline_s}s exceeded during {phase}")
        else:
            _fail_all(seats, phase, e)
    except Exception as e:  # noqa: BLE001 - an env or framework failure fails every agent, never the batch
        _fail_all(seats, phase, e)
    total = time.perf_counter() - t0
    out = {}
    for a, seat in seats.items():
        ep = seat.state
        trajectory = ep.trajectory()
        generate_s = trajectory.timings["generate_s"]
        out[a] = dataclasses.replace(
            trajectory, reward=float(sum(ep.turn_rewards) + seat.early_reward),  # + rewards before a first turn
            timings={"total_s": total, "generate_s": generate_s, "env_s": env_s,
                     "framework_s": max(0.0, total - env_s - generate_s)})
    return out


class _End(Exception):
    def __init__(self, status: str, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


class _AgentFailed(Exception):
    def __init__(self, agent: str, error: BaseException):
        super().__init__(str(error))
        self.agent, self.error = agent, error


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
    bridge = seat.renderer.bridge(seat.last_ids, obs, seat.state.messages)
    if max_context_tokens is not None and len(seat.state.ledger) + len(bridge) >= max_context_tokens:
        raise _End("truncated", f"agent {seat.agent!r}'s observation ({len(bridge)} tokens) leaves no room in "
                                f"the context budget of {max_context_tokens} tokens")
    seat.state.insert(seat.last_ids, obs, bridge)


def _take_env_sampling(env: MultiAgentEnv, seats: Mapping[str, _Seat], base: Mapping[str, Any],
                       max_new_tokens: int) -> None:
    """Each seat's sampling params and per-turn budget: the run's, with `env.sampling_params` over them (one mapping
    for every agent, or one per agent id)."""
    own = getattr(env, "sampling_params", None)
    name = f"{type(env).__name__}.sampling_params"
    per_agent = isinstance(own, Mapping) and bool(own) and all(k in seats for k in own)
    for a, seat in seats.items():
        seat.params = dict(base)
        mine, where = (own.get(a), f"{name}[{a!r}]") if per_agent else (own, name)
        seat.max_new_tokens = _merge_env_sampling(seat.params, mine, max_new_tokens, where)


async def _generate(seat: _Seat, env: MultiAgentEnv, max_context_tokens: int | None,
                    deadline_at: float | None) -> None:
    ep = seat.state
    room = seat.max_new_tokens
    if max_context_tokens is not None:
        room = min(room, max_context_tokens - len(ep.ledger))
    if room <= 0:
        raise _End("truncated", f"agent {seat.agent!r} exhausted the context budget of {max_context_tokens} tokens")
    params = dict(seat.params)
    params["stop_token_ids"] = sorted({*seat.renderer.stop_token_ids, *(params.get("stop_token_ids") or ())})
    if env.stop:
        params["stop"] = list(dict.fromkeys([*(params.get("stop") or ()), *env.stop]))
    gen = await ep.generate({**params, "max_new_tokens": room}, deadline_at)
    if gen.finish_reason == "abort":
        raise _End("aborted", f"agent {seat.agent!r}'s generation was aborted")


def _fail_all(seats: Mapping[str, _Seat], phase: str, error: BaseException) -> None:
    for seat in seats.values():
        if not seat.done:
            seat.state.phase = phase
            seat.state.fail(error)
            seat.done = True
