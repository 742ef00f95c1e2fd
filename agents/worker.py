"""The worker-thread scaffold of the embedded engines, and what an engine gets from the policy in front of it.

`TransformersPolicy` is the front: it checks and queues requests, resolves their futures, loads weights. Behind it
one engine runs the model — `ContinuousEngine` (`slime_env.agents.engine`: transformers, any device) or `PagedEngine`
(`slime_env.agents.paged_engine`: paged K/V and CUDA graphs). Both are an `EngineWorker`: one thread runs every step;
the event loop only submits (`submit`), holds admission while the weights change (`hold`), and closes. The thread
waits for work, runs one step at a time under `model_lock` and `torch.inference_mode()`, fails what runs when a step
raises (and keeps serving), and ends every request still waiting or running with finish reason "abort" when closed.
A subclass says what work there is (`_busy`, `_pending`), takes the waiting requests into a step (`_take`), runs one
step (`_step`), fails the running ones (`_fail`) and lists what is left at close (`_drain`).

The engine knows its front only through an `EngineFront`: the model, the pad id, the usage counters, the weight
version, the stop rule and the host-side sampler, passed in. Requests are `Request`s: the engine fills their
output and `resolve()`s them, from its thread, on their own event loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Request:
    """One generation request, from the front's checks to the engine's last token."""

    input_ids: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop: tuple[str, ...]
    stop_token_ids: frozenset[int]
    generator: torch.Generator | None
    future: asyncio.Future
    rid: str = ""
    out_ids: list[int] = field(default_factory=list)
    out_logprobs: list[float] = field(default_factory=list)
    finish: str | None = None
    aborted: bool = False  # set from the event loop; read by the worker between decoding steps
    session: str | None = None  # prefix-cache key (the episode session)
    loop: asyncio.AbstractEventLoop | None = None
    error: BaseException | None = None
    cached_tokens: int = 0
    weight_version: str | None = None
    seed: int = 0  # the request's sampling seed (the paged engine draws from it on the device)
    out_routed: list = field(default_factory=list)  # MoE: per sampled token, its forward's [layers, top_k] experts

    def resolve(self) -> None:
        """Done (its output, or `error`): resolve its future on its event loop. Called from the engine's thread."""
        def resolve() -> None:
            if self.future.done():
                return
            if self.error is not None:
                self.future.set_exception(self.error)
            else:
                self.future.set_result(None)

        try:
            self.loop.call_soon_threadsafe(resolve)
        except RuntimeError:
            pass  # its event loop is closed: nobody waits for it


@dataclass
class EngineFront:
    """What an engine needs of the policy in front of it (see the module docstring)."""

    model: Any
    device: torch.device
    pad_id: int
    usage: dict[str, Any]                                   # counters the engine adds to (tokens, batches, seconds)
    version: Callable[[], str]                              # the weight version loaded now
    finished: Callable[[Request], str | None]               # a request's finish reason after its latest token
    sample: Callable[[list[Request], torch.Tensor], list[tuple[int, float]]]  # host-side: (token, log-prob) per row
    capture: Any = None  # a RoutingCapture on MoE models (slime_env.agents.routing_capture): routing per sampled token


class EngineWorker:
    """The thread and its loop (see the module docstring). Subclasses call `start()` at the end of `__init__`."""

    def __init__(self, front: EngineFront, *, name: str):
        self.front = front
        self._waiting: collections.deque = collections.deque()  # submitted by the event loop (under _wake)
        self._wake = threading.Condition()
        self._closed = False
        self._hold = False  # set while the weights change: no admissions, the running requests finish first
        self.model_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    # --- from the event loop ----------------------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        with self._wake:
            self._waiting.append(req)
            self._wake.notify()

    def hold(self, on: bool) -> None:
        with self._wake:
            self._hold = on
            self._wake.notify()

    def idle(self) -> bool:
        return not self._busy()

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        # Let the step in progress end: a thread still inside torch at interpreter exit aborts the process
        # ("terminate called without an active exception").
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)

    # --- the thread -------------------------------------------------------------------------------------------
    def _run(self) -> None:
        with self._thread_context():
            while True:
                with self._wake:
                    while not self._closed and not self._busy() and (self._hold or not self._pending()):
                        self._wake.wait()
                    if self._closed:
                        break
                    work = self._take(self._hold)
                try:
                    with self.model_lock, torch.inference_mode():
                        t0 = time.perf_counter()
                        self._step(work)
                        self.front.usage["generate_s"] += time.perf_counter() - t0
                except Exception as e:  # noqa: BLE001 - fail what is running, keep serving
                    self._fail(e, work)
            with self._wake:
                left = self._drain()
        for r in left:
            r.finish = "abort"
            r.resolve()

    def _thread_context(self) -> contextlib.AbstractContextManager:
        """Entered by the thread around its whole loop (e.g. a CUDA stream of its own)."""
        return contextlib.nullcontext()

    # --- what a subclass says ---------------------------------------------------------------------------------
    def _busy(self) -> bool:
        """Requests are running (a step has work even with admission held)."""
        raise NotImplementedError

    def _pending(self) -> bool:
        """Requests wait to be admitted (called under `_wake`)."""
        return bool(self._waiting)

    def _take(self, hold: bool) -> Any:
        """What the next step gets from the waiting requests (called under `_wake`; `hold`: admit none)."""
        raise NotImplementedError

    def _step(self, work: Any) -> None:
        raise NotImplementedError

    def _fail(self, error: Exception, work: Any) -> None:
        """A step raised `error`: end the running requests (and those `work` admitted) with it."""
        raise NotImplementedError

    def _drain(self) -> list[Request]:
        """At close: every request still waiting or running (called under `_wake`)."""
        raise NotImplementedError
