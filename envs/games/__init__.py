"""Multi-agent games as text (`slime_env.MultiAgentEnv`): `TicTacToeEnv` (turn-based, zero-sum, with an
optional built-in random or perfect bot in either seat) and `RockPaperScissorsEnv` (simultaneous moves)."""

from envs.games.rps import RockPaperScissorsEnv
from envs.games.tictactoe import TicTacToeEnv

__all__ = ["RockPaperScissorsEnv", "TicTacToeEnv"]
