"""TicTacToe-v0: tic-tac-toe as a two-agent text game (turn-based, zero-sum): seats `x` and `o`, `x` moves first.

Each agent sees its own chat: a system prompt naming its mark, then the board before each of its turns
(which shows the opponent's last move). A move is a cell number 1-9 in `<move>N</move>`; the last such
tag of the reply counts (`move_format="tag_or_digit"` also takes the reply's last digit 1-9 when it
has no tag, for small models still learning the format). Rewards: win +1, loss -1, draw 0 for both. An illegal or
missing move ends the game: the offender gets `illegal_reward` (default -1) and the opponent its negation, so rewards
always sum to zero. `system_prompt` replaces the default ("{mark}" becomes X or O). `bot={"o": "random" | "perfect"}`
lets the env play a seat itself (for evaluation against a fixed opponent): that seat is then not an agent. `info` has
the winner and the move list.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from typing import Any

from slime_env.envs.games.seats import split_seats

from slime_env import Action, Message, MultiAgentEnv, Task

LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))
_MOVE = re.compile(r"<move>\s*([1-9])\s*</move>")
_DIGIT = re.compile(r"[1-9]")
SYSTEM = ("You are {mark} in tic-tac-toe. Cells are numbered 1-9, left to right, top to bottom. Pick a free cell. "
          "Reply like this: <move>5</move>")


def play_tasks(size: int = 64) -> list[Task]:
    """`size` game tasks for the rollout manager and the train loop (the board starts empty: a game needs no
    data; each task is one group of games, the seed of each game varies the bots' moves)."""
    return [Task(prompt="tic-tac-toe", id=f"tictactoe-{i}") for i in range(size)]


def winner(board: list[str]) -> str | None:
    for a, b, c in LINES:
        if board[a] != "." and board[a] == board[b] == board[c]:
            return board[a]
    return None


def render(board: list[str]) -> str:
    cells = [board[i] if board[i] != "." else str(i + 1) for i in range(9)]
    return "\n".join(" ".join(cells[r * 3:r * 3 + 3]) for r in range(3))


def best_move(board: list[str], mark: str) -> int:
    """A perfect player's move (minimax; the board is small)."""
    other = "o" if mark == "x" else "x"

    def score(b: list[str], turn: str) -> int:
        w = winner(b)
        if w:
            return 1 if w == mark else -1
        free = [i for i in range(9) if b[i] == "."]
        if not free:
            return 0
        results = []
        for i in free:
            b[i] = turn
            results.append(score(b, other if turn == mark else mark))
            b[i] = "."
        return max(results) if turn == mark else min(results)

    free = [i for i in range(9) if board[i] == "."]
    values = []
    for i in free:
        board[i] = mark
        values.append(score(board, other))
        board[i] = "."
    return free[values.index(max(values))]


class TicTacToeEnv(MultiAgentEnv):
    """Tic-tac-toe for two agents, or one agent against a built-in bot (see the module docstring)."""

    roles = {"x": "x", "o": "o"}

    def __init__(self, *, bot: Mapping[str, str] | None = None, illegal_reward: float = -1.0,
                 move_format: str = "tag", system_prompt: str | None = None):
        self.bot, self.agents = split_seats(bot, ("x", "o"), ("random", "perfect"))
        if move_format not in ("tag", "tag_or_digit"):
            raise ValueError(f"move_format must be 'tag' or 'tag_or_digit', got {move_format!r}")
        self.illegal_reward, self.move_format = illegal_reward, move_format
        self.system_prompt = system_prompt if system_prompt is not None else SYSTEM  # "{mark}": X or O
        self._rng = random.Random()
        self.board: list[str] = ["."] * 9
        self.turn = "x"
        self.moves: list[tuple[str, int]] = []
        self.over = False

    async def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None):
        self._rng = random.Random(seed)
        self.board, self.turn, self.moves, self.over = ["."] * 9, "x", [], False
        if "x" in self.bot:
            self._bot_move()
        system = {a: Message("system", self.system_prompt.format(mark=a.upper())) for a in self.agents}
        obs = {a: [system[a], Message("user", self._prompt(a))] if a == self.turn else [system[a]] for a in self.agents}
        return obs, {"moves": []}

    def acting(self) -> list[str]:
        return [] if self.over else [self.turn]

    async def step(self, actions: Mapping[str, Action]):
        mover = self.turn
        text = actions[mover].text
        found = _MOVE.findall(text) or (_DIGIT.findall(text) if self.move_format == "tag_or_digit" else [])
        cell = int(found[-1]) - 1 if found else None
        if cell is None or self.board[cell] != ".":
            problem = "no <move>N</move> found" if cell is None else f"cell {cell + 1} is taken"
            return self._end(None, mover, f"Illegal move by {mover.upper()} ({problem}).", illegal=True)
        self._play(mover, cell)
        if self._finished():
            return self._result()
        if self.bot:
            self._bot_move()
            if self._finished():
                return self._result()
        return {self.turn: [Message("user", self._prompt(self.turn))]}, {}, {}, {}, self._info()

    def _play(self, mark: str, cell: int) -> None:
        self.board[cell] = mark
        self.moves.append((mark, cell + 1))
        self.turn = "o" if mark == "x" else "x"

    def _bot_move(self) -> None:
        mark = self.turn
        free = [i for i in range(9) if self.board[i] == "."]
        self._play(mark, best_move(self.board, mark) if self.bot[mark] == "perfect" else self._rng.choice(free))

    def _finished(self) -> bool:
        return winner(self.board) is not None or "." not in self.board

    def _result(self):
        w = winner(self.board)
        loser = None if w is None else ("o" if w == "x" else "x")
        text = "Draw." if w is None else f"{w.upper()} wins."
        return self._end(w, loser, text, reward=1.0)

    def _end(self, won: str | None, lost: str | None, text: str, reward: float | None = None, illegal: bool = False):
        self.over = True
        value = -self.illegal_reward if reward is None else reward  # what the other side gets
        rewards = {}
        if lost is not None:
            rewards = {lost: -value, ("o" if lost == "x" else "x"): value}
        rewards = {a: r for a, r in rewards.items() if a in self.agents}
        final = f"Final board:\n{render(self.board)}\n{text}"
        obs = {a: [Message("user", final)] for a in self.agents}
        done = {a: True for a in self.agents}
        return obs, rewards, done, {}, {**self._info(), "winner": won, "loser": lost, "illegal": illegal}

    def _prompt(self, mark: str) -> str:
        last = f"{self.moves[-1][0].upper()} played {self.moves[-1][1]}.\n" if self.moves else ""
        return f"{last}Board:\n{render(self.board)}\nYou are {mark.upper()}. Your move."

    def _info(self) -> dict[str, Any]:
        return {"moves": [f"{m}{c}" for m, c in self.moves], "board": "".join(self.board)}
