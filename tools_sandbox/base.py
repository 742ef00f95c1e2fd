"""`Sandbox`: the one async interface every backend implements, with its concurrency cap and deadlines."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import time
from collections.abc import Mapping
from typing import ClassVar

from slime_env.tools_sandbox.languages import get_language
from slime_env.tools_sandbox.types import ExecRequest, ExecResult


class Sandbox:
    """Runs untrusted code with hard limits. Subclasses implement `_execute`; callers use `run`.

    `run(code, language="python", stdin=, files=, timeout_s=, memory_mb=, output_limit_bytes=,
    deadline_s=)` never raises for anything the code does, nor for a failing sandbox (that is
    status `sandbox_error`); it raises `InvalidInput` for bad arguments. At most `max_concurrency`
    runs execute at once; the others wait. `deadline_s` bounds the whole call (waiting for a slot,
    setup and the run): the run's own limit is cut to what is left, and a call still queued when it
    passes returns status `timeout`. A cancelled call kills its run and leaves nothing behind.
    """

    backend: ClassVar[str] = "base"

    def __init__(self, *, max_concurrency: int = 8, timeout_s: float = 10.0, memory_mb: int = 512,
                 output_limit_bytes: int = 1 << 20):
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.max_concurrency = max_concurrency
        self.defaults = {"timeout_s": timeout_s, "memory_mb": memory_mb, "output_limit_bytes": output_limit_bytes}
        self._slots: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}
        self.live = 0  # runs executing now, for tests and metrics

    async def run(self, code: str, language: str = "python", *, stdin: str = "",
                  files: Mapping[str, bytes | str] | None = None, timeout_s: float | None = None,
                  memory_mb: int | None = None, output_limit_bytes: int | None = None,
                  deadline_s: float | None = None) -> ExecResult:
        get_language(language)  # an unknown language is the caller's error, raised now
        request = ExecRequest(code=code, language=language, stdin=stdin, files=files or {},
                              timeout_s=timeout_s or self.defaults["timeout_s"],
                              memory_mb=memory_mb or self.defaults["memory_mb"],
                              output_limit_bytes=output_limit_bytes or self.defaults["output_limit_bytes"])
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        slots = self._slots.get(loop)
        if slots is None:  # asyncio primitives belong to one loop; tests and tools may run several in turn
            slots = self._slots[loop] = asyncio.Semaphore(self.max_concurrency)
        try:
            async with asyncio.timeout(deadline_s):
                await slots.acquire()
        except TimeoutError:
            return self._result("timeout", reason=f"deadline of {deadline_s}s passed while waiting for a free "
                                                  f"slot ({self.max_concurrency} runs at most)",
                                duration_s=time.perf_counter() - t0)
        self.live += 1
        try:
            cut = False
            if deadline_s is not None:
                left = deadline_s - (time.perf_counter() - t0)
                if left <= 0.01:
                    return self._result("timeout", reason=f"deadline of {deadline_s}s passed before the run started")
                if left < request.timeout_s:
                    request, cut = dataclasses.replace(request, timeout_s=left), True
            try:
                result = await self._execute(request)
            except (asyncio.CancelledError, KeyboardInterrupt):
                raise
            except Exception as e:  # noqa: BLE001 - a broken sandbox is a status, never a crashed episode
                return self._result("sandbox_error", reason=f"{type(e).__name__}: {e}")
            if cut and result.status == "timeout":
                result = dataclasses.replace(result, reason=f"deadline of {deadline_s}s reached (the run had "
                                                            f"{request.timeout_s:.2f}s of it)")
            return result
        finally:
            self.live -= 1
            slots.release()

    async def _execute(self, request: ExecRequest) -> ExecResult:
        raise NotImplementedError

    async def close(self) -> None:
        return None

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _result(self, status: str, **kw) -> ExecResult:
        return ExecResult(status=status, backend=self.backend, **kw)

    def describe(self) -> str:
        return f"{self.backend} sandbox"


def classify(*, exit_code: int | None, timed_out: bool, output_exceeded: bool, oom: bool, stderr: str,
             timeout_s: float, memory_mb: int, output_limit_bytes: int) -> tuple[str, str]:
    """(status, reason) from what happened to the process, in order of precedence."""
    if output_exceeded:
        return "output_limit", f"stdout + stderr exceeded {output_limit_bytes} bytes"
    if timed_out:
        return "timeout", f"wall-clock limit of {timeout_s:g}s exceeded"
    if exit_code == -signal.SIGXCPU:
        return "timeout", "CPU-time limit exceeded"
    if oom:
        return "memory", f"memory limit of {memory_mb} MB exceeded (killed)"
    if exit_code not in (0, None) and _ends_with_memory_error(stderr):
        return "memory", f"memory limit of {memory_mb} MB exceeded (allocation failed)"
    if exit_code == 0:
        return "ok", ""
    return "error", ""


def _ends_with_memory_error(stderr: str) -> bool:
    lines = [line for line in stderr[-2000:].splitlines() if line.strip()]
    return bool(lines) and (lines[-1].startswith("MemoryError") or "std::bad_alloc" in lines[-1]
                            or "Cannot allocate memory" in lines[-1])
