"""Workspaces: one isolated, long-lived machine per episode (a Docker container, or bubblewrap over a root file
system), with commands, files, snapshots, limits, warm pools and a reaper for what a killed run left.

`await open_workspace(spec)` starts one; `WorkspacePool` keeps warm ones per image; `reap()` removes leftovers.
"""

from slime_env.tools_sandbox.workspace.base import Workspace
from slime_env.tools_sandbox.workspace.types import FileInfo, Limits, WorkspaceError, WorkspaceSpec

__all__ = ["FileInfo", "Limits", "Workspace", "WorkspaceError", "WorkspaceSpec"]
