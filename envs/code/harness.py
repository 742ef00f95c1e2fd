"""The half of grading that runs beside the solution, inside its sandbox (stdlib only).

This file is the main script of the solution's sandbox run. Everything it reports could have been
written by the solution instead (the solution can write to any file descriptor it can reach, fork,
exit), so it reports **observations, never verdicts**: what each program printed, what each call
returned. The grader decides outside, comparing printed output with expected output it never sent
here (`slime_env.envs.code.compare`), and replaying assert-style tests on the recorded return values in a
separate sandbox run that holds no solution code (`slime_env.envs.code.replay`). A forged report can
therefore claim only outputs or return values — no more than printing or returning them.

Input, as JSON on stdin: `kind`, `case_timeout_s`, `total_timeout_s`, `output_cap`, and
- `stdio`: `inputs`; each case runs `python3 solution.py` with the case's stdin.
  Result per case: `status` (ok / error / timeout / output_limit / not_run), `exit_code`, `stdout`,
  `stderr`, `time_s`.
- `calls`: `calls`, a list of `{"case", "fn", "args", "kwargs"}` (arguments tagged by
  `slime_env.envs.code.values`). A runner process (`slime_env.envs.code.runner`) loads the solution and makes the calls
  in order; `fn` is a top-level name or `Class().method`. Result: `{"loaded", "status", "error", "calls": [...]}`
  (status and error say why a solution did not load), per call
  `{"status": "ok", "value", "args_after"?}`, `{"status": "error", "type", "error"}`, or a case lost to
  `timeout` / `crash` / `output_limit` / `not_run` with its `error`.
Each case has its own time limit, enforced from outside the runner: a runner that hangs, exits or
crashes loses that case's remaining calls and is restarted at the next case. Output: one JSON line
`{"results": ...}` at the end of stdout. The grader ships `envs/code/runner.py` as `_grader_runner.py`
and `envs/code/values.py` as `_grader_values.py`.
"""

import json
import os
import select
import signal
import subprocess
import sys
import time

RUNNER_FILE = "_grader_runner.py"  # envs/code/runner.py, shipped beside this script by the grader
RESTRICT_DUMPING = 4  # prctl(PR_SET_DUMPABLE, 0): other processes of the sandbox cannot read our memory or fds


def not_dumpable():
    try:
        import ctypes

        ctypes.CDLL(None).prctl(RESTRICT_DUMPING, 0, 0, 0, 0)
    except Exception:  # noqa: BLE001, S110 - not Linux, or no libc: the grader never relies on it
        pass


def read_capped(proc, cap, deadline):
    """stdout of a process, cut at `cap` bytes, until it exits or `deadline`."""
    buf, fd = bytearray(), proc.stdout.fileno()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return bytes(buf), "timeout"
        r, _, _ = select.select([fd], [], [], left)
        if not r:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return bytes(buf), None
        buf += chunk
        if len(buf) > cap:
            return bytes(buf[:cap]), "output_limit"


