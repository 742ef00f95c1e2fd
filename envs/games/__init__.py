"""Multi-agent games as text (`slime_env.MultiAgentEnv`): `TicTacToeEnv` (turn-based, zero-sum, with an
optional built-in random or perfect bot in either seat), `RockPaperScissorsEnv` (simultaneous moves),
`TabooEnv` (cooperative: one agent sees the word, the other must guess it from clues) and `SplitItemsEnv`
(mixed-motive negotiation over items with private values)."""

from slime_env.envs.games.negotiation import SplitItemsEnv
from slime_env.envs.games.rps import RockPaperScissorsEnv
from slime_env.envs.games.taboo import TabooEnv
from slime_env.envs.games.tictactoe import TicTacToeEnv

__all__ = ["RockPaperScissorsEnv", "SplitItemsEnv", "TabooEnv", "TicTacToeEnv"]
