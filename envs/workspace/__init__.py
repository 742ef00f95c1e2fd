"""Agentic tasks in a per-episode workspace: `WorkspaceEnv` (`Workspace-v0`) and its tools — `bash` with state kept
between calls, the `str_replace_editor` file editor, `search`, `submit`. Harbor and SWE tasks build on it."""

from slime_env.envs.workspace.env import SYSTEM_PROMPT, TOOL_NAMES, WorkspaceEnv, make_tools

__all__ = ["SYSTEM_PROMPT", "TOOL_NAMES", "WorkspaceEnv", "make_tools"]