def kill(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    proc.wait()


def run_stdio(spec, python, end):
    results = []
    for stdin in spec["inputs"]:
        deadline = min(time.monotonic() + spec["case_timeout_s"], end)
        if deadline <= time.monotonic():
            results.append({"status": "not_run"})
            continue
        t0 = time.monotonic()
        proc = subprocess.Popen([python, "solution.py"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
        try:
            proc.stdin.write(stdin.encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass
        out, problem = read_capped(proc, spec["output_cap"], deadline)
        if problem:
            kill(proc)
        else:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill(proc)
                problem = "timeout"
        r, _, _ = select.select([proc.stderr.fileno()], [], [], 0)
        err = os.read(proc.stderr.fileno(), 4096) if r else b""
        results.append({"status": problem or ("ok" if proc.returncode == 0 else "error"),
                        "exit_code": proc.returncode, "stdout": out.decode("utf-8", "replace"),
                        "stderr": err.decode("utf-8", "replace")[-1000:], "time_s": time.monotonic() - t0})
        proc.stdout.close()
        proc.stderr.close()
    return results


def parse_event(line, n_calls):
    """One runner line as ("loaded",), ("case", c) or ("call", k, outcome); None when malformed."""
    try:
        event = json.loads(line)
    except ValueError:
        return None
    if event == ["loaded"]:
        return ("loaded",)
    if type(event) is list and len(event) == 2 and event[0] == "case" and type(event[1]) is int:
        return ("case", event[1])
    if (type(event) is list and len(event) == 3 and event[0] == "call" and type(event[1]) is int
            and 0 <= event[1] < n_calls and type(event[2]) is dict):
        return ("call", event[1], event[2])
    return None


def run_calls(spec, source, python, end):
    """The calls through the runner, restarted after a case that hangs, exits or floods its pipe."""
    calls = spec["calls"]
    payload = json.dumps(spec).encode()
    results, loaded, load_error, load_status, start = {}, False, "", "", 0
    while time.monotonic() < end:
        r_fd, w_fd = os.pipe()
        proc = subprocess.Popen([python, "-s", "-u", "-c", source, str(w_fd), str(start)], pass_fds=(w_fd,),
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True)
        os.close(w_fd)
        try:
            proc.stdin.write(payload)
            proc.stdin.close()
        except BrokenPipeError:
            pass
        buf, total, ended, started = b"", 0, None, False
        deadline = min(time.monotonic() + spec["case_timeout_s"] + 2.0, end)  # + start-up and imports
        pending = [k for k, c in enumerate(calls) if c["case"] >= start and k not in results]
        while pending or not started:
            left = deadline - time.monotonic()
            if left <= 0:
                ended = "timeout"
                break
            r, _, _ = select.select([r_fd], [], [], left)
            if not r:
                continue
            chunk = os.read(r_fd, 65536)
            if not chunk:
                ended = "crash"
                break
            total += len(chunk)
            if total > spec["output_cap"]:
                ended = "output_limit"
                break
            buf += chunk
            while b"\n" in buf:
                line, _, buf = buf.partition(b"\n")
                event = parse_event(line, len(calls))
                if event is None:
                    continue
                if event[0] == "loaded":
                    started = loaded = True
                elif event[0] == "case":
                    deadline = min(time.monotonic() + spec["case_timeout_s"], end)
                elif event[1] not in results:
                    results[event[1]] = event[2]
            pending = [k for k in pending if k not in results]
        os.close(r_fd)
        kill(proc)
        err = proc.stderr.read()[-2000:].decode("utf-8", "replace")
        proc.stderr.close()
        if not pending and started:
            break
        reason = (err.strip().splitlines() or [ended or "stopped"])[-1][:300]
        if not started:  # the solution does not even load (syntax error, exit or hang at import)
            load_status = "timeout" if ended == "timeout" else "error"
            load_error = reason if ended != "timeout" else "time limit exceeded while loading the solution"
            break
        lost = calls[pending[0]]["case"]  # the case that hung or died: its remaining calls are lost
        for k in pending:
            if calls[k]["case"] == lost:
                results[k] = {"status": ended, "error": reason}
        start = lost + 1
    return {"loaded": loaded, "status": load_status, "error": load_error,
            "calls": [results.get(k, {"status": "not_run", "error": "the time limit ran out"})
                      for k in range(len(calls))]}


def main():
    not_dumpable()
    with open(RUNNER_FILE) as f:
        source = f.read()  # read now, before any solution code runs: every restart runs the same runner
    spec = json.loads(sys.stdin.read())
    end = time.monotonic() + spec["total_timeout_s"]
    if spec["kind"] == "stdio":
        results = run_stdio(spec, sys.executable, end)
    else:
        results = run_calls(spec, source, sys.executable, end)
    sys.stdout.write("\n" + json.dumps({"results": results}) + "\n")


if __name__ == "__main__":
    main()
