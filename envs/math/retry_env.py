"""ArithmeticRetry-v0: arithmetic with feedback turns — a wrong answer is told so and may try again.

A small multi-turn env for learning checks and tutorials: each episode is one problem ("What is 47 + 8?");
the model answers (the last number of its reply by default, or `<answer>` / `\\boxed{}` with
`answer_formats`); a correct answer ends the episode with reward `attempt_decay ** (attempt - 1)`; a wrong
one gets the user message "That is not correct. Try again." and another turn, up to `max_attempts`
(then the episode is truncated with reward 0). `info["correct"]` says whether it was solved. The
turns of one episode are one token ledger: the retries train on the feedback the model was shown.

Tasks come from `arithmetic_tasks(size, seed, ...)` (reproducible splits, no downloads); without a task,
`reset` samples one, so `gymnasium.make("slime_env/ArithmeticRetry-v0")` works as is.
"""

from __future__ import annotations

import functools
import operator
import random
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

from slime_env.envs.math.extract import extract_answer

from slime_env import Action, Env, Message, Task

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
SYSTEM_PROMPT = "You are a calculator. Reply with only the result, e.g. 12."
RETRY_MESSAGE = "That is not correct. Try again."


def arithmetic_tasks(size: int, seed: int = 0, *, digits: Sequence[int] = (2, 1), ops: str = "+",
                     split: str | None = None) -> list[Task]:
    """`size` problems `a OP b` with `digits[0]`-digit a and `digits[1]`-digit b, ops drawn from `ops`.

    `split="train"` / `"test"` keeps only problems of that side of a fixed partition (a hash of the problem:
    one in five is a test problem), so a held-out split never shares a problem with a training split,
    whatever their seeds."""
    if split not in (None, "train", "test"):
        raise ValueError(f"split must be 'train', 'test' or None, got {split!r}")
    unknown = set(ops) - set(_OPS)
    if unknown or not ops:
        raise ValueError(f"ops {ops!r}: characters from {''.join(_OPS)}")
    if len(digits) != 2 or min(digits) < 1:
        raise ValueError(f"digits must be two positive counts, got {list(digits)}")
    rng = random.Random(seed)
    lo = [10 ** (d - 1) if d > 1 else 0 for d in digits]
    tasks = []
    while len(tasks) < size:
        a, b = (rng.randint(lo[k], 10 ** digits[k] - 1) for k in range(2))
        op = rng.choice(ops)
        prompt = f"What is {a} {op} {b}?"
        if split is not None and (zlib.crc32(prompt.encode()) % 5 == 0) != (split == "test"):
            continue
        tasks.append(Task(prompt=prompt, label=_OPS[op](a, b), id=f"arith-{seed}-{len(tasks)}"))
    return tasks


@functools.cache
def default_math_tasks() -> tuple[Task, ...]:
    """The offline task source of the math envs' resets without a task: 200 fixed two-digit problems (+ - *)."""
    return tuple(arithmetic_tasks(200, 0, digits=(2, 2), ops="+-*"))


class ArithmeticRetryEnv(Env):
    """One arithmetic problem, up to `max_attempts` answers with feedback (see the module docstring)."""

    def __init__(self, *, max_attempts: int = 3, attempt_decay: float = 0.8, digits: Sequence[int] = (2, 1),
                 ops: str = "+", system_prompt: str = SYSTEM_PROMPT,
                 answer_formats: Sequence[str] = ("answer_tag", "boxed", "last_number")):
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        if not 0 < attempt_decay <= 1:
            raise ValueError(f"attempt_decay must be in (0, 1], got {attempt_decay}")
        self.max_attempts, self.attempt_decay = max_attempts, attempt_decay
        self.digits, self.ops = tuple(digits), ops
        self.system_prompt, self.answer_formats = system_prompt, tuple(answer_formats)
        self.task: Task | None = None
        self.attempt = 0

    def sample_task(self, rng: random.Random) -> Task:
        return arithmetic_tasks(1, rng.getrandbits(32), digits=self.digits, ops=self.ops)[0]

    async def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None):
        self.task, self.attempt = self.task_from(options, seed), 0
        from slime_env.envs.calculator import numeric_label

        numeric_label(self.task, "ArithmeticRetry-v0")  # refused now, not by float(None) at the first answer
        return self.task.messages(system=self.system_prompt), {}

    async def step(self, action: Action):
        if self.task is None:
            raise RuntimeError("ArithmeticRetryEnv.step called before reset")
        self.attempt += 1
        answer = extract_answer(action.text, self.answer_formats)
        correct = answer is not None and _number(answer) == float(self.task.label)
        info = {"answer": answer, "attempt": self.attempt, "correct": correct}
        if correct:
            return [], self.attempt_decay ** (self.attempt - 1), True, False, info
        if self.attempt >= self.max_attempts:
            return [], 0.0, False, True, info
        return [Message("user", RETRY_MESSAGE)], 0.0, False, False, info


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        return None
