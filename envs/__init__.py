"""envs: the built-in environments, one subpackage or module each.

`Calculator-v0` (`slime_env.envs.calculator`: a calculator tool), `Math-v0` / `MathTool-v0` / `ReasoningGym-v0` /
`ArithmeticRetry-v0` (`slime_env.envs.math`), `Code-v0` (`slime_env.envs.code`: unit tests in a sandbox), `Search-v0`
(`slime_env.envs.search`: Search-R1), `SearchCompute-v0` (`slime_env.envs.search.compute_env`: search + python +
calculator tools); ready-made tools for `ToolEnv`s in `slime_env.envs.tools`; multi-agent games (`slime_env.envs.games`:
`TicTacToeEnv`, `RockPaperScissorsEnv`, `TabooEnv`, `SplitItemsEnv`). Each env is declared as one `slime_env.envs` entry
point in pyproject.toml (name = env id, value = `module:Class`), so `slime_env.make(id)` imports only the env it makes.
Imports `slime_env` (and may use `tools_sandbox`); `slime_env` reaches this package only through those entry points.
The classes are importable from here too (`from envs import CodeEnv`), each on first use.
"""

from slime_env.loading import lazy_exports

_EXPORTS = {
    "CalculatorEnv": "slime_env.envs.calculator", "MathEnv": "slime_env.envs.math.env",
    "MathToolEnv": "slime_env.envs.math.tool_env", "ReasoningGymEnv": "slime_env.envs.math.reasoning_gym_env",
    "ArithmeticRetryEnv": "slime_env.envs.math.retry_env", "arithmetic_tasks": "slime_env.envs.math.retry_env",
    "CodeEnv": "slime_env.envs.code.env", "SearchEnv": "slime_env.envs.search.env",
    "SearchComputeEnv": "slime_env.envs.search.compute_env", "python_tool": "slime_env.envs.tools",
    "search_tool": "slime_env.envs.tools", "calculator_tool": "slime_env.envs.tools",
    "TicTacToeEnv": "slime_env.envs.games.tictactoe", "RockPaperScissorsEnv": "slime_env.envs.games.rps",
    "TabooEnv": "slime_env.envs.games.taboo", "SplitItemsEnv": "slime_env.envs.games.negotiation",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
