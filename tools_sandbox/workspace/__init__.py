"""Workspaces: one isolated, long-lived machine per episode (a Docker container, or bubblewrap over a root file
system), with commands, files, diffs, snapshots, limits, warm pools and a reaper for what a killed run left.

`await open_workspace(spec)` starts one; `WorkspacePool` keeps warm ones per spec; `reap()` removes leftovers;
`build_image(context, tag)` builds a Dockerfile (public bases made locally by `ensure_base_image` when missing).
The contract is `Workspace`'s docstring. Imports the core and `tools_sandbox`; nothing imports it but envs and CLIs.
"""

from slime_env.loading import lazy_exports
from slime_env.tools_sandbox.workspace.base import Workspace
from slime_env.tools_sandbox.workspace.types import FileInfo, Limits, WorkspaceError, WorkspaceSpec

_EXPORTS = {"open_workspace": "slime_env.tools_sandbox.workspace.open",
            "WorkspacePool": "slime_env.tools_sandbox.workspace.pool",
            "shared_pool": "slime_env.tools_sandbox.workspace.pool",
            "reap": "slime_env.tools_sandbox.workspace.docker",
            "build_image": "slime_env.tools_sandbox.workspace.images",
            "ensure_base_image": "slime_env.tools_sandbox.workspace.base_images",
            "DiffError": "slime_env.tools_sandbox.workspace.diffs"}
__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = ["DiffError", "FileInfo", "Limits", "Workspace", "WorkspaceError", "WorkspacePool", "WorkspaceSpec",
           "build_image", "ensure_base_image", "open_workspace", "reap", "shared_pool"]
