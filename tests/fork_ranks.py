"""`python tests/fork_ranks.py [--preload m1,m2]`: a rank server (`helpers.RankServer`). It imports the `--preload`
modules once, then for each launch (one JSON line on stdin: `nproc`, `argv`, `env`, `cwd`, and `stdout` / `stderr`
files) forks a leader in a session of its own, which forks the script's ranks as torchrun starts them (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT: `init_process_group` joins the job from those;
one rank: the script alone, as `python SCRIPT`). It answers `{"pid": leader}` at once (a timeout kills that session)
and `{"code": exit code}` when the launch ends: 0 when every rank exits 0, otherwise the first failing rank's (the
others are killed). It exits when stdin closes.

Why: every rank of a CPU-side parallel check imported torch, transformers and megatron-core itself, ~8 s of CPU
each; a four-rank check started five such processes (torchrun's own too) for a second of training, so on two cores
the imports were most of tests/test_megatron.py's time. Forked ranks share the server's imports; what they compute
is the same (each seeds itself; gloo, fp32). torchrun itself stays tested where its behaviour is the point
(tests/test_tinker_ranks.py: signals, exit codes) and on GPUs."""

from __future__ import annotations

import importlib
import json
import os
import runpy
import signal
import socket
import sys
import tempfile
import traceback


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(script: str, args: list[str]) -> int:
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _rank(rank: int, world: int, port: int, script: str, args: list[str]) -> int:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return _run(script, args)


def launch(world: int, script: str, args: list[str]) -> int:
    """`script`'s `world` ranks forked from this process (one: run here, as `python SCRIPT` would); the exit code."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python SCRIPT` puts it first
    if world == 1:
        return _run(script, args)
    port, ranks = _free_port(), {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            os._exit(_rank(rank, world, port, script, args))  # never back into the parent's loop
        ranks[pid] = rank
    status = 0
    while ranks:
        pid, raw = os.wait()
        ranks.pop(pid)
        code = os.waitstatus_to_exitcode(raw)
        if code and not status:  # a rank failed: the others would wait for it in a collective forever
            status = code if code > 0 else 128 - code
            print(f"fork_ranks: a rank of {script} exited with {code}; stopping the others", file=sys.stderr)
            for other in ranks:
                try:
                    os.kill(other, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    return status


def _leader(job: dict) -> int:
    """One launch of the server, in a forked process of its own session, as a fresh `python` would start it."""
    os.setsid()
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, job["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, job["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    tempfile.tempdir = None  # TMPDIR is the launch's
    return launch(job["nproc"], job["argv"][0], job["argv"][1:])


def serve() -> int:
    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os._exit(_leader(job))
        print(json.dumps({"pid": pid}), flush=True)
        _, raw = os.waitpid(pid, 0)
        print(json.dumps({"code": os.waitstatus_to_exitcode(raw)}), flush=True)
    return 0


def main() -> int:
    args = sys.argv[1:]
    preload = [m for m in args[1].split(",") if m] if args[:1] == ["--preload"] else []
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tests' helpers, as a check imports them
    for name in preload:
        try:
            importlib.import_module(name)
        except ImportError:  # the ranks import it again and report it
            pass
    return serve()


if __name__ == "__main__":
    sys.exit(main())
