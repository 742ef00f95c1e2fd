"""Task generators for the SFT / OPD tests (found by dotted path from run configs)."""

from __future__ import annotations

import random

from envs.calculator import random_task


def calculator_tasks(n: int, seed: int) -> list:
    rng = random.Random(seed)
    return [random_task(rng) for _ in range(n)]
