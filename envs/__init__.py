"""envs: the built-in environments.

Now: `Calculator-v0` (arithmetic with a calculator tool, the demo env). Planned: Search-R1 search,
code with unit tests, math with a verifier and a python tool, multi-agent examples, adapters.
Each env is declared as one `slime_env.envs` entry point in pyproject.toml (name = env id, value =
`module:Class`). Imports `slime_env` (and may use `tools_sandbox`); `slime_env` reaches this package
only through those entry points.
"""
