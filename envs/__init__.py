"""envs: the built-in environments, one subpackage or module each.

`Calculator-v0` (`envs.calculator`: a calculator tool), `Math-v0` / `MathTool-v0` / `ReasoningGym-v0` /
`ArithmeticRetry-v0` (`envs.math`), `Code-v0` (`envs.code`: unit tests in a sandbox), `Search-v0`
(`envs.search`: Search-R1), `SearchCompute-v0` (`envs.search.compute_env`: search + python + calculator
tools); ready-made tools for `ToolEnv`s in `envs.tools`; multi-agent games (`envs.games`: `TicTacToeEnv`, `RockPaperScissorsEnv`, `TabooEnv`,
`SplitItemsEnv`). Each env is declared as one `slime_env.envs` entry point in pyproject.toml
(name = env id, value = `module:Class`), so `slime_env.make(id)` imports only the env it makes. Imports
`slime_env` (and may use `tools_sandbox`); `slime_env` reaches this package only through those entry points.
The classes are importable from here too (`from envs import CodeEnv`), each on first use.
"""

from slime_env.loading import lazy_exports

_EXPORTS = {
    "CalculatorEnv": "envs.calculator", "MathEnv": "envs.math.env", "MathToolEnv": "envs.math.tool_env",
    "ReasoningGymEnv": "envs.math.reasoning_gym_env", "ArithmeticRetryEnv": "envs.math.retry_env",
    "arithmetic_tasks": "envs.math.retry_env", "CodeEnv": "envs.code.env", "SearchEnv": "envs.search.env",
    "SearchComputeEnv": "envs.search.compute_env", "python_tool": "envs.tools", "search_tool": "envs.tools",
    "calculator_tool": "envs.tools",
    "TicTacToeEnv": "envs.games.tictactoe", "RockPaperScissorsEnv": "envs.games.rps",
    "TabooEnv": "envs.games.taboo", "SplitItemsEnv": "envs.games.negotiation",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports("envs", _EXPORTS)
