"""`RankProcess`: one trainer rank in a child process of the run, called method by method over a pipe.

`cluster.backend: process` runs the trainer's ranks this way (`slime_env.trainers.run.trainer_group`): the run's own
process keeps the rollout manager, the environments and the engine clients, and no trainer step competes with them
for its interpreter lock (in one process an asynchronous run's step ran about twice as slowly beside generation;
docs/async.md). A child is `python -m slime_env.trainers.run.rank_process FD`: it builds the object named at start,
then answers `(method, args, kwargs)` messages in order, a coroutine's result awaited on its own event loop (which
lives as long as the child, as the weight channel's HTTP clients must). Arguments and results are pickled by value
(tensors are copied).

The child dies with the run, SIGKILL included (`slime_env.lifeline`), and writes its output to `log`. A call whose
child died raises naming its exit code and the end of that log; an exception raised in the child is raised here,
its traceback in the child attached as a note.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import socket
import subprocess
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from slime_env.lifeline import hold_lifeline, lifeline_popen
from slime_env.loading import load_object


class RankDied(RuntimeError):
    """The child process of a `RankProcess` exited (or closed its pipe) before answering a call."""


class RankProcess:
    """An instance of `target` ("package.module:Class", built with no arguments) in a child process; `call` runs
    one of its methods there and returns the result (blocking: from an event loop, through a thread). Calls are
    answered one at a time, in order. `env` updates the child's environment (the run's labels are inherited)."""

    def __init__(self, target: str, *, name: str, log: str | Path, env: dict[str, str] | None = None):
        self.name, self.log = name, Path(log)
        ours, theirs = socket.socketpair()
        kw = lifeline_popen({**os.environ, **(env or {})})
        kw["pass_fds"] = (*kw["pass_fds"], theirs.fileno())
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-P", "-m", __name__, str(theirs.fileno()), target],
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, **kw)
        theirs.close()
        self._conn = Connection(ours.detach())
        self._lock = threading.Lock()

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            try:
                _send(self._conn, (method, args, kwargs))
                status, value = _recv(self._conn)
            except (EOFError, OSError) as e:
                raise self._died(method) from e
        if status == "ok":
            return value
        if isinstance(value, BaseException):
            raise value
        raise RuntimeError(f"{self.name}.{method} failed: {value}")

    def _died(self, method: str) -> RankDied:
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            code = None
        try:
            tail = self.log.read_bytes()[-3000:].decode(errors="replace")
        except OSError:
            tail = ""
        how = f"exited with code {code}" if code is not None else "closed its pipe"
        return RankDied(f"{self.name} (pid {self.proc.pid}) {how} during {method}(); the end of {self.log}:\n{tail}")

    def kill(self) -> None:
        """Stop the child now (SIGKILL); a call in flight raises `RankDied`."""
        if self.proc.poll() is None:
            self.proc.kill()

    def close(self, timeout: float = 30.0) -> None:
        """Ask the child to exit; killed if it has not within `timeout` seconds."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):  # already gone
                _send(self._conn, None)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._conn.close()


def _send(conn: Connection, obj: Any) -> None:
    # Plain pickle, by value: `Connection.send`'s pickler takes torch's reducers, which pass tensors as shared memory
    # through multiprocessing's resource sharer — only children multiprocessing started share its key.
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def _serve(fd: int, target: str) -> None:
    hold_lifeline()
    conn = Connection(fd)
    obj = load_object(target)()
    loop = asyncio.new_event_loop()
    while True:
        try:
            message = _recv(conn)
        except (EOFError, OSError):
            break  # the run is gone
        if message is None:
            break
        method, args, kwargs = message
        try:
            value = getattr(obj, method)(*args, **kwargs)
            if asyncio.iscoroutine(value):
                value = loop.run_until_complete(value)
            reply = ("ok", value)
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
            e.add_note(f"in {target}.{method}, in process {os.getpid()}:\n{traceback.format_exc()}")
            reply = ("error", e)
        try:
            _send(conn, reply)
        except Exception as e:  # noqa: BLE001 - an unpicklable exception or result: its text instead
            _send(conn, ("error", f"{type(e).__name__}: {e}; the call's outcome: {reply[1]!r}"[:4000]))
    loop.close()
    conn.close()


if __name__ == "__main__":
    _serve(int(sys.argv[1]), sys.argv[2])
