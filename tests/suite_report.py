"""The suite's own measurements: per test module its tests, seconds and peak memory, and the whole run's peak.

Memory is the proportional set size (PSS, /proc/PID/smaps_rollup) summed over a process and every process under it,
sampled every 0.25 s, with the process's own exact high-water mark (VmHWM, reset per module through clear_refs) as a
floor. PSS, not RSS: the sandboxes fork from a multi-GB test process, and each fork's RSS counts the parent's pages
again until it execs, while PSS splits shared pages between their users, so the sum is memory the machine really
holds. Docker containers' processes belong to dockerd, not to the suite, and are not counted.

Each pytest process (the only one, or each xdist worker) writes `<SUITE_REPORT_DIR>/<worker>.json` at its end; the
controller prints the run's peak (all workers together) and wall time. `tests/suite_table.py` turns the files into
docs/testing.md's table."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

_PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        # The command name (field 2) may hold spaces and parentheses: the fields after its last ')' are fixed.
        ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def _memory_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    try:  # no smaps_rollup (old kernel, or the process is another user's): resident pages
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE_KB
    except OSError:
        return 0


def tree_memory_mb(root: int) -> float:
    """PSS of `root` and every process under it, in MB."""
    kids, total, todo = _children(), 0, [root]
    while todo:
        pid = todo.pop()
        total += _memory_kb(pid)
        todo.extend(kids.get(pid, ()))
    return total / 1024


def _own_hwm_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def _reset_own_hwm() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        pass


class _Sampler(threading.Thread):
    """Samples the memory of this process's tree; `peak` is the largest sample since the last `restart()`."""

    def __init__(self) -> None:
        super().__init__(daemon=True, name="suite-report-sampler")
        self.peak = self.run_peak = 0.0
        self._stop = threading.Event()

    def run(self) -> None:
        while not self._stop.wait(0.25):
            try:
                mb = tree_memory_mb(os.getpid())
            except Exception:  # /proc races; never fail the suite over a sample
                continue
            self.peak, self.run_peak = max(self.peak, mb), max(self.run_peak, mb)

    def restart(self) -> float:
        peak, self.peak = self.peak, 0.0
        return peak

    def stop(self) -> None:
        self._stop.set()


class SuiteReport:
    """Registered by conftest.py in every pytest process."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        self.is_controller = self.worker == "main"
        self.sampler = _Sampler()
        self.sampler.start()
        self.modules: dict[str, dict] = {}
        self.current: str | None = None
        self.started = time.monotonic()

    def _close_module(self) -> None:
        if self.current is None:
            return
        m = self.modules[self.current]
        m["peak_mb"] = round(max(m["peak_mb"], self.sampler.restart(), _own_hwm_mb()))
        self.current = None

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logstart(self, nodeid: str, location) -> None:
        module = nodeid.split("::", 1)[0]
        if module != self.current:
            self._close_module()
            self.sampler.restart()
            _reset_own_hwm()
            self.current = module
            self.modules.setdefault(module, {"tests": 0, "seconds": 0.0, "peak_mb": 0, "outcomes": {}})

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        module = report.nodeid.split("::", 1)[0]
        m = self.modules.setdefault(module, {"tests": 0, "seconds": 0.0, "peak_mb": 0, "outcomes": {}})
        m["seconds"] += report.duration
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            m["tests"] += 1
            m["outcomes"][report.outcome] = m["outcomes"].get(report.outcome, 0) + 1

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self._close_module()
        self.sampler.stop()
        out = os.environ.get("SUITE_REPORT_DIR")
        if not out:
            return
        Path(out).mkdir(parents=True, exist_ok=True)
        record = {"worker": self.worker, "wall_s": round(time.monotonic() - self.started, 1),
                  "run_peak_mb": round(self.sampler.run_peak),
                  "modules": {k: {**v, "seconds": round(v["seconds"], 1)} for k, v in self.modules.items()}}
        (Path(out) / f"{self.worker}.json").write_text(json.dumps(record, indent=1))

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.is_controller:
            return
        peak = max(self.sampler.run_peak, tree_memory_mb(os.getpid()))
        terminalreporter.write_line(
            f"suite: {time.monotonic() - self.started:.0f} s wall, peak memory {peak / 1024:.1f} GB "
            f"(PSS of pytest and every process under it, workers included, sampled every 0.25 s)")
