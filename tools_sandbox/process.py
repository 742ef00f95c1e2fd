"""`ProcessSandbox`: a plain subprocess with rlimits and a scrubbed environment. NOT isolation.

For trusted code and development only: the code runs as this user, sees this user's files and the
network, and a process that starts its own session can outlive the run. What it does give: a fresh
temporary work dir (removed after the run), an environment without this process's variables (no
secrets), the same memory / CPU-time / file-size / open-file limits as the other backends, a wall-clock
timeout, an output limit, and the run's process group killed when it ends. As root, each run drops to
an unprivileged uid of its own (so a fork bomb hits its process limit, not the machine's).
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile

from slime_env.tools_sandbox.base import Sandbox
from slime_env.tools_sandbox.languages import get_language
from slime_env.tools_sandbox.local_exec import (
    Slots,
    clamp_limits,
    memfd,
    nproc_limit,
    outcome_result,
    prlimit_argv,
    spawn,
)
from slime_env.tools_sandbox.types import ExecRequest, ExecResult

SLOT_UID_BASE = 62000  # as root, each slot runs as a uid of its own, leased from 62000 up (bubblewrap: 61000)
SAFE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONHASHSEED": "0"}


def default_python() -> str:
    """The interpreter sandboxed Python runs with: the system's /usr/bin/python3 when there is one (its
    start-up is ~12 ms), else this interpreter's base executable (never a virtualenv's packages)."""
    return "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys._base_executable


class ProcessSandbox(Sandbox):
    """A subprocess per run with rlimits and a scrubbed env; no isolation (see the module docstring)."""

    backend = "process"

    def __init__(self, *, python: str | None = None, pids_limit: int = 64, fsize_mb: int = 64, nofile: int = 256,
                 **kw):
        super().__init__(**kw)
        self.interpreters = {"python": python or default_python(), "sh": "/bin/sh"}
        self.pids_limit, self.fsize_mb, self.nofile = pids_limit, fsize_mb, nofile
        self._slots_free = Slots(self.max_concurrency, SLOT_UID_BASE)

    async def close(self) -> None:
        self._slots_free.close()

    async def _execute(self, request: ExecRequest) -> ExecResult:
        lang = get_language(request.language)
        work = tempfile.mkdtemp(prefix="slime_env-run-")
        stdin_fd = memfd("stdin", request.stdin.encode())
        slot, uid = self._slots_free.acquire()
        try:
            for path, data in {**request.files, lang.filename: request.code.encode()}.items():
                full = os.path.join(work, path)
                os.makedirs(os.path.dirname(full), exist_ok=True)
                with open(full, "wb") as f:
                    f.write(data)
            if uid is not None:
                for root, dirs, names in os.walk(work):
                    for name in [root, *(os.path.join(root, n) for n in dirs + names)]:
                        os.chown(name, uid, uid)
            argv = prlimit_argv(memory_mb=clamp_limits(request.memory_mb), cpu_s=math.ceil(request.timeout_s) + 1,
                                fsize_mb=self.fsize_mb, nofile=self.nofile, nproc=nproc_limit(uid, self.pids_limit))
            outcome = await spawn([*argv, *lang.argv(self.interpreters)], env={**SAFE_ENV, "HOME": work}, cwd=work,
                                  stdin_fd=stdin_fd, timeout_s=request.timeout_s,
                                  output_limit=request.output_limit_bytes, user=uid)
        finally:
            os.close(stdin_fd)
            self._slots_free.release(slot)
            shutil.rmtree(work, ignore_errors=True)
        return outcome_result(outcome, request, self.backend)
