"""The suite's last step: nothing of ours is left once every test has run — no process, no container, volume or
network, no file or folder in the temporary directory.

The pytest process (xdist's controller when there are workers) takes a snapshot when the session starts and
compares at its end, after the workers are gone; anything new fails the run, listed by name. A process is the suite's
when it carries the run's mark in its environment (`MARK`, set before any worker or child starts, inherited by every
process they start) or runs under a sandbox slot's uid (sandboxed code gets a clean environment); the others are
someone else's (a shell of the person watching the run). Caches built on
purpose (docker images, ~/.cache/slime_env) are not leftovers. pytest's own folder (`pytest-of-USER`, which keeps
failed tests' tmp_path on purpose) is its business, not ours. `make test` asks for it (`--leftover-check`): a run
of a few selected tests may leave what their module's teardown would have removed."""

from __future__ import annotations

import getpass
import os
import shutil
import subprocess
import tempfile
import time

import pytest

from slime_env.tools_sandbox import bwrap, process
from suite_report import process_tree
from slime_env.tools_sandbox.local_exec import Slots

# Processes that outlive a run by design of the machine, not of the suite (a kernel worker, docker's daemons).
_SYSTEM = {"dockerd", "containerd", "containerd-shim", "containerd-shim-runc-v2", "docker-proxy", "kworker"}
MARK = "SLIME_ENV_SUITE_RUN"


# Where third-party libraries put their own temporary files and caches during the suite (torchinductor's kernels,
# tiktoken's encodings, Ray's session folders, Chromium's profile sockets), through each one's own setting; it goes
# with the run. Anything else new in /tmp is a leftover.
THIRD_PARTY_TMP = "SLIME_ENV_SUITE_TMP"
_THIRD_PARTY_VARS = {"TORCHINDUCTOR_CACHE_DIR": "torchinductor", "TIKTOKEN_CACHE_DIR": "tiktoken",
                     "RAY_TMPDIR": "ray"}


def mark_run() -> None:
    """Marks this process's environment, so that every process the suite starts from here on carries the mark, and
    points third-party libraries' temporary files into one folder of the run's."""
    if MARK in os.environ:  # a worker: the controller did it
        return
    os.environ[MARK] = f"{os.getpid()}-{time.time_ns()}"
    root = tempfile.mkdtemp(prefix="slime_env-suite-")
    os.environ[THIRD_PARTY_TMP] = root
    for var, name in _THIRD_PARTY_VARS.items():
        os.environ.setdefault(var, os.path.join(root, name))


def remove_third_party_tmp() -> None:
    root = os.environ.get(THIRD_PARTY_TMP)
    if root and os.path.basename(root).startswith("slime_env-suite-"):
        shutil.rmtree(root, ignore_errors=True)


def _is_ours(pid: str, uid: int) -> bool:
    if any(base <= uid < base + Slots.UID_SPAN for base in (bwrap.SLOT_UID_BASE, process.SLOT_UID_BASE)):
        return True
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{MARK}={os.environ.get(MARK)}".encode() in f.read().split(b"\0")
    except OSError:  # gone, or not ours to read
        return False


def _processes() -> dict[str, str]:
    """{'pid:start time': command line} of every user-space process of the suite's (`_is_ours`)."""
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            uid = entry.stat().st_uid
        except OSError:
            continue
        if not cmd or not _is_ours(entry.name, uid):  # a kernel thread, a zombie, someone else's
            continue
        start = stat[stat.rindex(b")") + 2:].split()[19].decode()
        out[f"{entry.name}:{start}"] = cmd
    return out


def _tmp_entries() -> list[str]:
    dirs = {tempfile.gettempdir(), "/tmp"}
    return sorted(os.path.join(d, name) for d in dirs if os.path.isdir(d) for name in os.listdir(d))


def _docker() -> dict[str, list[str]]:
    """Containers (running or not), volumes and networks, by id and name; {} where no docker engine answers."""
    out: dict[str, list[str]] = {}
    for kind, fmt in (("containers", "{{.ID}} {{.Names}} {{.Image}} {{.Status}}"), ("volumes", "{{.Name}}"),
                      ("networks", "{{.ID}} {{.Name}}")):
        cmd = ["docker", *(["ps", "-a"] if kind == "containers" else [kind[:-1], "ls"]), "--format", fmt]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return {}
        if done.returncode != 0:
            return {}
        out[kind] = sorted(line for line in done.stdout.splitlines() if line.strip())
    return out


def snapshot() -> dict:
    return {"processes": _processes(), "tmp": _tmp_entries(), "docker": _docker()}


def new_since(before: dict, *, keep_pids: set[int] = frozenset(), wait_s: float = 10.0) -> list[str]:
    """What exists now and did not at `before`, as lines naming each thing. Processes that are exiting get up to
    `wait_s` to go (a server's SIGTERM handler, a container's removal racing the last test's teardown)."""
    ours_tmp = f"pytest-of-{getpass.getuser()}"
    deadline = time.monotonic() + wait_s
    while True:
        now = snapshot()
        procs = {k: cmd for k, cmd in now["processes"].items() if k not in before["processes"]
                 and int(k.split(":")[0]) not in keep_pids and os.path.basename(cmd.split()[0]) not in _SYSTEM}
        tmp = [p for p in now["tmp"] if p not in before["tmp"] and os.path.basename(p) != ours_tmp]
        docker = {kind: [x for x in items if x not in before["docker"].get(kind, [])]
                  for kind, items in now["docker"].items()} if before["docker"] else {}
        left = ([f"process {k.split(':')[0]}: {cmd[:200]}" for k, cmd in sorted(procs.items())]
                + [f"file {p}" for p in tmp]
                + [f"docker {kind[:-1]} {x}" for kind, items in sorted(docker.items()) for x in items])
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(1.0)


class LeftoverCheck:
    """Registered by conftest.py, with --leftover-check, in the pytest process that is not an xdist worker."""

    def __init__(self) -> None:
        self.before = snapshot()
        self.before["tmp"].append(os.environ.get(THIRD_PARTY_TMP, ""))  # the run's own, removed at its end
        self.before["tmp"].append(os.environ.get("SUITE_REPORT_DIR", ""))  # the measurements asked for
        self.left: list[str] = []

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if session.config.option.collectonly or exitstatus not in (0, 1):
            return  # nothing ran, or the run was interrupted: its leftovers say nothing
        remove_third_party_tmp()
        # the pytest process and its xdist workers, still exiting
        self.left = new_since(self.before, keep_pids=process_tree(os.getpid()))
        if self.left and session.exitstatus == 0:
            session.exitstatus = 1

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.left:
            terminalreporter.section("leftovers", red=True)
            for line in self.left:
                terminalreporter.write_line(line)
            terminalreporter.write_line(f"{len(self.left)} thing(s) of the suite's were left behind (see above)")
        else:
            terminalreporter.write_line("leftovers: none (processes, containers, volumes, networks, temporary files)")
