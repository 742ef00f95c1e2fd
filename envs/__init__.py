"""envs: built-in environments (each module registers its ids through `register_all`).

Now: `Calculator-v0` (arithmetic with a calculator tool, the demo env). Planned: Search-R1 search,
code with unit tests, math with a verifier and a python tool, multi-agent examples, adapters.
Imports `slime_env` (and may use `tools_sandbox`); `slime_env` finds this package only through the
`slime_env.envs` entry point.
"""

from slime_env import register


def register_all() -> None:
    """Entry point of the `slime_env.envs` group: registers every built-in env."""
    register("Calculator-v0", "envs.calculator:CalculatorEnv",
             description="arithmetic with a calculator tool (hermes tool calls, <answer> reward)")
