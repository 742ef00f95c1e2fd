"""Per-run cgroups (memory and process-count limits) for the bubblewrap backend, where the host allows.

Only root can create cgroups on a typical host (or a user to whom systemd delegated a subtree). Both
hierarchies are handled: v2 (`/sys/fs/cgroup` with `memory.max`, `pids.max`, `memory.events`) and v1
(separate `memory` and `pids` mounts). Each process gets one parent group named after its pid; groups of
processes that died (a crashed run) are removed when the next parent is created.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

from slime_env.tools_sandbox.local_exec import pid_alive

ROOT = Path("/sys/fs/cgroup")
PREFIX = "slime_env-sandbox-"


class RunCgroup:
    """The cgroup of one concurrency slot, reused run after run (creating and removing a group per run
    costs several ms). `prepare()` before a run, `add(pid)` to join it, `oom_kills()` to compare."""

    def __init__(self, dirs: dict[str, Path], v2: bool):
        self.dirs, self.v2 = dirs, v2
        self._memory: int | None = None

    def prepare(self, memory_bytes: int, *, empty: bool = True) -> int:
        """Empty the group (a previous run's stragglers; `empty=False` keeps a fork server's sandbox), set the
        memory limit; returns the OOM-kill count."""
        if empty and self.pids():
            self.kill()
        if memory_bytes != self._memory:
            mem = self.dirs["memory"]
            if self.v2:
                (mem / "memory.max").write_text(str(memory_bytes))
            else:
                # memsw >= limit must hold at every step: lower/raise in the order the kernel accepts.
                files = ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"]
                if self._memory is not None and memory_bytes > self._memory:
                    files.reverse()
                for name in files:
                    _try_write(mem / name, str(memory_bytes))
            self._memory = memory_bytes
        return self.oom_kills()

    def add(self, pid: int) -> None:
        for d in dict.fromkeys(self.dirs.values()):
            (d / "cgroup.procs").write_text(str(pid))

    def oom_kills(self) -> int:
        d = self.dirs["memory"]
        text = _read(d / ("memory.events" if self.v2 else "memory.oom_control"))
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
        return 0

    def pids(self) -> list[int]:
        out: set[int] = set()
        for d in self.dirs.values():
            out.update(int(p) for p in _read(d / "cgroup.procs").split())
        return sorted(out)

    def kill(self) -> None:
        """SIGKILL every process in the group (cgroup.kill on v2, one by one on v1)."""
        first = next(iter(self.dirs.values()))
        if self.v2 and (first / "cgroup.kill").exists():
            try:
                (first / "cgroup.kill").write_text("1")
                return
            except OSError:
                pass
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def remove(self, wait_s: float = 2.0) -> None:
        """Kill what is left and remove the group (retried while the dying processes leave it)."""
        end = time.monotonic() + wait_s
        for d in self.dirs.values():
            while True:
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > end:
                        break  # left for the stale-group sweep of a later process
                    self.kill()
                    time.sleep(0.005)


class CgroupParent:
    """This process's parent group; `create()` makes one child group per run."""

    def __init__(self, dirs: dict[str, Path], v2: bool):
        self.dirs, self.v2 = dirs, v2
        self._slots: dict[int, RunCgroup] = {}

    @classmethod
    def detect(cls) -> CgroupParent | None:
        """A usable parent group, or None (not root, read-only cgroupfs, controllers missing)."""
        try:
            if (ROOT / "cgroup.controllers").exists():
                controllers = (ROOT / "cgroup.controllers").read_text().split()
                if not {"memory", "pids"} <= set(controllers):
                    return None
                dirs = {"memory": ROOT / f"{PREFIX}{os.getpid()}"}
                _sweep(ROOT)
                dirs["memory"].mkdir(exist_ok=True)
                dirs["pids"] = dirs["memory"]
                (dirs["memory"] / "cgroup.subtree_control").write_text("+memory +pids")
                return cls(dirs, v2=True)
            if (ROOT / "memory" / "cgroup.procs").exists() and (ROOT / "pids" / "cgroup.procs").exists():
                dirs = {}
                for ctl in ("memory", "pids"):
                    _sweep(ROOT / ctl)
                    dirs[ctl] = ROOT / ctl / f"{PREFIX}{os.getpid()}"
                    dirs[ctl].mkdir(exist_ok=True)
                return cls(dirs, v2=False)
        except OSError:
            return None
        return None

    def slot(self, index: int, pids_max: int) -> RunCgroup:
        """The group of concurrency slot `index` (created on first use, with its process limit)."""
        group = self._slots.get(index)
        if group is None:
            dirs = {ctl: d / f"slot-{index}" for ctl, d in self.dirs.items()}
            for d in dict.fromkeys(dirs.values()):
                d.mkdir(exist_ok=True)
            if self.v2:
                _try_write(dirs["memory"] / "memory.swap.max", "0")  # no swap to escape into
            (dirs["pids"] / "pids.max").write_text(str(pids_max))
            group = self._slots[index] = RunCgroup(dirs, self.v2)
        return group

    def remove(self) -> None:
        """Remove the slot groups and the parent (at exit)."""
        for group in self._slots.values():
            group.remove(0.5)
        self._slots.clear()
        for d in dict.fromkeys(self.dirs.values()):
            try:
                d.rmdir()
            except OSError:
                pass


def _sweep(parent: Path) -> None:
    """Remove groups left by processes that no longer exist (a crashed run)."""
    for d in parent.glob(f"{PREFIX}*"):
        pid = d.name[len(PREFIX):]
        if pid.isdigit() and not pid_alive(int(pid)):
            for child in d.iterdir():
                if child.is_dir():
                    RunCgroup({"x": child}, v2=(parent == ROOT)).remove(0.5)
            try:
                d.rmdir()
            except OSError:
                pass


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _try_write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError:
        pass


def join_cgroup(cgroup: RunCgroup, fds: list[int], info_r: int, info_w: int, block_r: int, block_w: int):
    """After bubblewrap forks its sandbox child (reported on --info-fd), move it into the run's cgroup,
    then release it (--block-fd): the code starts inside the cgroup, with everything it forks.
    Fds closed here leave `fds` first, so the caller never closes a number the OS has reused."""

    def close(fd: int) -> None:
        fds.remove(fd)
        try:
            os.close(fd)
        except OSError:
            pass

    async def after_start(pid: int) -> None:
        close(info_w)
        close(block_r)
        data = b""
        loop = asyncio.get_running_loop()
        os.set_blocking(info_r, False)
        while True:
            ready = loop.create_future()
            loop.add_reader(info_r, ready.set_result, None)
            try:
                await ready
            finally:
                loop.remove_reader(info_r)
            try:
                chunk = os.read(info_r, 4096)
            except BlockingIOError:
                continue
            if not chunk:
                return  # bwrap failed before forking; its stderr says why
            data += chunk
            try:
                child = json.loads(data)["child-pid"]
                break
            except (ValueError, KeyError):
                continue
        cgroup.add(child)
        os.write(block_w, b"1")
        close(block_w)

    return after_start
