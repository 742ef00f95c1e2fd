"""TextArena games as `MultiAgentEnv`s: `from_textarena(env, num_players=2)` (optional extra `[textarena]`).

TextArena games are text already (`ta.make("TicTacToe-v0")` and its many competitive games run offline):
each player's chat is what TextArena shows that player — its game prompt, the others' moves, the board —
and a reply is passed to `env.step(action=...)` verbatim (TextArena parses it, e.g. `[4]`, and handles
invalid moves with its own warnings and penalties). Players are agents `player_0` ... `player_{n-1}`, one
acting at a time; rewards are the ones `env.close()` gives when the game is done. An observation that
repeats the player's whole history (TextArena's full-history wrappers) is cut to what is new.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from slime_env.multi_agent import MultiAgentEnv
from slime_env.types import Action, Message

SYSTEM = "You are {agent} in a text game. Follow the game's instructions to the letter."


def from_textarena(env: Any, *, num_players: int = 2, system_prompt: str = SYSTEM) -> MultiAgentEnv:
    """A `MultiAgentEnv` over a TextArena env (see the module docstring)."""
    return _TextArena(env, num_players, system_prompt)


class _TextArena(MultiAgentEnv):
    def __init__(self, env: Any, num_players: int, system_prompt: str):
        if num_players < 1:
            raise ValueError(f"num_players must be >= 1, got {num_players}")
        self.env, self.num_players, self.system_prompt = env, num_players, system_prompt
        self.agents = tuple(f"player_{i}" for i in range(num_players))
        self.seen: dict[str, str] = {}
        self.current = ""
        self.over = False

    async def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None):
        self.env.reset(num_players=self.num_players, seed=seed)
        self.seen, self.over = {}, False
        obs = {a: [Message("system", self.system_prompt.format(agent=a))] for a in self.agents}
        agent, text = self._observe()
        obs[agent].append(Message("user", text))
        return obs, {}

    def acting(self) -> list[str]:
        return [] if self.over else [self.current]

    async def step(self, actions: Mapping[str, Action]):
        done, info = self.env.step(action=actions[self.current].text)
        if done:
            self.over = True
            rewards, game_info = self.env.close()
            rewards = {f"player_{int(pid)}": float(r) for pid, r in (rewards or {}).items()}
            reason = str((game_info or {}).get(0, {}).get("reason", "")) if isinstance(game_info, Mapping) else ""
            obs = {a: [Message("user", f"The game is over. {reason}".strip())] for a in self.agents}
            return obs, rewards, dict.fromkeys(self.agents, True), {}, {"game_info": _jsonable(game_info)}
        agent, text = self._observe()
        return {agent: [Message("user", text)]}, {}, {}, {}, {}

    def _observe(self) -> tuple[str, str]:
        pid, observation = self.env.get_observation()
        agent = f"player_{int(pid)}"
        text = observation if isinstance(observation, str) else "\n".join(
            str(part[1]) if isinstance(part, (tuple, list)) and len(part) > 1 else str(part) for part in observation)
        before = self.seen.get(agent, "")
        new = text[len(before):] if before and text.startswith(before) else text  # full-history wrappers
        self.seen[agent] = text
        self.current = agent
        return agent, new.strip() or "(your turn)"

    async def close(self) -> None:
        return None


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
