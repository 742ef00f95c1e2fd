"""Coding-agent CLIs as episode agents: each harness installed into the workspace's image (a cached local layer),
pointed at the agent gateway by its own base-URL setting, bounded in turns, tokens and seconds by its own settings,
its telemetry and update checks off, and scored by the task's own verifier (`HarnessEnv`, env id `Harness-v0`;
`slime-env harness run NAME TASK`).

`HARNESSES`: `claude-code` (Anthropic Messages), `codex` (OpenAI Responses), `opencode` (Chat Completions);
`mini-swe-agent` runs in-process (`slime_env.envs.workspace.mini_swe`). Imports the core, `envs.harbor`,
`envs.workspace` and `tools_sandbox`.
"""

from slime_env.envs.harness.base import Bounds, Harness, Launch, RunContext, harness_agent
from slime_env.envs.harness.claude_code import CLAUDE_CODE
from slime_env.envs.harness.codex import CODEX
from slime_env.envs.harness.opencode import OPENCODE

HARNESSES: dict[str, Harness] = {h.name: h for h in (CLAUDE_CODE, CODEX, OPENCODE)}

from slime_env.envs.harness.env import HarnessEnv, get_harness, harness_workspace  # noqa: E402

__all__ = ["HARNESSES", "Bounds", "Harness", "HarnessEnv", "Launch", "RunContext", "get_harness", "harness_agent",
           "harness_workspace"]
