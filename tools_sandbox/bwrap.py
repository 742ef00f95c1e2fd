"""`BwrapSandbox`: one bubblewrap sandbox per run, with rlimits and, where the host allows, a cgroup.

Each run gets fresh namespaces (`--unshare-all`: no network, own pid/ipc/uts/user namespaces, nested
user namespaces disabled), a read-only view of the system directories and of the interpreter's prefix
and nothing else of the host (no /etc, no /home, no checkout), a private size-limited tmpfs for /work
(where the code and its files are written from memory) and /tmp, a cleared environment, and
`--die-with-parent`. When the main process exits the pid namespace is torn down, so nothing it started
survives. Limits: address space, CPU time, file size and open files through rlimits; as root, a
per-run cgroup adds a hard memory limit, a process-count limit and OOM detection, and each concurrent
slot runs under its own unprivileged uid.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import shutil
import subprocess
import sys

from slime_env.tools_sandbox.base import Sandbox
from slime_env.tools_sandbox.cgroups import CgroupParent, RunCgroup, join_cgroup
from slime_env.tools_sandbox.languages import get_language
from slime_env.tools_sandbox.local_exec import (Slots, clamp_limits, decode, memfd, nproc_limit, outcome_result,
                                      prlimit_argv, spawn)
from slime_env.tools_sandbox.process import SAFE_ENV, default_python
from slime_env.tools_sandbox.types import ExecRequest, ExecResult, SandboxError

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/localtime")
SLOT_UID_BASE = 61000  # as root: each slot runs as a uid of its own, leased from 61000 up (local_exec.Slots)


class BwrapSandbox(Sandbox):
    """bubblewrap per run (~12 ms of overhead); see the module docstring for what is isolated.

    `fork_server=True`: one long-lived bubblewrap sandbox per slot whose pre-started interpreter forks a
    fresh child per run (`slime_env.tools_sandbox.bwrap_server`): the same isolation between runs, a few ms a run.

    `python` is the interpreter inside (default: /usr/bin/python3, else this one's base executable); its
    site-packages are hidden unless `host_packages=True`; `ro_binds` adds host paths visible read-only
    (e.g. a virtualenv with numpy, run with `python=` its interpreter); `pids_limit`,
    `fsize_mb`, `tmpfs_mb` and `nofile` are the per-run limits; `use_cgroups=None` uses them when available.
    """

    backend = "bwrap"

    def __init__(self, *, python: str | None = None, ro_binds: tuple[str, ...] = (), host_packages: bool = False,
                 pids_limit: int = 64, fsize_mb: int = 64, tmpfs_mb: int = 64, nofile: int = 256,
                 use_cgroups: bool | None = None, bwrap: str = "bwrap", fork_server: bool = False, **kw):
        super().__init__(**kw)
        self.bwrap = shutil.which(bwrap)
        if self.bwrap is None:
            raise SandboxError(f"bubblewrap ({bwrap!r}) is not installed: apt-get install -y bubblewrap")
        python = python or default_python()
        self.interpreters = {"python": python, "sh": "/bin/sh"}
        self.pids_limit, self.fsize_mb, self.tmpfs_mb, self.nofile = pids_limit, fsize_mb, tmpfs_mb, nofile
        self.root = os.geteuid() == 0
        self.cgroups: CgroupParent | None = None
        if use_cgroups or use_cgroups is None:
            self.cgroups = CgroupParent.detect() if self.root else None
            if use_cgroups and self.cgroups is None:
                raise SandboxError("use_cgroups=True but no writable cgroup hierarchy with memory and pids")
        self._slots_free = Slots(self.max_concurrency, SLOT_UID_BASE)
        if self.cgroups is not None:
            atexit.register(self.cgroups.remove)
        self._mounts = self._mount_args(python, ro_binds)
        if not host_packages:  # the interpreter's site-packages stay hidden: only the standard library
            for path in _site_dirs(python):
                self._mounts += ["--tmpfs", path, "--remount-ro", path]
        self._fork = None
        if fork_server:
            from slime_env.tools_sandbox.bwrap_server import ForkServers

            self._fork = ForkServers(self)

    def describe(self) -> str:
        extra = "cgroups" if self.cgroups else "rlimits only"
        mode = ", fork server" if self._fork is not None else ""
        return f"bwrap sandbox ({extra}{mode}, python {self.interpreters['python']})"

    async def close(self) -> None:
        if self._fork is not None:
            await self._fork.close()
        self._slots_free.close()

    @staticmethod
    def _mount_args(python: str, ro_binds: tuple[str, ...]) -> list[str]:
        args: list[str] = []
        for d in SYSTEM_DIRS:
            if os.path.islink(d):
                args += ["--symlink", os.readlink(d), d]  # merged-/usr systems: /bin -> usr/bin
            elif os.path.isdir(d):
                args += ["--ro-bind", d, d]
        for f in SYSTEM_FILES:
            if os.path.exists(f):
                args += ["--ro-bind", f, f]
        prefix = os.path.dirname(os.path.dirname(os.path.realpath(python)))  # <prefix>/bin/python3
        extra = [p for p in (prefix, *ro_binds) if not any(p == d or p.startswith(d + "/") for d in SYSTEM_DIRS)]
        for path in dict.fromkeys(extra):
            args += ["--ro-bind", path, path]
        if os.path.realpath(python) != python and not python.startswith(tuple(SYSTEM_DIRS)):
            args += ["--ro-bind", os.path.dirname(python), os.path.dirname(python)]
        return args

    async def _execute(self, request: ExecRequest) -> ExecResult:
        if self._fork is not None:
            slot, slot_uid = self._slots_free.acquire()
            try:
                return await self._fork.execute(request, slot, slot_uid)
            finally:
                self._slots_free.release(slot)
        lang = get_language(request.language)
        slot, slot_uid = self._slots_free.acquire()
        fds: list[int] = []
        cgroup: RunCgroup | None = None
        try:
            files = {**request.files, lang.filename: request.code.encode()}
            file_args: list[str] = []
            for d in sorted({os.path.dirname(p) for p in files if "/" in p}):
                parts = d.split("/")
                for i in range(1, len(parts) + 1):
                    file_args += ["--dir", "/work/" + "/".join(parts[:i])]
            for path, data in files.items():
                fd = memfd("file", data)
                fds.append(fd)
                file_args += ["--perms", "0644", "--file", str(fd), f"/work/{path}"]
            stdin_fd = memfd("stdin", request.stdin.encode())
            fds.append(stdin_fd)
            env_args = ["--clearenv"]
            for k, v in {**SAFE_ENV, "HOME": "/work"}.items():
                env_args += ["--setenv", k, v]
            size = str(self.tmpfs_mb << 20)
            control: list[str] = []
            after_start = None
            if self.cgroups is not None:
                cgroup = self.cgroups.slot(slot, self.pids_limit)
                oom_before = cgroup.prepare(request.memory_mb << 20)
                info_r, info_w = os.pipe()
                block_r, block_w = os.pipe()
                fds += [info_r, info_w, block_r, block_w]
                control = ["--info-fd", str(info_w), "--block-fd", str(block_r)]
                after_start = join_cgroup(cgroup, fds, info_r, info_w, block_r, block_w)
                child_fds = [fd for fd in fds if fd not in (stdin_fd, info_r, block_w)]
            else:
                child_fds = [fd for fd in fds if fd != stdin_fd]
            # With a cgroup the hard memory limit is the cgroup's; the address-space rlimit only stops
            # absurd mappings (virtual size runs well above resident memory).
            as_mb = request.memory_mb * 2 + 256 if cgroup else request.memory_mb
            limits = prlimit_argv(memory_mb=clamp_limits(as_mb), cpu_s=math.ceil(request.timeout_s) + 1,
                                  fsize_mb=self.fsize_mb, nofile=self.nofile,
                                  nproc=None if cgroup else nproc_limit(slot_uid, self.pids_limit))
            argv = [*limits, self.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
                    "--new-session", "--as-pid-1", "--hostname", "sandbox", *env_args, *self._mounts,
                    "--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/tmp",
                    "--size", size, "--tmpfs", "/work", *file_args, "--remount-ro", "/", "--chdir", "/work", *control,
                    "--", *lang.argv(self.interpreters)]
            outcome = await spawn(argv, env={"PATH": SAFE_ENV["PATH"]}, cwd="/", stdin_fd=stdin_fd,
                                  pass_fds=child_fds, timeout_s=request.timeout_s,
                                  output_limit=request.output_limit_bytes, user=slot_uid, after_start=after_start,
                                  kill_tree=cgroup.kill if cgroup else None)
            oom = cgroup.oom_kills() > oom_before if cgroup else False
        finally:
            for fd in fds:
                _close(fd)
            self._slots_free.release(slot)
        stderr = decode(outcome.stderr)
        if outcome.exit_code not in (0, None) and stderr.startswith("bwrap:") and not outcome.stdout:
            return self._result("sandbox_error", exit_code=outcome.exit_code, stderr=stderr,
                                duration_s=outcome.duration_s, reason=f"bubblewrap failed: {stderr.strip()[:300]}")
        return outcome_result(outcome, request, self.backend, oom=oom)


def _site_dirs(python: str) -> list[str]:
    """The interpreter's site-packages directories that exist (asked once, from the interpreter itself)."""
    code = "import json, site, sysconfig; print(json.dumps(site.getsitepackages() + [sysconfig.get_path('purelib')]))"
    try:
        out = subprocess.run([python, "-E", "-s", "-c", code], capture_output=True, text=True, timeout=30).stdout
        dirs = json.loads(out)
    except (OSError, ValueError, subprocess.SubprocessError):
        return []
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


if sys.platform != "linux":  # pragma: no cover
    raise ImportError("slime_env.tools_sandbox.bwrap needs Linux")
