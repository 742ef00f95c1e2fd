"""The suite's own measurements: per test module its tests, seconds and peak memory, and the whole run's peak.

Memory is the resident size (RSS) summed over the pytest process and every process under it (servers, trainer ranks,
sandboxes; xdist's workers and theirs), sampled every 0.5 s, with the process's own exact high-water mark (VmHWM, reset
per module through clear_refs) as a floor. The sum is an upper bound of what the machine holds: pages two processes
share (the libraries torch and its peers map into each) count once per process. PSS would split them, but reading
it walks every page of a multi-GB process (40 ms for 3 GB), a tenth of a core at this rate. Docker containers'
processes belong to dockerd, not to the suite, and are not counted there; the controller also samples the machine's
memory in use (MemTotal - MemAvailable: every page once, containers and tmpfs included) and prints its peak over the
level before the run.

Per test, the tree's peak while the test ran (setup to teardown, the samples of its window) is kept for tests that
reach `PEAK_KEPT_MB`: docs/testing.md lists the largest (where the run's memory goes).

`busy_s` is the CPU time the whole machine spent while a module ran (all cores, whoever used them): beside the
module's seconds it says how many cores the module kept busy, i.e. how much a second worker could overlap with it.

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
PEAK_KEPT_MB = 2000  # a test's own peak is kept from here up


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


def _rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE_KB
    except OSError:  # gone meanwhile
        return 0


def process_tree(root: int) -> set[int]:
    """`root` and every process under it."""
    kids, tree, todo = _children(), set(), [root]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo.extend(kids.get(pid, ()))
    return tree


def tree_memory_mb(root: int) -> float:
    """Resident size of `root` and every process under it, summed, in MB."""
    return sum(_rss_kb(pid) for pid in process_tree(root)) / 1024


def machine_used_mb() -> float:
    """Memory the whole machine uses (MemTotal - MemAvailable, /proc/meminfo), in MB: every page once, shared or not,
    docker's containers and tmpfs files included; page cache that could be dropped is not counted."""
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0])
    return (info["MemTotal"] - info["MemAvailable"]) / 1024


def _machine_busy_s() -> float:
    """Seconds the machine's CPUs have been busy since boot, all cores together (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


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
        self.peak = self.run_peak = self.test_peak = 0.0
        self.machine_base = self.machine_peak = machine_used_mb()
        self._stop = threading.Event()

    def run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                mb = tree_memory_mb(os.getpid())
            except Exception:  # /proc races; never fail the suite over a sample
                continue
            self.peak, self.run_peak = max(self.peak, mb), max(self.run_peak, mb)
            self.test_peak = max(self.test_peak, mb)
            self.machine_peak = max(self.machine_peak, machine_used_mb())

    def restart(self) -> float:
        peak, self.peak = self.peak, 0.0
        return peak

    def restart_test(self) -> float:
        peak, self.test_peak = self.test_peak, 0.0
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
        self.tests: dict[str, float] = {}  # test id -> its setup, call and teardown seconds
        self.test_peaks: dict[str, float] = {}  # test id -> peak of the tree while it ran (tests over PEAK_KEPT_MB)
        self.current: str | None = None
        self.started = time.monotonic()

    def _close_module(self) -> None:
        if self.current is None:
            return
        m = self.modules[self.current]
        m["peak_mb"] = round(max(m["peak_mb"], self.sampler.restart(), _own_hwm_mb()))
        m["busy_s"] = round(m.get("busy_s", 0.0) + _machine_busy_s() - self.busy_at_start, 1)
        self.current = None

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logstart(self, nodeid: str, location) -> None:
        module = nodeid.split("::", 1)[0]
        if module != self.current:
            self._close_module()
            self.sampler.restart()
            _reset_own_hwm()
            self.current = module
            self.busy_at_start = _machine_busy_s()
            self.modules.setdefault(module, {"tests": 0, "seconds": 0.0, "peak_mb": 0, "outcomes": {}})
        self.sampler.restart_test()

    def pytest_runtest_logfinish(self, nodeid: str, location) -> None:
        peak = self.sampler.restart_test()
        if peak >= PEAK_KEPT_MB:
            self.test_peaks[nodeid] = max(peak, self.test_peaks.get(nodeid, 0.0))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        module = report.nodeid.split("::", 1)[0]
        m = self.modules.setdefault(module, {"tests": 0, "seconds": 0.0, "peak_mb": 0, "outcomes": {}})
        m["seconds"] += report.duration
        self.tests[report.nodeid] = self.tests.get(report.nodeid, 0.0) + report.duration
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
                  "machine_peak_mb": round(self.sampler.machine_peak - self.sampler.machine_base),
                  "modules": {k: {**v, "seconds": round(v["seconds"], 1)} for k, v in self.modules.items()},
                  "tests": {k: round(v, 2) for k, v in self.tests.items()},
                  "test_peaks": {k: round(v) for k, v in self.test_peaks.items()}}
        (Path(out) / f"{self.worker}.json").write_text(json.dumps(record, indent=1))

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.is_controller:
            return
        peak = max(self.sampler.run_peak, tree_memory_mb(os.getpid()))
        machine = self.sampler.machine_peak - self.sampler.machine_base
        terminalreporter.write_line(
            f"suite: {time.monotonic() - self.started:.0f} s wall, peak RSS {peak / 1024:.1f} GB (pytest and every "
            f"process under it, workers included, summed), the machine's memory in use at most {machine / 1024:.1f} "
            f"GB over what it used before the run (containers included); sampled every 0.5 s")
