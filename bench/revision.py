"""Run a measurement with an older revision's code: a git worktree of REV, a subprocess on it, JSON back.

The benches' `--compare-rev REV` rows use it, so the old path is measured on the same machine in the same run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def run_at_revision(rev: str, code: str) -> Any:
    """Run the Python program `code` in a worktree of `rev` (its packages first on the path, then this bench
    folder); the last line it prints, parsed as JSON."""
    root = HERE.parent
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", str(tree), rev], check=True,
                       capture_output=True)
        try:
            program = f"import sys; sys.path[:0] = [{str(tree)!r}, {str(HERE)!r}]\n" + code
            out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True,
                                 cwd=str(tree), env={**os.environ, "PYTHONPATH": str(tree)})
            return json.loads(out.stdout.strip().splitlines()[-1])
        finally:
            subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(tree)],
                           capture_output=True, check=False)
