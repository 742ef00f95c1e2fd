"""BwrapSandbox(fork_server=True): one long-lived bubblewrap sandbox per slot, a fresh fork per run.

The whole attack suite and the forgery suite run against it as the `bwrap_fork` backend
(tests/sandbox_support.py); these tests check what only a reused sandbox could get wrong: nothing a run
leaves behind is seen by the next one, and a broken server is replaced.
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from sandbox_support import make_sandbox

LEAVE = r"""
import ctypes, json, os, subprocess, sys
open("/work/leak-work", "w").write("x")
open(os.path.join(os.getcwd(), "..", "leak-parent"), "w").write("x")
open("/tmp/leak-tmp", "w").write("x")
try:
    open("/dev/shm/leak-shm", "w").write("x")
except OSError:
    pass
os.environ["LEAK_ENV"] = "1"
os.putenv("LEAK_PUTENV", "1")
json.LEAK_MODULE = "1"
sys.modules["leak_module"] = json
sys.path.insert(0, "/tmp/leak-path")
shm = ctypes.CDLL(None, use_errno=True).shmget(424242, 4096, 0o1666)  # IPC_CREAT | 0666
subprocess.Popen(["sleep", "300"], start_new_session=True)  # a daemon outliving the run
pid = os.fork()
if pid == 0:
    os.setsid()
    import time
    time.sleep(300)
    os._exit(0)
print(json.dumps({"shm": shm, "pid": os.getpid()}))
"""

LOOK = r"""
import ctypes, json, os, sys
seen = {
    "work": sorted(os.listdir("/work")), "tmp": sorted(os.listdir("/tmp")),
    "shm": sorted(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else [],
    "env": sorted(k for k in os.environ if k.startswith("LEAK")),
    "environ_file": b"LEAK" in open("/proc/self/environ", "rb").read(),
    "module": hasattr(sys.modules["json"] if "json" in sys.modules else __import__("json"), "LEAK_MODULE"),
    "modules": "leak_module" in sys.modules, "path": "/tmp/leak-path" in sys.path,
    "sysv": ctypes.CDLL(None, use_errno=True).shmget(424242, 0, 0),
    "procs": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()), "me": os.getpid(),
    "cwd": os.path.basename(os.getcwd()),
}
print(json.dumps(seen))
"""


@pytest.fixture()
def fork_sb(runner):
    sb = make_sandbox("bwrap_fork", max_concurrency=1)
    yield sb
    runner.run(sb.close())


def test_nothing_a_run_leaves_is_seen_by_the_next(runner, fork_sb):
    left = runner.run(fork_sb.run(LEAVE, timeout_s=10))
    assert left.status == "ok", left
    assert json.loads(left.stdout)["shm"] >= 0  # the segment was really created
    seen = json.loads(runner.run(fork_sb.run(LOOK)).stdout)
    me = seen.pop("me")
    assert seen.pop("work") == [seen.pop("cwd")]  # /work holds this run's directory only
    assert seen == {"tmp": [], "shm": [], "env": [], "environ_file": False, "module": False, "modules": False,
                    "path": False, "sysv": -1, "procs": sorted({1, me})}
    assert fork_sb._fork.started == 1  # the same sandbox served both runs


def test_work_dir_holds_only_this_run(runner, fork_sb):
    runner.run(fork_sb.run("open('/work/stale', 'w').write('x')"))
    out = runner.run(fork_sb.run("import os; print(sorted(os.listdir('/work')), os.getcwd())"))
    listing, cwd = out.stdout.rsplit(" ", 1)
    assert eval(listing) == [os.path.basename(cwd.strip())]  # noqa: S307 - our own printed list


def test_the_agent_cannot_be_killed_or_read_from_inside(runner, fork_sb):
    code = ("import os, signal\n"
            "for sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGSTOP):\n"
            "    os.kill(1, sig)\n"
            "for name in ('environ', 'mem', 'fd/1'):\n"
            "    try:\n"
            "        open('/proc/1/' + name, 'rb').read(1); print('read', name)\n"
            "    except OSError as e:\n"
            "        print('denied', name)\n")
    out = runner.run(fork_sb.run(code))
    assert out.stdout.split("\n")[:3] == ["denied environ", "denied mem", "denied fd/1"], out
    after = runner.run(fork_sb.run("print('still here')"))
    assert after.stdout == "still here\n" and fork_sb._fork.started == 1


def test_a_dead_server_is_replaced(runner, fork_sb):
    assert runner.run(fork_sb.run("print(1)")).stdout == "1\n"
    server = fork_sb._fork._servers[0]
    os.killpg(server.process.pid, signal.SIGKILL)  # the whole bubblewrap sandbox dies between runs
    runner.run(server.process.wait())
    again = runner.run(fork_sb.run("print(2)"))
    assert again.status == "ok" and again.stdout == "2\n" and fork_sb._fork.started == 2


def test_a_cancelled_run_takes_its_sandbox_down_and_the_next_run_works(runner, fork_sb):
    import asyncio

    async def cancel_mid_run():
        task = asyncio.ensure_future(fork_sb.run("import time; time.sleep(60)", timeout_s=60))
        await asyncio.sleep(1.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    runner.run(cancel_mid_run())
    assert fork_sb._fork._servers == {}
    assert runner.run(fork_sb.run("print(3)")).stdout == "3\n"


def test_python_semantics_match_a_cold_interpreter(runner, fork_sb):
    code = ("import atexit, sys, threading, time\n"
            "atexit.register(lambda: print('atexit ran'))\n"
            "threading.Thread(target=lambda: (time.sleep(0.2), print('thread done'))).start()\n"
            "print(sys.argv, __name__, hash('abc') == {h})\n"
            "sys.exit(3)\n").format(h=_cold_hash())
    out = runner.run(fork_sb.run(code))
    assert out.exit_code == 3 and out.stdout == "['main.py'] __main__ True\nthread done\natexit ran\n", out
    err = runner.run(fork_sb.run("def f():\n    raise KeyError('k')\nf()\n"))
    assert err.exit_code == 1 and err.stderr.startswith("Traceback (most recent call last):\n  File \"/work/run-")
    assert "sandbox_agent" not in err.stderr and err.stderr.endswith("KeyError: 'k'\n")
    syntax = runner.run(fork_sb.run("x = (\n"))
    assert syntax.exit_code == 1 and "SyntaxError" in syntax.stderr
    exited = runner.run(fork_sb.run("raise SystemExit('bye')"))
    assert exited.exit_code == 1 and exited.stderr == "bye\n"


def _cold_hash() -> int:
    """hash('abc') in a fresh interpreter with the sandbox's PYTHONHASHSEED=0."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "print(hash('abc'))"], env={"PYTHONHASHSEED": "0"},
                         capture_output=True, text=True)
    return int(out.stdout)
