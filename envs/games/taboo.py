"""Taboo-v0: a cooperative two-agent game: the `describer` sees a secret word, the `guesser` must find it.

Turn-based: the describer writes a clue (it must not contain the word: a clue that does ends the game
with reward 0), the guesser answers `<guess>word</guess>`; a wrong guess is shown to both and the
describer gives another clue, up to `rounds` guesses. Both agents get the same reward: 1 when the
guesser finds the word (case-insensitive), else 0. The guesser never sees the word: only the clues.
`bot={"describer": "letters"}` lets the env describe (its clue k gives the length and the first k
letters), for evaluating a guesser alone; the describer is then not an agent.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from typing import Any

from slime_env.envs.games.seats import split_seats

from slime_env import Action, Message, MultiAgentEnv, Task

WORDS = ("apple", "river", "guitar", "winter", "rocket", "pillow", "candle", "tiger", "bridge", "coffee",
         "mirror", "island", "ladder", "violin", "desert", "garden", "pencil", "thunder", "camera", "forest")
_GUESS = re.compile(r"<guess>\s*([A-Za-z]+)\s*</guess>")
DESCRIBER = ("You play a word game with a partner. The secret word is \"{word}\". Give your partner a one-line clue "
             "so that they can guess it. Never write the secret word itself.")
GUESSER = ("You play a word game with a partner who knows a secret word and gives you clues. Guess the word and "
           "reply like this: <guess>word</guess>")


class TabooEnv(MultiAgentEnv):
    """Cooperative clue-and-guess (see the module docstring)."""

    seats = ("describer", "guesser")

    def __init__(self, *, rounds: int = 3, words: tuple[str, ...] = WORDS, bot: Mapping[str, str] | None = None):
        if rounds < 1 or not words:
            raise ValueError("rounds must be >= 1 and words non-empty")
        self.bot, self.agents = split_seats(bot, self.seats, ("letters",), bot_seats=("describer",))
        self.rounds, self.words = rounds, tuple(w.lower() for w in words)
        self.word = ""
        self.guesses: list[str] = []
        self.turn = "describer"
        self.over = False

    async def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None):
        task = (options or {}).get("task")
        label = getattr(task, "label", None)
        self.word = str(label).lower() if isinstance(label, str) and label else random.Random(seed).choice(self.words)
        self.guesses, self.turn, self.over = [], "describer", False
        if self.bot:
            self.turn = "guesser"
            return {"guesser": [Message("system", GUESSER), Message("user", f"Clue: {self._clue()}\nYour guess?")]}, {}
        return {"describer": [Message("system", DESCRIBER.format(word=self.word)),
                              Message("user", "Your first clue.")],
                "guesser": [Message("system", GUESSER)]}, {}

    def acting(self) -> list[str]:
        return [] if self.over else [self.turn]

    async def step(self, actions: Mapping[str, Action]):
        if self.turn == "describer":
            clue = actions["describer"].text.strip()
            if self.word in clue.lower():
                return self._end(0.0, "The clue contained the secret word: the game is lost.")
            self.turn = "guesser"
            return {"guesser": [Message("user", f"Clue: {clue}\nYour guess?")]}, {}, {}, {}, self._info()
        found = _GUESS.findall(actions["guesser"].text)
        guess = found[-1].lower() if found else ""
        self.guesses.append(guess)
        if guess == self.word:
            return self._end(1.0, f"Correct: the word was {self.word}.")
        if len(self.guesses) >= self.rounds:
            return self._end(0.0, f"Out of guesses: the word was {self.word}.")
        if self.bot:
            return {"guesser": [Message("user", f"Wrong. Clue: {self._clue()}\nYour guess?")]}, {}, {}, {}, self._info()
        self.turn = "describer"
        said = f"Your partner guessed {guess!r}: wrong." if guess else "Your partner gave no <guess>."
        return {"describer": [Message("user", f"{said} Another clue.")],
                "guesser": [Message("user", "Wrong. Wait for the next clue.")]}, {}, {}, {}, self._info()

    def _clue(self) -> str:
        shown = self.word[:len(self.guesses) + 1]
        return f"The word has {len(self.word)} letters and starts with {shown!r}."

    def _end(self, reward: float, text: str):
        self.over = True
        obs = {a: [Message("user", text)] for a in self.agents}
        return obs, {a: reward for a in self.agents}, {a: True for a in self.agents}, {}, {
            **self._info(), "solved": reward > 0}

    def _info(self) -> dict[str, Any]:
        return {"word": self.word, "guesses": list(self.guesses)}


def word_tasks(size: int = 64, seed: int = 0) -> list[Task]:
    """`size` tasks, each naming its secret word (the label)."""
    rng = random.Random(seed)
    return [Task(prompt="taboo", label=rng.choice(WORDS), id=f"taboo-{seed}-{i}") for i in range(size)]
