"""A class `tests/test_rank_process.py` serves in a child process (`RankProcess`); importable there through
PYTHONPATH (this folder)."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time


class Target:
    def __init__(self):
        self.calls = 0

    def add(self, a, b=0):
        self.calls += 1
        return a + b

    async def later(self, value):
        await asyncio.sleep(0.01)
        return value, os.getpid()

    def fail(self, message):
        raise KeyError(message)

    def unpicklable(self):
        return threading.Lock()

    def say_and_wait(self, text):
        print(text, flush=True)
        sys.stderr.write("about to wait\n")
        sys.stderr.flush()
        time.sleep(600)
