"""TextArena games as `MultiAgentEnv`s: `from_textarena(env, num_players=2)` (optional extra `[textarena]`).

TextArena games are text already (`ta.make("TicTacToe-v0")` and its many competitive games run offline):
each player's chat is what TextArena shows that player — its game prompt, the others' moves, the board —
and a reply is passed to `env.step(action=...)` verbatim (TextArena parses it, e.g. `[4]`, and handles
invalid moves with its own warnings and penalties). Players are agents `player_0` ... `player_{n-1}`, one
acting at a time; rewards are the ones `env.close()` gives when the game is done. An agent is shown only what is
new since its last turn: where a TextArena observation wrapper keeps each player's message list
(`full_observations`, e.g. the `-train` variants' messages-and-current-board wrapper, which puts the board last so
the text never extends the previous one), the new messages are taken from that list — the other players' moves,
the game's notes (an invalid move's reason included) and the latest board; otherwise an observation that repeats
the player's whole history is cut to what extends the previous one.
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
        self.counts: dict[int, int] = {}
        self.current = ""
        self.over = False
        self.messages = _message_lists(env)

    async def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None):
        self.env.reset(num_players=self.num_players, seed=seed)
        self.seen, self.counts, self.over = {}, {}, False
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
        self.current = agent
        if self.messages is not None and int(pid) in self.messages.full_observations:
            return agent, self._new_messages(int(pid)) or "(your turn)"
        text = observation if isinstance(observation, str) else "\n".join(
            str(part[1]) if isinstance(part, (tuple, list)) and len(part) > 1 else str(part) for part in observation)
        before = self.seen.get(agent, "")
        new = text[len(before):] if before and text.startswith(before) else text  # full-history wrappers
        self.seen[agent] = text
        return agent, new.strip() or "(your turn)"

    def _new_messages(self, pid: int) -> str:
        """The player's messages since its last turn, from the wrapper's list, as "[sender] message" lines: not its
        own echoed action; of the boards, only the latest."""
        history = self.messages.full_observations[pid]
        new, self.counts[pid] = history[self.counts.get(pid, 0):], len(history)
        boards = [i for i, m in enumerate(new) if _kind(m) == "GAME_BOARD"]
        out = []
        for i, message in enumerate(new):
            sender, text = message[0], str(message[1])
            if int(sender) == pid and _kind(message) == "PLAYER_ACTION":
                continue  # its own reply: already in its ledger
            if _kind(message) == "GAME_BOARD" and i != boards[-1]:
                continue
            out.append(f"[{self._name(int(sender))}] {text}")
        return "\n".join(out).strip()

    def _name(self, sender: int) -> str:
        """TextArena's own sender names (its LLM observation wrapper's): GAME, or the role / "Player N"."""
        if sender < 0:
            return "GAME"
        roles = getattr(getattr(self.env, "state", None), "role_mapping", None) or {}  # wrappers pass `state` on
        return str(roles.get(sender, f"Player {sender}"))

    async def close(self) -> None:
        return None


def _message_lists(env: Any) -> Any:
    """The wrapper in `env`'s chain that keeps every player's message list (`full_observations`), or None."""
    seen = 0
    while env is not None and seen < 16:
        if isinstance(getattr(env, "full_observations", None), dict):
            return env
        env, seen = getattr(env, "env", None), seen + 1
    return None


def _kind(message: Any) -> str:
    kind = message[2] if len(message) > 2 else None
    return getattr(kind, "name", str(kind))


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
