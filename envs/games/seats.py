"""Which seats of a game the env plays itself (bots) and which are agents: one check for every built-in game."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def split_seats(bot: Mapping[str, str] | None, seats: Sequence[str], kinds: Sequence[str],
                bot_seats: Sequence[str] | None = None) -> tuple[dict[str, str], tuple[str, ...]]:
    """(`bot` as a dict, the seats left to agents). `bot` maps at most one seat (of `bot_seats`, default any
    of `seats`) to one of `kinds`; anything else is a ValueError naming what is allowed."""
    bot = dict(bot or {})
    allowed = tuple(bot_seats or seats)
    if len(bot) > 1 or any(seat not in allowed or kind not in kinds for seat, kind in bot.items()):
        raise ValueError(f"bot must map at most one seat of {allowed} to one of {tuple(kinds)}, got {bot}")
    return bot, tuple(seat for seat in seats if seat not in bot)
