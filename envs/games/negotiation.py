"""SplitItems-v0: a mixed-motive negotiation: two agents split a pool of items they value differently.

The pool has `books`, `hats` and `balls` (1-3 of each); each agent has private values per item (whole
numbers, its pool is worth 10 to it) that the other never sees. Agents alternate, `a` first: a turn
is either a proposal `<propose>books=1 hats=2 balls=0</propose>` (what the proposer keeps; the rest
goes to the other) or `<accept/>` of the last proposal. An accepted deal pays each agent the value of
its share / 10; no deal after `max_proposals` proposals, or an invalid message, pays both 0.
Both can gain from a deal; each wants the items it values most. `bot={"b": "fair"}` lets the env play a
seat itself: it accepts an offer worth at least 5 to it, else keeps the items it values most (value per
item, highest first) until its share is worth at least 6; that seat is then not an agent.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Mapping
from typing import Any

from slime_env.envs.games.seats import split_seats

from slime_env import Action, Message, MultiAgentEnv

ITEMS = ("books", "hats", "balls")
_PROPOSE = re.compile(r"<propose>(.*?)</propose>", re.DOTALL)
_ACCEPT = re.compile(r"<accept\s*/?>")
SYSTEM = ("You negotiate how to split a pool of items with another person. Pool: {pool}. Your values per item: "
          "{values} (the whole pool is worth 10 to you); the other person values items differently and does not "
          "know your values. On your turn either propose what YOU keep, like <propose>books=1 hats=0 balls=2"
          "</propose> (the rest goes to them), or accept their last proposal with <accept/>. No deal pays nothing.")


def _values(rng: random.Random, pool: dict[str, int]) -> dict[str, int]:
    """Whole-number values per item with sum(count * value) == 10."""
    while True:
        values = {k: rng.randint(0, 10) for k in ITEMS}
        if sum(pool[k] * values[k] for k in ITEMS) == 10:
            return values


class SplitItemsEnv(MultiAgentEnv):
    """Two-agent item-splitting negotiation with private values (see the module docstring)."""

    seats = ("a", "b")

    def __init__(self, *, max_proposals: int = 4, bot: Mapping[str, str] | None = None):
        if max_proposals < 1:
            raise ValueError(f"max_proposals must be >= 1, got {max_proposals}")
        self.bot, self.agents = split_seats(bot, self.seats, ("fair",))
        self.max_proposals = max_proposals
        self.pool: dict[str, int] = {}
        self.values: dict[str, dict[str, int]] = {}
        self.offer: tuple[str, dict[str, int]] | None = None  # (proposer, what the proposer keeps)
        self.proposals = 0
        self.turn = "a"
        self.over = False

    async def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None):
        rng = random.Random(seed)
        self.pool = {k: rng.randint(1, 3) for k in ITEMS}
        while 10 % math.gcd(*self.pool.values()):  # 3 of each: no whole values sum to 10
            self.pool = {k: rng.randint(1, 3) for k in ITEMS}
        self.values = {a: _values(rng, self.pool) for a in self.seats}
        self.offer, self.proposals, self.turn, self.over = None, 0, "a", False
        pool = ", ".join(f"{n} {k}" for k, n in self.pool.items())
        obs = {a: [Message("system", SYSTEM.format(pool=pool, values=", ".join(
            f"{k}={v}" for k, v in self.values[a].items())))] for a in self.agents}
        info = {"pool": dict(self.pool), "values": {a: dict(v) for a, v in self.values.items()}}
        if "a" in self.bot:  # the bot opens; the agent's first view is its proposal
            result = await self.step({"a": Action(text=self._bot_reply("a"))})
            for agent, messages in result[0].items():
                obs[agent] += messages
            return obs, info
        obs["a"].append(Message("user", "You start: make a proposal."))
        return obs, info

    def acting(self) -> list[str]:
        return [] if self.over else [self.turn]

    async def step(self, actions: Mapping[str, Action]):
        result = self._move(actions[self.turn].text)
        if self.bot and not self.over and self.turn in self.bot:  # the bot answers at once
            shown = result[0]
            result = self._move(self._bot_reply(self.turn))
            for agent, messages in shown.items():
                result[0][agent] = messages + result[0].get(agent, [])
        return result

    def _bot_reply(self, seat: str) -> str:
        values = self.values[seat]
        if self.offer is not None and self.offer[0] != seat:
            mine = {k: self.pool[k] - self.offer[1][k] for k in ITEMS}
            if sum(mine[k] * values[k] for k in ITEMS) >= 5:
                return "<accept/>"
        keep, worth = dict.fromkeys(ITEMS, 0), 0
        for k in sorted(ITEMS, key=lambda item: -values[item]):
            while keep[k] < self.pool[k] and worth < 6:
                keep[k] += 1
                worth += values[k]
        return "<propose>" + " ".join(f"{k}={n}" for k, n in keep.items()) + "</propose>"

    def _move(self, text: str):
        me = self.turn
        other = "b" if me == "a" else "a"
        if _ACCEPT.search(text) and self.offer is not None and self.offer[0] == other:
            keeps = self.offer[1]
            share = {other: keeps, me: {k: self.pool[k] - keeps[k] for k in ITEMS}}
            rewards = {a: sum(share[a][k] * self.values[a][k] for k in ITEMS) / 10 for a in self.seats}
            return self._end(rewards, f"Deal: {me} accepted. {other} gets {_fmt(keeps)}; {me} gets {_fmt(share[me])}.",
                             deal=share)
        keeps = _parse(text, self.pool)
        if keeps is None:
            return self._end({a: 0.0 for a in self.seats}, f"{me} sent no valid proposal or acceptance: no deal.")
        self.offer, self.proposals = (me, keeps), self.proposals + 1
        if self.proposals > self.max_proposals:
            return self._end({a: 0.0 for a in self.seats}, "Too many proposals: no deal.")
        gives = {k: self.pool[k] - keeps[k] for k in ITEMS}
        self.turn = other
        if other not in self.agents:
            return {}, {}, {}, {}, self._info()
        return {other: [Message("user", f"They propose to keep {_fmt(keeps)}, giving you {_fmt(gives)}. "
                                        f"Accept with <accept/> or make a proposal.")]}, {}, {}, {}, self._info()

    def _end(self, rewards: dict[str, float], text: str, deal: dict[str, dict[str, int]] | None = None):
        self.over = True
        obs = {a: [Message("user", text)] for a in self.agents}
        rewards = {a: r for a, r in rewards.items() if a in self.agents}
        return obs, rewards, {a: True for a in self.agents}, {}, {**self._info(), "deal": deal}

    def _info(self) -> dict[str, Any]:
        return {"pool": dict(self.pool), "proposals": self.proposals}


def _parse(text: str, pool: dict[str, int]) -> dict[str, int] | None:
    found = _PROPOSE.findall(text)
    if not found:
        return None
    keeps = {k: int(n) for k, n in re.findall(r"(books|hats|balls)\s*=\s*(\d+)", found[-1])}
    if set(keeps) != set(ITEMS) or any(keeps[k] > pool[k] for k in ITEMS):
        return None
    return keeps


def _fmt(share: dict[str, int]) -> str:
    return ", ".join(f"{n} {k}" for k, n in share.items())
