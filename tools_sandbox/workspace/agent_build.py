"""The workspace agent as a static binary: compiled from `agent.c` on first use, cached by the source's hash.

A static binary runs in any Linux image (no libc, shell or Python needed inside). It needs a C compiler and a
static libc on the host (`apt-get install -y gcc libc6-dev`); `SLIME_ENV_WORKSPACE_AGENT` names a prebuilt one.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

from slime_env.tools_sandbox.workspace.types import WorkspaceError

SOURCE = Path(__file__).with_name("agent.c")


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "slime_env" / "workspace-agent"


@lru_cache(maxsize=1)
def agent_binary() -> Path:
    """The path of the compiled agent (built now if it is not cached yet)."""
    given = os.environ.get("SLIME_ENV_WORKSPACE_AGENT")
    if given:
        if not os.access(given, os.X_OK):
            raise WorkspaceError(f"SLIME_ENV_WORKSPACE_AGENT={given} is not an executable file")
        return Path(given)
    source = SOURCE.read_bytes()
    target = cache_dir() / hashlib.sha256(source).hexdigest()[:16] / "slime-env-agent"
    if target.is_file():
        return target
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise WorkspaceError("workspaces need a C compiler to build their agent once: apt-get install -y gcc "
                             "libc6-dev (or set SLIME_ENV_WORKSPACE_AGENT to a prebuilt static agent)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / "agent"
        proc = subprocess.run([compiler, "-static", "-O2", "-o", str(out), str(SOURCE)], capture_output=True,
                              text=True)
        if proc.returncode != 0:
            raise WorkspaceError(f"building the workspace agent with {compiler} failed (a static libc is needed: "
                                 f"apt-get install -y libc6-dev): {proc.stderr.strip()[-800:]}")
        os.replace(out, target)  # atomic: concurrent builders race harmlessly
    return target
