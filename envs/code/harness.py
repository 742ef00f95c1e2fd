"""The half of grading that runs beside the solution, inside its sandbox (stdlib only).

This file is the main script of the solution's sandbox run. Everything it reports could have been
written by the solution instead (the solution can write to any file descriptor it can reach, fork,
exit), so it reports **observations, never verdicts**: what each program printed, what each call
returned. The grader decides outside, comparing printed output with expected output it never sent
here (`envs.code.compare`), and replaying assert-style tests on the recorded return values in a
separate sandbox run that holds no solution code (`envs.code.replay`). A forged report can
therefore claim only outputs or return values — no more than printing or returning them.

Input, as JSON on stdin: `kind`, `case_timeout_s`, `total_timeout_s`, `output_cap`, and
- `stdio`: `inputs`; each case runs `python3 solution.py` with the case's stdin.
  Result per case: `status` (ok / error / timeout / output_limit / not_run), `exit_code`, `stdout`,
  `stderr`, `time_s`.
- `calls`: `calls`, a list of `{"case", "fn", "args", "kwargs"}` (arguments tagged by
  `envs.code.values`). A runner process imports the solution and makes the calls in order; `fn` is a
  top-level name or `Class().method`. Result: `{"loaded", "status", "error", "calls": [...]}` (status
  and error say why a solution did not load), per call
  `{"status": "ok", "value", "args_after"?}`, `{"status": "error", "type", "error"}`, or a case lost to
  `timeout` / `crash` / `output_limit` / `not_run` with its `error`.
Each case has its own time limit, enforced from outside the runner: a runner that hangs, exits or
crashes loses that case's remaining calls and is restarted at the next case. Output: one JSON line
`{"results": ...}` at the end of stdout. The grader ships `envs/code/values.py` as `_grader_values.py`.
"""

import builtins
import json
import os
import sys
import time

try:
    from _grader_values import NotPlain, tag, untag  # in the sandbox, shipped beside this script
except ImportError:  # imported on the host (tests, linting)
    from envs.code.values import NotPlain, tag, untag

RESTRICT_DUMPING = 4  # prctl(PR_SET_DUMPABLE, 0): other processes of the sandbox cannot read our memory or fds


def not_dumpable():
    try:
        import ctypes

        ctypes.CDLL(None).prctl(RESTRICT_DUMPING, 0, 0, 0, 0)
    except Exception:  # noqa: BLE001 - not Linux, or no libc: the grader never relies on it
        pass


# --- the runner: a child process that loads the solution and makes the calls ------------------------

def resolve(namespace, name):
    """The solution's callable for `name`: a top-level function, or `Class().method`."""
    if name.endswith("()") or "()." in name:
        cls_name, _, method = name.partition("().")
        cls = namespace.get(cls_name)
        if isinstance(cls, type):
            return getattr(cls(), method, None) if method else cls
        return None
    fn = namespace.get(name)
    if fn is None and isinstance(namespace.get("Solution"), type):  # LeetCode style: class Solution
        fn = getattr(namespace["Solution"](), name, None)
    return fn if callable(fn) else None


def call_outcome(namespace, call, restore):
    """Make one call; what it returned (tagged) or raised. Never raises."""
    try:
        fn = resolve(namespace, call["fn"])
        if fn is None:
            return {"status": "error", "type": "NameError", "error": "the solution defines no function %r" % call["fn"]}
        args, kwargs = untag(call["args"]), untag(call["kwargs"])
        value = fn(*args, **kwargs)
        restore()
        try:
            outcome = {"status": "ok", "value": tag(value)}
        except NotPlain as e:
            return {"status": "error", "type": "TypeError",
                    "error": "returned a %s: only plain built-in values can be checked" % type(e.value).__name__}
        try:
            after = tag(args)
        except NotPlain:  # it put something else into its arguments: the test sees them as they were
            return outcome
        if after != call["args"]:  # the call changed its arguments in place: the test may look at them
            outcome["args_after"] = after
        return outcome
    except BaseException as e:  # noqa: BLE001 - whatever the solution raises is its outcome
        restore()
        return {"status": "error", "type": type(e).__name__, "error": str(e)[:300]}


def runner(fd, start):
    """Load solution.py, then make the calls of cases >= `start`, one JSON line per event on `fd`."""
    out = os.fdopen(fd, "w", buffering=1)
    spec = json.loads(sys.stdin.read())
    sys.stdin = open(os.devnull)
    saved = dict(builtins.__dict__)

    def restore():  # a solution that replaced built-ins must not break our own tagging
        if builtins.__dict__ != saved:
            builtins.__dict__.clear()
            builtins.__dict__.update(saved)

    def report(*event):
        out.write(json.dumps(list(event)) + "\n")

    namespace = {"__name__": "solution", "__builtins__": builtins}
    sys.argv = ["solution.py"]
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    with open("solution.py") as f:
        source = f.read()
    exec(compile(source, "solution.py", "exec"), namespace)  # noqa: S102 - the sandbox holds it
    restore()
    report("loaded")
    current = None
    for k, call in enumerate(spec["calls"]):
        if call["case"] < start:
            continue
        if call["case"] != current:
            current = call["case"]
            report("case", current)
        report("call", k, call_outcome(namespace, call, restore))


# --- the parent: runs the runner (or the program) under per-case limits ------------------------------

# (select, signal and subprocess are imported here, not at the top: the runner child, which starts once
# per case lost, does not need them)

def read_capped(proc, cap, deadline):
    """stdout of a process, cut at `cap` bytes, until it exits or `deadline`."""
    import select

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
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    proc.wait()


def run_stdio(spec, python, end):
    import select
    import subprocess

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
    import select
    import subprocess

    calls = spec["calls"]
    payload = json.dumps(spec).encode()
    results, loaded, load_error, load_status, start = {}, False, "", "", 0
    while time.monotonic() < end:
        r_fd, w_fd = os.pipe()
        proc = subprocess.Popen([python, "-c", source, "--runner", str(w_fd), str(start)], pass_fds=(w_fd,),
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
    with open(__file__) as f:
        source = f.read()  # read now, before any solution code runs, for the runner's restarts
    spec = json.loads(sys.stdin.read())
    end = time.monotonic() + spec["total_timeout_s"]
    if spec["kind"] == "stdio":
        results = run_stdio(spec, sys.executable, end)
    else:
        results = run_calls(spec, source, sys.executable, end)
    sys.stdout.write("\n" + json.dumps({"results": results}) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--runner"]:
        runner(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main()
