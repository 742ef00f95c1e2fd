"""PettingZoo envs as `MultiAgentEnv`s: `from_pettingzoo(env, render=...)` (optional extra `[pettingzoo]`); the other
way round, any `MultiAgentEnv` as a PettingZoo AEC env: `to_pettingzoo(env)` (`pettingzoo_export`).

Works with both PettingZoo APIs. AEC envs (turn-based: `agent_selection`, `last()`, classic games such as
tic-tac-toe, connect four, Leduc hold'em) act one agent at a time; Parallel envs (`parallel_env()`,
e.g. rock-paper-scissors) act all live agents at once. Each agent's chat gets `system_prompt` and,
before each of its turns, `render(agent, observation)` — the text the model sees for PettingZoo's
observation (numpy arrays; write one per game) — after a line per move of the others
(`describe_move(agent, action)`, called before the move is made; by default the game's own notation where
PettingZoo has one — chess in SAN — else the action index). The reply is parsed into an action by `parse(text)`
(default: the last integer in it, e.g. `<move>4</move>`); an action that does not parse, is outside the action space
or is masked out (`action_mask` in the observation) ends the episode: the offender (in a Parallel step, every
offender) gets `illegal_reward`, the others 0, and everyone is told why — never a crash. PettingZoo's truncations
(a time limit such as `max_cycles`) end trajectories as `truncated`, its terminations as `completed`. Rewards are
PettingZoo's, per step, to every agent (also those that did not act). Agents PettingZoo terminates step out of the
episode; dead agents' AEC turns (`step(None)`) are taken here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from slime_env.multi_agent import MultiAgentEnv
from slime_env.types import Action, Message

_LAST_INT = re.compile(r"-?\d+")


def last_integer(text: str) -> int | None:
    """The default action parser: the last integer in the reply."""
    found = _LAST_INT.findall(text)
    return int(found[-1]) if found else None


def _notation_for(env: Any) -> Callable[[str, int], str]:
    """The default move line: the game's own notation where PettingZoo has one (chess: SAN, "player_0 played Nf3."),
    else the action index. Called before the move is made."""
    def board() -> Any:  # looked up at every move: the env makes a new board at each reset
        return getattr(getattr(env, "unwrapped", env), "board", None)

    try:
        import chess
        from pettingzoo.classic.chess import chess_utils
    except ImportError:
        chess = None
    if chess is not None and isinstance(board(), chess.Board):
        seats = list(env.possible_agents)

        def san(agent: str, action: int) -> str:
            try:
                move = chess_utils.action_to_move(board(), action, seats.index(agent))
                return f"{agent} played {board().san(move)}."
            except Exception:  # noqa: BLE001 - an unexpected index: the raw number still says what happened
                return _moved(agent, action)

        return san
    return _moved


def _moved(agent: str, action: int) -> str:
    return f"{agent} played {action}."


def from_pettingzoo(env: Any, *, render: Callable[[str, Any], str],
                    describe_move: Callable[..., str] | None = None,
                    parse: Callable[[str], int | None] = last_integer, illegal_reward: float = -1.0,
                    system_prompt: str = "You are {agent} in a game. Reply with your action as <move>N</move>.") \
        -> MultiAgentEnv:
    """A `MultiAgentEnv` over a PettingZoo AEC or Parallel env (see the module docstring)."""
    from pettingzoo import AECEnv, ParallelEnv

    if isinstance(env, AECEnv):  # wrappers included (they subclass AECEnv)
        return _AEC(env, render, describe_move, parse, illegal_reward, system_prompt)
    if isinstance(env, ParallelEnv):
        return _Parallel(env, render, describe_move, parse, illegal_reward, system_prompt)
    raise TypeError(f"{type(env).__name__} is neither a PettingZoo AEC nor a Parallel env")


class _Base(MultiAgentEnv):
    def __init__(self, env: Any, render, describe_move, parse, illegal_reward: float, system_prompt: str):
        self.env, self.render, self.parse, self.illegal_reward = env, render, parse, illegal_reward
        self.describe_move = describe_move or _notation_for(env)
        self.system_prompt = system_prompt
        self.agents = tuple(env.possible_agents)
        self.over = False

    def _system(self, agent: str) -> Message:
        return Message("system", self.system_prompt.format(agent=agent))

    def _legal(self, agent: str, action: int | None, observation: Any) -> str | None:
        """Why `action` is not legal for `agent`, or None."""
        if action is None:
            return "no action found in the reply"
        space = self.env.action_space(agent)
        if not space.contains(action):
            return f"action {action} is outside the action space {space}"
        mask = observation.get("action_mask") if isinstance(observation, Mapping) else None
        if mask is not None and not mask[action]:
            return f"action {action} is not allowed now"
        return None

    def _illegal(self, problems: Mapping[str, str]):
        """End the game: every offender (several in one simultaneous step) gets `illegal_reward`, the others 0."""
        self.over = True
        text = " ".join(f"Illegal move by {a} ({p})." for a, p in problems.items()) + " The game is over."
        rewards = {a: (self.illegal_reward if a in problems else 0.0) for a in self.agents}
        first = next(iter(problems))
        return ({a: [Message("user", text)] for a in self.agents}, rewards, dict.fromkeys(self.agents, True), {},
                {"illegal": first, "problem": problems[first], "offenders": dict(problems)})

    async def close(self) -> None:
        self.env.close()


class _AEC(_Base):
    async def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None):
        self.env.reset(seed=seed)
        self.over = False
        self._skip_dead()
        obs = {a: [self._system(a)] for a in self.agents}
        if not self.over:
            current = self.env.agent_selection
            obs[current].append(Message("user", self.render(current, self.env.observe(current))))
        return obs, {}

    def acting(self) -> list[str]:
        return [] if self.over else [self.env.agent_selection]

    async def step(self, actions: Mapping[str, Action]):
        agent = self.env.agent_selection
        action = self.parse(actions[agent].text)
        problem = self._legal(agent, action, self.env.observe(agent))
        if problem is not None:
            return self._illegal({agent: problem})
        move = self.describe_move(agent, action)  # before the step: notation may depend on the position
        self.env.step(action)
        rewards = {a: float(self.env.rewards.get(a, 0.0)) for a in self.agents}
        terminated = {a: bool(self.env.terminations.get(a, False)) for a in self.agents}
        truncated = {a: bool(self.env.truncations.get(a, False)) for a in self.agents}
        obs: dict[str, list[Message]] = {a: [Message("user", move)] for a in self.agents if a != agent}
        self._skip_dead()
        if not self.over:
            current = self.env.agent_selection
            obs.setdefault(current, []).append(Message("user", self.render(current, self.env.observe(current))))
        else:
            terminated = {a: terminated[a] or not truncated[a] for a in self.agents}
        return obs, rewards, terminated, truncated, {}

    def _skip_dead(self) -> None:
        """PettingZoo makes terminated agents take a `None` turn; take it for them."""
        while self.env.agents:
            current = self.env.agent_selection
            if not (self.env.terminations.get(current) or self.env.truncations.get(current)):
                return
            self.env.step(None)
        self.over = True


class _Parallel(_Base):
    async def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None):
        observations, _ = self.env.reset(seed=seed)
        self.over = not self.env.agents
        self._last = observations
        return {a: [self._system(a), Message("user", self.render(a, observations[a]))] if a in observations
                else [self._system(a)] for a in self.agents}, {}

    def acting(self) -> list[str]:
        return [] if self.over else list(self.env.agents)

    async def step(self, actions: Mapping[str, Action]):
        parsed, problems = {}, {}
        for agent, act in actions.items():
            action = self.parse(act.text)
            problem = self._legal(agent, action, self._last.get(agent))
            if problem is not None:
                problems[agent] = problem
            parsed[agent] = action
        if problems:  # simultaneous moves: every offender is penalised, not only the first in dict order
            return self._illegal(problems)
        moves = " ".join(self.describe_move(a, x) for a, x in parsed.items())  # before the step, as AEC
        observations, rewards, terminations, truncations, _ = self.env.step(parsed)
        self._last = observations
        self.over = not self.env.agents
        obs = {a: [Message("user", moves if self.over else f"{moves}\n{self.render(a, observations[a])}")]
               for a in self.agents if a in observations}
        truncated = {a: bool(truncations.get(a, False)) for a in self.agents}
        # A time limit is a truncation, as PettingZoo said: only a game over without one counts as terminated.
        terminated = {a: bool(terminations.get(a, False)) or (self.over and not truncated[a]) for a in self.agents}
        return obs, {a: float(r) for a, r in rewards.items()}, terminated, truncated, {}


def to_pettingzoo(env: MultiAgentEnv, **kwargs: Any) -> Any:
    """Any `MultiAgentEnv` as a PettingZoo AEC env with text spaces (`slime_env.integrations.pettingzoo_export`)."""
    from slime_env.integrations.pettingzoo_export import to_pettingzoo as export

    return export(env, **kwargs)
