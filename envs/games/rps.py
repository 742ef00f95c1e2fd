"""RockPaperScissors-v0: two agents move simultaneously, over `rounds` rounds (zero-sum).

Both agents act in every round; each sees its system prompt, then before each round the previous
round's moves. A move is `<move>rock|paper|scissors</move>` (the last tag counts). Each round: win
+1, loss -1, tie 0; a missing move loses the round (both missing: a tie). Rewards are per round, so a
trajectory's per-turn rewards show each round's outcome. `bot={"player_1": "random" | "rock" | "cycle"}`
lets the env play a seat itself (evaluation against a fixed opponent); that seat is then not an agent.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from typing import Any

from slime_env.envs.games.seats import split_seats

from slime_env import Action, Message, MultiAgentEnv

BEATS = {"rock": "scissors", "paper": "rock", "scissors": "paper"}
_MOVE = re.compile(r"<move>\s*(rock|paper|scissors)\s*</move>", re.IGNORECASE)
SYSTEM = ("You are playing {rounds} rounds of rock-paper-scissors against one opponent; both of you move at the "
          "same time. Each round, give your move as <move>rock</move>, <move>paper</move> or <move>scissors</move>.")


class RockPaperScissorsEnv(MultiAgentEnv):
    """Simultaneous-move rock-paper-scissors (see the module docstring)."""

    seats = ("player_0", "player_1")

    def __init__(self, *, rounds: int = 3, bot: Mapping[str, str] | None = None):
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")
        self.bot, self.agents = split_seats(bot, self.seats, ("random", "rock", "cycle"))
        self.rounds = rounds
        self._rng = random.Random()
        self.round = 0
        self.history: list[dict[str, str | None]] = []

    async def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None):
        self.round, self.history, self._rng = 0, [], random.Random(seed)
        system = SYSTEM.format(rounds=self.rounds)
        return {a: [Message("system", system), Message("user", "Round 1. Your move.")] for a in self.agents}, {}

    def acting(self) -> list[str]:
        return list(self.agents) if self.round < self.rounds else []

    async def step(self, actions: Mapping[str, Action]):
        moves = {}
        for a in self.agents:
            found = _MOVE.findall(actions[a].text)
            moves[a] = found[-1].lower() if found else None
        for seat, kind in self.bot.items():
            moves[seat] = {"rock": "rock", "cycle": ("rock", "paper", "scissors")[self.round % 3]}.get(
                kind) or self._rng.choice(tuple(BEATS))
        a, b = self.seats
        score = _score(moves[a], moves[b])
        self.history.append(moves)
        self.round += 1
        done = self.round >= self.rounds
        obs = {}
        for me, other in ((a, b), (b, a)):
            if me not in self.agents:
                continue
            line = f"Round {self.round}: you played {moves[me] or 'nothing'}, your opponent played " \
                   f"{moves[other] or 'nothing'}."
            obs[me] = [Message("user", line + ("" if done else f"\nRound {self.round + 1}. Your move."))]
        terminated = {x: done for x in self.agents}
        rewards = {x: r for x, r in ((a, score), (b, -score)) if x in self.agents}
        return obs, rewards, terminated, {}, {"history": list(self.history)}


def _score(mine: str | None, theirs: str | None) -> float:
    if mine == theirs:
        return 0.0
    if mine is None:
        return -1.0
    if theirs is None or BEATS[mine] == theirs:
        return 1.0
    return -1.0
