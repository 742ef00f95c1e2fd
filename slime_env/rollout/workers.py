"""Driver worker processes: `RolloutManager(workers=N)` runs its groups in N processes.

One Python event loop tops out at some ten thousand framework turns a second; workers let the framework
scale with cores. The manager keeps everything that must be exactly-once in one place — the queue of
groups, the dynamic filter, batches, the store and resume — and hands each group to a worker, which runs
its n episodes (env, policy, renderer: copies made when it started) and sends the finished `Group` back.
A group is delivered and persisted only when it comes back whole; a worker that dies loses nothing: its
groups run again on a new worker. Workers are `spawn`ed processes, so a script that uses them needs the
usual `if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import os
import pickle
import threading
from dataclasses import dataclass, field
from typing import Any

from slime_env.errors import InvalidInput
from slime_env.rollout.heap import quiet_gc
from slime_env.rollout.loop import run_loop


class WorkerDied(RuntimeError):
    """A worker process exited while it held a group."""


@dataclass
class _Worker:
    index: int
    process: Any
    conn: Any
    pending: dict[int, asyncio.Future] = field(default_factory=dict)
    alive: bool = True
    send_lock: threading.Lock = field(default_factory=threading.Lock)


class WorkerPool:
    """N spawned processes that run groups for one manager (`spec`: what each needs to build its own copy)."""

    def __init__(self, n: int, spec: dict[str, Any], *, quiet_gc: bool = True, env_specs: dict[str, Any] | None = None):
        """`spec`: the keyword arguments of each worker's `GroupRunner`; `env_specs`: envs registered at run time."""
        if n < 1:
            raise InvalidInput(f"workers must be >= 1, got {n}")
        spec = {"runner": spec, "quiet_gc": quiet_gc, "env_specs": env_specs or {}}
        try:
            self._payload = pickle.dumps(spec)
        except Exception as e:  # noqa: BLE001 - which part cannot be copied, said plainly
            raise InvalidInput(f"workers need copies of the policy, renderer, env factory and tasks in each "
                               f"process, and one of them cannot be pickled ({type(e).__name__}: {e}); use a "
                               "remote engine (SGLangPolicy, OpenAIPolicy) or workers=0") from None
        self._ctx = multiprocessing.get_context("spawn")
        self._n = n
        self._workers: list[_Worker] = []
        self._where: dict[int, _Worker] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count()
        self.restarts = 0

    def _start(self, index: int) -> _Worker:
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(target=_worker_main, args=(child, self._payload), daemon=True,
                                    name=f"slime_env-rollout-worker-{index}")
        process.start()
        child.close()
        worker = _Worker(index, process, parent)
        # Results are read in the event loop when the pipe is readable (no reader thread: no GIL hand-offs).
        _watch(self._loop, parent, self._read, worker)
        return worker

    def _ensure(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not None and self._loop is not loop:
            raise InvalidInput("a RolloutManager with workers belongs to the event loop that first used it")
        self._loop = loop
        while len(self._workers) < self._n:
            self._workers.append(self._start(len(self._workers)))

    def _read(self, worker: _Worker) -> None:
        """The worker's pipe is readable: deliver every message waiting (a worker writes each whole, so a
        read never waits long); EOF means the worker died."""
        while True:
            try:
                message = worker.conn.recv()
            except (EOFError, OSError):
                self._loop.remove_reader(worker.conn.fileno())
                self._died(worker)
                return
            except Exception as e:  # noqa: BLE001 - an unpicklable result fails its group only
                message = ("error", None, f"could not read a worker's result: {type(e).__name__}: {e}")
            kind, group_index, payload = message
            self._deliver(worker, kind, group_index, payload)
            if not worker.conn.poll():
                return

    def _deliver(self, worker: _Worker, kind: str, group_index: int | None, payload: Any) -> None:
        fut = worker.pending.pop(group_index, None) if group_index is not None else None
        self._where.pop(group_index, None)
        if fut is None or fut.done():
            return
        if kind == "group":
            fut.set_result(payload)
        else:
            fut.set_exception(RuntimeError(payload))

    def _died(self, worker: _Worker) -> None:
        worker.alive = False
        code = worker.process.exitcode
        for group_index, fut in list(worker.pending.items()):
            self._where.pop(group_index, None)
            if not fut.done():
                fut.set_exception(WorkerDied(f"rollout worker {worker.index} exited (code {code}) with group "
                                             f"{group_index} unfinished"))
        worker.pending.clear()

    async def run_group(self, group_index: int) -> Any:
        """The finished `Group` for `group_index`; a worker that dies meanwhile is replaced and the group rerun."""
        self._ensure()
        for _ in range(3):
            worker = self._pick()
            fut = self._loop.create_future()
            worker.pending[group_index] = fut
            self._where[group_index] = worker
            try:
                self._send(worker, ("run", group_index))  # a few bytes: the pipe takes them without blocking
                return await fut
            except (WorkerDied, BrokenPipeError, EOFError, OSError):
                worker.pending.pop(group_index, None)
                continue
        raise WorkerDied(f"group {group_index}: three workers died running it")

    def _pick(self) -> _Worker:
        for i, w in enumerate(self._workers):
            if not w.alive:
                w.process.join(timeout=1)
                self._workers[i] = self._start(w.index)
                self.restarts += 1
        return min(self._workers, key=lambda w: len(w.pending))

    @staticmethod
    def _send(worker: _Worker, message: tuple) -> None:
        with worker.send_lock:
            worker.conn.send(message)

    async def abort(self, group_index: int, reason: str) -> None:
        worker = self._where.get(group_index)
        if worker is not None and worker.alive:
            try:
                self._send(worker, ("abort", group_index, reason))
            except (BrokenPipeError, EOFError, OSError):
                pass  # it died: its groups fail over on their own

    async def close(self) -> None:
        for w in self._workers:
            if w.alive:
                try:
                    await asyncio.to_thread(self._send, w, ("stop",))
                except (BrokenPipeError, EOFError, OSError):
                    pass
        for w in self._workers:
            await asyncio.to_thread(w.process.join, 10)
            if w.process.is_alive():
                w.process.kill()
                await asyncio.to_thread(w.process.join, 5)
            if w.alive:
                self._loop.remove_reader(w.conn.fileno())
            w.conn.close()
        self._workers.clear()


def _watch(loop: asyncio.AbstractEventLoop, conn: Any, callback: Any, *args: Any) -> None:
    """Call `callback(*args)` in `loop` whenever `conn` (a multiprocessing pipe) is readable. The pipe stays in
    blocking mode: `Connection.send`/`recv` move whole messages only on a blocking descriptor, and uvloop (libuv)
    turns a watched descriptor non-blocking, after which a large message would be cut mid-way."""
    loop.add_reader(conn.fileno(), callback, *args)
    os.set_blocking(conn.fileno(), True)


# --- the worker process ---------------------------------------------------------------------------
def _worker_main(conn: Any, payload: bytes) -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _die_with_parent()
    spec = pickle.loads(payload)
    with quiet_gc(spec.get("quiet_gc", True)):  # this process only drives episodes: a quiet collector all along
        run_loop(_serve(conn, spec))


def _die_with_parent() -> None:
    """Linux: the kernel kills this worker when its parent dies (kill -9 included)."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


async def _serve(conn: Any, spec: dict[str, Any]) -> None:
    from slime_env.registry import adopt_specs
    from slime_env.rollout.groups import GroupRunner

    adopt_specs(spec["env_specs"])  # envs the parent registered at run time
    runner = GroupRunner(**spec["runner"])
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue = asyncio.Queue()

    def read() -> None:
        """A thread that always drains the parent's messages: the parent's sends never wait on this loop, which
        may itself be blocked sending a result to the parent (both waiting would be a deadlock)."""
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                message = ("stop",)
            loop.call_soon_threadsafe(inbox.put_nowait, message)
            if message[0] == "stop":
                return

    def send(message: tuple) -> None:
        conn.send(message)

    threading.Thread(target=read, daemon=True).start()
    running: dict[int, Any] = {}

    async def run(group_index: int) -> None:
        rg = runner.new(group_index)
        running[group_index] = rg
        try:
            group = await runner.run(rg)
            message = ("group", group_index, group)
        except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the group visibly
            message = ("error", group_index, f"worker raised {type(e).__name__}: {e}")
        finally:
            running.pop(group_index, None)
        try:
            send(message)  # the parent reads its pipes in its loop, so this waits little
        except (BrokenPipeError, EOFError, OSError):
            return  # the parent is gone
        except Exception as e:  # noqa: BLE001 - e.g. a trajectory that cannot be pickled
            send(("error", group_index, f"cannot send the group back: {e!r}"))

    tasks: set[asyncio.Task] = set()
    while True:
        message = await inbox.get()
        if message[0] == "run":
            task = asyncio.create_task(run(message[1]))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        elif message[0] == "abort":
            rg = running.get(message[1])
            if rg is not None:
                await asyncio.gather(*(ep.abort(message[2]) for ep in rg.episodes))
        elif message[0] == "stop":
            break
    for task in list(tasks):
        task.cancel()
    runner.close()
