"""Helper processes that die with the run that started them, and the reaping of those a dead run left behind.

A training run starts processes of its own — engine servers (`slime-env serve-engine`), gateways, retrievers,
sandbox servers, rollout workers — that hold memory (an engine: its model, about 1 GB for a 135M one) and ports.
A run killed with SIGKILL runs no cleanup, so two mechanisms keep them from outliving it:

- **the lifeline**: a pipe whose write end only the parent holds (`lifeline_popen` gives a child its read end and
  `SLIME_ENV_LIFELINE_FD`); the child's `hold_lifeline()` (every `slime-env` command calls it at start) watches it
  in a thread and exits the moment it reads end-of-file, which the kernel delivers when the parent is gone however
  it died. Unlike `PR_SET_PDEATHSIG` it follows the parent *process*, not the thread that forked the child;
- **the run label**: `run_scope(label)` puts `SLIME_ENV_RUN=label` and `SLIME_ENV_OWNER=host:pid:start-time` (the
  run's process; a reused pid is another owner) into the environment every child inherits, so `reap(label)` finds,
  through /proc, the processes of that label whose owner no longer runs (e.g. one that ignored its lifeline, or a
  grandchild) and kills them. A run reaps its label (its run directory) as it starts: a resumed run clears what
  the crashed one left. Processes of a live owner are never touched.

Linux; elsewhere the lifeline still works (a pipe) and `reap` finds nothing. This module imports nothing of the
framework.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
from collections.abc import Iterator

LABEL_ENV = "SLIME_ENV_RUN"
OWNER_ENV = "SLIME_ENV_OWNER"
LIFELINE_ENV = "SLIME_ENV_LIFELINE_FD"

_pipe: tuple[int, int] | None = None
_lock = threading.Lock()


def owner_id(pid: int | None = None) -> str:
    """`host:pid:start-time` of a process (this one by default): a pid the kernel reuses is another owner."""
    pid = pid or os.getpid()
    return f"{socket.gethostname()}:{pid}:{_start_time(pid)}"


def _start_time(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[19]
    except OSError:
        return "?"


def owner_alive(owner: str) -> bool:
    """Whether the process an owner id names still runs (on another host: assumed alive)."""
    host, _, rest = owner.partition(":")
    pid, _, start = rest.partition(":")
    if host != socket.gethostname():
        return True
    if not pid.isdigit():
        return False
    return _start_time(int(pid)) == start != "?"


# --- the lifeline --------------------------------------------------------------------------------------------------
def lifeline_popen(env: dict[str, str] | None = None) -> dict[str, object]:
    """`subprocess.Popen` keywords (`pass_fds`, `env`: `env` or this process's, plus the lifeline's fd) that make a
    child die with this process, once the child calls `hold_lifeline()`."""
    global _pipe
    with _lock:
        if _pipe is None:
            _pipe = os.pipe()  # both ends close-on-exec: only children given the read end (pass_fds) hold it
    read = _pipe[0]
    return {"pass_fds": (read,), "env": {**(os.environ if env is None else env), LIFELINE_ENV: str(read)}}


def hold_lifeline() -> bool:
    """In a child started with `lifeline_popen`: exit (SIGKILL to itself, no cleanup to hang in) when the parent is
    gone. False when this process has no lifeline. The variable is removed, so this process's own children do not
    take a descriptor number that means nothing to them."""
    value = os.environ.pop(LIFELINE_ENV, None)
    if value is None or not value.isdigit():
        return False
    fd = int(value)
    try:
        os.fstat(fd)
    except OSError:
        return False

    def watch() -> None:
        try:
            while os.read(fd, 1):  # the parent never writes: only EOF (or an error) comes back
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="slime_env-lifeline").start()
    return True


# --- the run label -------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def run_scope(label: str) -> Iterator[None]:
    """While inside, every child of this process carries the run's label and this process as its owner (see the
    module docstring); the environment is restored after."""
    before = {k: os.environ.get(k) for k in (LABEL_ENV, OWNER_ENV)}
    os.environ[LABEL_ENV], os.environ[OWNER_ENV] = label, owner_id()
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def labelled(label: str) -> list[tuple[int, str]]:
    """(pid, owner) of this user's processes that carry run label `label` (read from /proc)."""
    found = []
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.partition(b"=")[::2] for item in f.read().split(b"\0") if item)
        except OSError:  # gone, or another user's
            continue
        if env.get(LABEL_ENV.encode()) == label.encode():
            found.append((pid, env.get(OWNER_ENV.encode(), b"").decode()))
    return found


def reap(label: str) -> list[int]:
    """Kill (SIGKILL) the processes of run label `label` whose owner is gone; their pids."""
    killed = []
    for pid, owner in labelled(label):
        if pid == os.getpid() or owner_alive(owner):
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except OSError:
            pass
    return killed
