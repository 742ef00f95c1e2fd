"""The test harness that runs inside the sandbox (stdlib only): one sandbox run grades one submission.

It is given the solution, the test *inputs* (never the expected outputs of stdin/stdout and call-based
tests: those are compared outside the sandbox) and limits, on stdin as JSON. It marks itself not
dumpable (so the code under test cannot reach its memory or file descriptors through /proc), then:
- `stdio`: runs `python3 solution.py` once per case with the case's stdin; reports stdout and exit code;
- `call`: starts a runner that imports the solution and calls the function once per case, reporting
  each return value (JSON with type tags) on a private pipe;
- `assert`: starts a runner that executes the solution, the test prelude and each test statement,
  reporting pass / fail per statement.
Each case has its own time limit, enforced from outside the runner: a runner that hangs, exits
(`sys.exit(0)`, `os._exit(0)`) or crashes loses that case and is restarted at the next one, so exiting
early can never pass a test that did not run. In the runner, the function under test is wrapped: its
return value must be made of plain built-in types (an object whose `__eq__` always says True fails),
and built-ins the solution replaced are restored before each comparison. Output: one JSON line
`{"results": [...]}` on stdout.
"""

HARNESS_SOURCE = r'''
import ctypes, json, os, select, signal, subprocess, sys, time
try:
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 0
except Exception:
    pass

RUNNER = r"""
import ast, builtins, json, os, sys
out = os.fdopen(int(sys.argv[1]), "w", buffering=1)
spec = json.loads(sys.stdin.read())  # on stdin, not in a file the solution could rewrite for a restart
sys.stdin = open(os.devnull)
start = int(sys.argv[2])
_type, _isinstance, _len, _repr = type, isinstance, len, repr
PLAIN = (int, float, complex, str, bytes, bool, type(None))
def plain(v, depth=0):
    t = _type(v)
    if t in PLAIN:
        return True
    if depth > 50:
        return False
    if t in (list, tuple, set, frozenset):
        return all(plain(x, depth + 1) for x in v)
    if t is dict:
        return all(plain(k, depth + 1) and plain(x, depth + 1) for k, x in v.items())
    return False
saved = dict(builtins.__dict__)
def restore():
    if builtins.__dict__ != saved:
        builtins.__dict__.clear()
        builtins.__dict__.update(saved)
def guard(fn):
    def guarded(*args, **kwargs):
        value = fn(*args, **kwargs)
        restore()
        if not plain(value):
            raise AssertionError("returned a %s: only plain built-in values can be checked" % _type(value).__name__)
        return value
    return guarded
def tag(v):
    t = _type(v)
    if t is float:
        return {"f": _repr(v)}
    if t in (tuple, set, frozenset):
        return {t.__name__: [tag(x) for x in (sorted(v, key=_repr) if t is not tuple else v)]}
    if t is list:
        return [tag(x) for x in v]
    if t is dict:
        return {"dict": [[tag(k), tag(x)] for k, x in v.items()]}
    if t is bytes:
        return {"bytes": v.decode("latin-1")}
    if t is complex:
        return {"complex": [_repr(v.real), _repr(v.imag)]}
    return v
def report(i, status, payload=None):
    out.write(json.dumps([i, status, payload]) + "\n")
g = {"__name__": "__main__" if spec["kind"] == "assert" else "solution", "__builtins__": builtins}
sys.argv = ["solution.py"]
sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
exec(compile(open("solution.py").read(), "solution.py", "exec"), g)
restore()
if spec["kind"] != "call":
    exec(compile(spec["prelude"], "test_prelude.py", "exec"), g)
    for name in spec["guard"]:
        if callable(g.get(name)):
            g[name] = guard(g[name])
    if spec.get("entry_point"):
        g["candidate"] = g.get(spec["entry_point"])
    restore()
report(-3, "loaded")
if spec["kind"] == "call":
    name = spec["fn_name"]
    fn = g.get(name)
    if fn is None and _isinstance(g.get("Solution"), _type):
        fn = getattr(g["Solution"](), name, None)
    if fn is None:
        raise NameError("the solution defines no function %r" % name)
    fn = guard(fn)
    for i, args in enumerate(spec["inputs"]):
        if i < start:
            continue
        try:
            value = fn(*args) if _isinstance(args, list) else fn(args)
            report(i, "ok", tag(value))
        except BaseException as e:
            restore()
            report(i, "error", "%s: %s" % (_type(e).__name__, str(e)[:300]))
else:
    for i, (code, is_case) in enumerate(spec["statements"]):
        if i < start and is_case:
            continue
        try:
            exec(compile(code, "test.py", "exec"), g)
            restore()
            if is_case:
                report(i, "pass")
        except BaseException as e:
            restore()
            if not is_case:
                raise
            report(i, "fail", "%s: %s" % (_type(e).__name__, str(e)[:300]))
"""

def read_capped(proc, cap, deadline):
    """stdout of a process, cut at `cap` bytes (it is killed then), until it exits or `deadline`."""
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
    for i, stdin in enumerate(spec["inputs"]):
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
        err = b""
        if proc.stderr:
            r, _, _ = select.select([proc.stderr.fileno()], [], [], 0)
            err = os.read(proc.stderr.fileno(), 4096) if r else b""
        results.append({"status": problem or ("ok" if proc.returncode == 0 else "error"),
                        "exit_code": proc.returncode, "stdout": out.decode("utf-8", "replace"),
                        "stderr": err.decode("utf-8", "replace")[-1000:], "time_s": time.monotonic() - t0})
        if proc.stdout:
            proc.stdout.close()
        if proc.stderr:
            proc.stderr.close()
    return results

def run_runner(spec, python, end):
    """call / assert cases through the runner, restarted after a case that hangs or kills it."""
    if spec["kind"] == "assert":
        cases = [i for i, (_, is_case) in enumerate(spec["statements"]) if is_case]
    else:
        cases = list(range(len(spec["inputs"])))
    payload = json.dumps(spec).encode()
    results = {}
    start = 0
    while time.monotonic() < end:
        pending = [c for c in cases if c >= start and c not in results]
        if not pending:
            break
        r_fd, w_fd = os.pipe()
        proc = subprocess.Popen([python, "-c", RUNNER, str(w_fd), str(start)], pass_fds=(w_fd,),
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True)
        os.close(w_fd)
        try:
            proc.stdin.write(payload)
            proc.stdin.close()
        except BrokenPipeError:
            pass
        buf, loaded, ended = b"", False, None
        deadline = min(time.monotonic() + spec["case_timeout_s"] + 2.0, end)  # + start-up and imports
        while pending:
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
            buf += chunk
            while b"\n" in buf:
                line, _, buf = buf.partition(b"\n")
                i, status, value = json.loads(line)
                if i == -3:
                    loaded = True
                elif i >= 0 and i not in results:
                    results[i] = {"status": status, "value" if status == "ok" else "error": value}
                deadline = min(time.monotonic() + spec["case_timeout_s"], end)
            pending = [c for c in pending if c not in results]
        os.close(r_fd)
        kill(proc)
        err = proc.stderr.read()[-2000:].decode("utf-8", "replace") if proc.stderr else ""
        proc.stderr.close()
        if not pending:
            break
        reason = (err.strip().splitlines() or [ended or "stopped"])[-1][:300]
        if not loaded:  # the solution does not even load (syntax error, exit or hang at import)
            for c in pending:
                results[c] = {"status": "error" if ended == "crash" else ended, "error": reason}
            break
        results[pending[0]] = {"status": ended, "error": reason}  # lost to a hang or an exit: restart after it
        start = pending[0] + 1
    return [results.get(i, {"status": "not_run"}) for i in cases]

spec = json.loads(sys.stdin.read())
end = time.monotonic() + spec["total_timeout_s"]
python = sys.executable
results = run_stdio(spec, python, end) if spec["kind"] == "stdio" else run_runner(spec, python, end)
sys.stdout.write("\n" + json.dumps({"results": results}) + "\n")
'''
