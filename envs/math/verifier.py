"""Answer verification on HuggingFace's math-verify, in a pool of worker processes with a hard timeout.

`check(gold, answer)` is the verdict for two answer strings: identical strings and exact rationals
(integers, `a/b`, `\\frac{a}{b}`, decimals) are decided here without sympy — the same verdict math-verify
reaches, in microseconds — and everything else (expressions, sets, intervals, matrices, percentages,
units) goes to `math_verify.verify(parse(...), parse(...))`. Multiple-choice golds (`B`, `(B)`) compare
letters.

`MathVerifier` runs `check` for the async world: extraction and the fast path in the caller's process,
math-verify in worker processes (math-verify's own timeouts rely on SIGALRM, which only works on a
main thread, and a sympy call can hang for minutes). A call past `timeout_s` kills its worker, which
is replaced; the verdict is `timeout`, scored 0. Verdicts are cached per (gold, answer) string pair:
the n samples of a GRPO group often repeat an answer. Nothing here raises out of an episode.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import re
import subprocess
import sys
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from slime_env.envs.math.extract import FORMATS, extract_answer, gold_answer
from slime_env.envs.math.fastpath import expressions_equal, sets_equal

_CHOICE = re.compile(r"^\(?([A-Ja-j])\)?\.?$")
_INT = re.compile(r"^[+-]?\d+$")
_DEC = re.compile(r"^[+-]?(?:\d+\.\d*|\.\d+)$")
_FRAC = re.compile(r"^([+-]?)\\[dt]?frac\{([+-]?\d+)\}\{([+-]?\d+)\}$")
_SLASH = re.compile(r"^([+-]?\d+)/([+-]?\d+)$")


@dataclass(frozen=True, slots=True)
class Verdict:
    """`correct`; `extracted` answer (None: none found); `status` ok / no_answer / timeout / error;
    `method` fast / math_verify / choice / cache; `reason` for a status other than ok."""

    correct: bool
    extracted: str | None
    status: str = "ok"
    method: str = ""
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"correct": self.correct, "extracted": self.extracted, "status": self.status, "method": self.method,
                "reason": self.reason}


def _clean(s: str) -> str:
    s = s.strip().strip("$").strip()
    s = re.sub(r"\\[,!;: ]|\\left|\\right", "", s)
    return s.rstrip(".").replace(" ", "")


def _rational(s: str) -> tuple[Fraction, bool] | None:
    """(value, is_decimal) for an exact rational written plainly; None otherwise."""
    if _INT.match(s):
        return Fraction(int(s)), False
    if _DEC.match(s):
        return Fraction(s), True
    m = _FRAC.match(s) or _SLASH.match(s)
    if m:
        sign, num, den = (m.group(1), m.group(2), m.group(3)) if m.re is _FRAC else ("", m.group(1), m.group(2))
        if int(den) == 0:
            return None
        value = Fraction(int(num), int(den))
        return (-value if sign == "-" else value), False
    return None


def fast_check(gold: str, answer: str) -> bool | None:
    """The verdict when it is certain without sympy; None when math-verify must decide.

    Identical strings; exact rationals (equal values are equal for math-verify too; unequal ones are
    decided only when neither side is a decimal — math-verify rounds decimals, 0.333333 == 1/3, and
    that is its call); polynomial / rational expressions and finite sets of numbers (`slime_env.envs.math.fastpath`).
    """
    g, a = _clean(gold), _clean(answer)
    if g == a and g:
        return True
    rg, ra = _rational(g), _rational(a)
    if rg is not None and ra is not None:
        if rg[0] == ra[0]:
            return True
        return None if rg[1] or ra[1] else False
    if g.startswith("\\{") or a.startswith("\\{"):
        return sets_equal(g, a)
    return expressions_equal(g, a)


def decide_locally(gold: str, answer: str) -> tuple[bool, str] | None:
    """(correct, method) when no sympy is needed — a multiple-choice letter or the fast path — else None."""
    choice = _CHOICE.match(gold.strip())
    if choice:
        got = _CHOICE.match(_clean(answer).replace("\\text{", "").rstrip("}"))
        return bool(got) and got.group(1).upper() == choice.group(1).upper(), "choice"
    fast = fast_check(gold, answer)
    return None if fast is None else (fast, "fast")


def check(gold: str, answer: str) -> tuple[bool, str]:
    """(correct, method) for a gold answer string and an extracted answer string. Sync; may be slow."""
    local = decide_locally(gold, answer)
    if local is not None:
        return local
    from math_verify import parse, verify

    # Boxed, so math-verify's extraction takes exactly the answer (and not a number inside it).
    parsed_gold = parse(f"\\boxed{{{gold}}}", parsing_timeout=None)
    parsed_answer = parse(f"\\boxed{{{answer}}}", parsing_timeout=None)
    if not parsed_gold or not parsed_answer:
        return False, "math_verify"
    return bool(verify(parsed_gold, parsed_answer, timeout_seconds=None)), "math_verify"


def _worker_main() -> None:  # pragma: no cover - runs in the worker processes
    """A worker: one JSON request per stdin line (`[gold, answer]`), one JSON answer per stdout line."""
    import logging

    import math_verify  # noqa: F401 - imported once, before the first request is timed

    # math-verify warns on every call that its SIGALRM timeouts are off: they are, on purpose (the parent kills).
    logging.getLogger("math_verify").setLevel(logging.ERROR)

    out = sys.stdout
    try:
        out.write('["ready", null]\n')
        out.flush()
        for line in sys.stdin:
            try:
                gold, answer = json.loads(line)
                out.write(json.dumps(["ok", list(check(gold, answer))]) + "\n")
            except (BrokenPipeError, KeyboardInterrupt):
                raise
            except Exception as e:  # noqa: BLE001 - a verdict, never a dead worker
                out.write(json.dumps(["error", f"{type(e).__name__}: {e}"]) + "\n")
            out.flush()
    except (BrokenPipeError, KeyboardInterrupt):
        # The parent is gone (it exited without `close()`, maybe while this worker was still starting): leave
        # quietly. stdout points at a closed pipe, so the interpreter's own flush at exit would complain too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)


class _Worker:
    """A worker process (a plain subprocess: multiprocessing's spawn would re-run the user's __main__)."""

    def __init__(self):
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
        self.process = subprocess.Popen([sys.executable, "-c", "from slime_env.envs.math.verifier import _worker_main; "
                                                               "_worker_main()"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.fd = self.process.stdout.fileno()
        os.set_blocking(self.fd, False)
        self._buf = b""
        self.ready = False

    async def call(self, message: Any, timeout_s: float | None) -> tuple[str, Any]:
        self.process.stdin.write(json.dumps(message).encode() + b"\n")
        self.process.stdin.flush()
        return await self.receive(timeout_s)

    async def receive(self, timeout_s: float | None) -> tuple[str, Any]:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(timeout_s):
            while b"\n" not in self._buf:
                ready = loop.create_future()
                loop.add_reader(self.fd, lambda: ready.done() or ready.set_result(None))
                try:
                    await ready
                finally:
                    loop.remove_reader(self.fd)
                try:
                    chunk = os.read(self.fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    raise EOFError("verifier worker exited")
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        status, payload = json.loads(line)
        return status, payload

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:
                pass


class MathVerifier:
    """Async answer verification (see the module docstring). `workers` processes (default: CPU count),
    each call bounded by `timeout_s`; `formats` are the extraction formats (see `slime_env.envs.math.extract`)."""

    def __init__(self, *, workers: int | None = None, timeout_s: float = 5.0, formats: Sequence[str] = FORMATS,
                 cache_size: int = 1 << 16, start_timeout_s: float = 120.0):
        self.workers = workers or os.cpu_count() or 1
        self.timeout_s, self.formats, self.cache_size = timeout_s, tuple(formats), cache_size
        self.start_timeout_s = start_timeout_s
        self._idle: list[_Worker] = []
        self._all: list[_Worker] = []
        # A verifier never closed still ends its workers when it is collected or the interpreter exits (they would
        # otherwise outlive it, and write to its closed pipes).
        self._finalizer = weakref.finalize(self, _kill_all, self._all)
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._cache: collections.OrderedDict[tuple[str, str], tuple[bool, str]] = collections.OrderedDict()
        self.stats = collections.Counter()

    async def verify(self, response: str, gold: Any, *, formats: Sequence[str] | None = None) -> Verdict:
        """Extract the final answer from `response` and compare it with the gold label."""
        answer = extract_answer(response, formats or self.formats)
        if answer is None:
            self.stats["no_answer"] += 1
            return Verdict(False, None, "no_answer", reason="no final answer found")
        return await self.verify_answer(answer, gold)

    async def verify_answer(self, answer: str, gold: Any) -> Verdict:
        """Compare an already extracted answer with the gold label."""
        gold_text = gold_answer(gold)
        key = (gold_text, answer)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            self.stats["cache"] += 1
            return Verdict(hit[0], answer, method="cache")
        local = decide_locally(gold_text, answer)
        if local is not None:
            self.stats[local[1]] += 1
            return self._remember(key, Verdict(local[0], answer, method=local[1]))
        return await self._pooled(key, answer)

    async def _pooled(self, key: tuple[str, str], answer: str) -> Verdict:
        try:
            worker = await self._acquire()
        except TimeoutError:
            self.stats["error"] += 1
            return Verdict(False, answer, "error", "math_verify", "no verifier worker started in time")
        try:
            status, payload = await worker.call(list(key), self.timeout_s)
        except TimeoutError:
            self.stats["timeout"] += 1
            self._replace(worker)
            return Verdict(False, answer, "timeout", "math_verify", f"verification exceeded {self.timeout_s:g}s")
        except (EOFError, OSError, ValueError) as e:
            self.stats["error"] += 1
            self._replace(worker)
            return Verdict(False, answer, "error", "math_verify", f"verifier worker died: {e!r}")
        except asyncio.CancelledError:
            self._replace(worker)  # its answer would arrive for the wrong caller
            raise
        self._release(worker)
        if status != "ok":
            self.stats["error"] += 1
            return Verdict(False, answer, "error", "math_verify", str(payload))
        self.stats["math_verify"] += 1
        return self._remember(key, Verdict(bool(payload[0]), answer, method=payload[1]))

    def _remember(self, key: tuple[str, str], verdict: Verdict) -> Verdict:
        self._cache[key] = (verdict.correct, verdict.method)
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return verdict

    async def _acquire(self) -> _Worker:
        while len(self._all) < self.workers:
            self._all.append(self._start())
        if self._idle:
            return self._idle.pop()
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self.start_timeout_s + self.timeout_s):
                return await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self._release(waiter.result())  # handed over just as we gave up
            raise

    def _start(self) -> _Worker:
        worker = _Worker()
        asyncio.get_running_loop().create_task(self._await_ready(worker))
        return worker

    async def _await_ready(self, worker: _Worker) -> None:
        try:
            status, _ = await worker.receive(self.start_timeout_s)
            if status != "ready":
                raise RuntimeError(status)
        except Exception:  # noqa: BLE001 - a worker that cannot start is dropped; the next call starts another
            worker.kill()
            if worker in self._all:
                self._all.remove(worker)
            return
        worker.ready = True
        self._release(worker)

    def _release(self, worker: _Worker) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(worker)
                return
        self._idle.append(worker)

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        if worker in self._all:
            self._all.remove(worker)
        self._all.append(self._start())

    async def warm_up(self) -> None:
        """Start every worker and wait until each has imported math-verify."""
        workers = [await self._acquire() for _ in range(self.workers)]
        for worker in workers:
            self._release(worker)

    def close(self) -> None:
        _kill_all(self._all)
        self._idle.clear()


def _kill_all(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.kill()
    workers.clear()


_SHARED: dict[tuple, MathVerifier] = {}


def shared_verifier(**kwargs: Any) -> MathVerifier:
    """One `MathVerifier` per configuration in this process (envs made per episode share its workers)."""
    key = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in kwargs.items()))
    if key not in _SHARED:
        _SHARED[key] = MathVerifier(**kwargs)
    return _SHARED[key]
