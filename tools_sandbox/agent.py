"""The in-container runner of `DockerSandbox` (stdlib only; run as PID 1 of each pooled container).

Protocol, over the container's attached stdin/stdout: one JSON object per line each way. The agent
announces `{"ready": true}`, then for each request `{"id", "argv", "files": {path: base64}, "stdin":
base64, "timeout_s", "memory_bytes", "cpu_s", "fsize_bytes", "nofile", "output_limit"}` it runs `argv` in
a fresh /work/run-<id> and answers `{"id", "exit_code", "stdout", "stderr", "timed_out",
"output_exceeded", "oom", "duration_s"}`. A line `{"abort": id}` while a run is going kills it.
With `"inline": true` (Python, when the agent is the same interpreter the run would exec) the forked child
runs the file itself, as `python -s -u FILE` would, instead of exec-ing a new interpreter: no start-up
cost. Each run is still a fresh fork of the agent, which never runs untrusted code, so no module state,
environment or file of one run is seen by the next.

Why it is safe to reuse a container: the agent is PID 1 of the container's pid namespace, so no
process inside can kill it (the kernel drops signals to a namespace's init that it has no handler
for), it is not dumpable (so no process of the same uid may ptrace it or open its /proc files), and
after every run it SIGKILLs every other process (`kill(-1)`), reaps them, wipes /work, /tmp and /dev/shm,
and removes the System V IPC objects the run created. The root filesystem is read-only; nothing else
persists between runs. (`BwrapSandbox(fork_server=True)` runs the same agent inside a long-lived
bubblewrap sandbox per slot.)
"""

AGENT_SOURCE = (r'''
import base64, ctypes, json, os, select, shutil, signal, sys, time, resource
import atexit, builtins, io, threading, traceback, types  # what an inline run needs: imported once, before forks
signal.signal(signal.SIGINT, signal.SIG_DFL)
try:
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 0
except Exception:
    pass
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
       "PYTHONHASHSEED": "0"}
out = os.fdopen(1, "w", buffering=1)
pending = b""

def send(obj):
    out.write(json.dumps(obj) + "\n")

def read_line(timeout):
    global pending
    end = None if timeout is None else time.monotonic() + timeout
    while b"\n" not in pending:
        wait = None if end is None else max(0.0, end - time.monotonic())
        r, _, _ = select.select([0], [], [], wait)
        if not r:
            return None
        chunk = os.read(0, 65536)
        if not chunk:
            sys.exit(0)
        pending += chunk
    line, _, pending = pending.partition(b"\n")
    return json.loads(line)

def oom_count():
    for path, key in (("/sys/fs/cgroup/memory.events", "oom_kill"), '''  # the agent's line goes on below
                      r'''("/sys/fs/cgroup/memory/memory.oom_control", "oom_kill")):
        try:
            for line in open(path):
                k, _, v = line.partition(" ")
                if k == key:
                    return int(v)
        except (OSError, ValueError):
            pass
    return 0

def wipe(path):
    try:
        names = os.listdir(path)
    except OSError:
        return
    for name in names:
        p = os.path.join(path, name)
        try:
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                os.unlink(p)
        except OSError:
            pass

def remove_ipc():
    """System V shared memory, semaphores and message queues outlive processes: remove what a run made."""
    libc = ctypes.CDLL(None, use_errno=True)
    for kind, ctl in (("shm", libc.shmctl), ("sem", libc.semctl), ("msg", libc.msgctl)):
        try:
            lines = open("/proc/sysvipc/" + kind).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            try:
                ident = int(line.split()[1])
                if kind == "sem":
                    ctl(ident, 0, 0)  # IPC_RMID
                else:
                    ctl(ident, 0, None)  # IPC_RMID
            except (ValueError, IndexError, OSError):
                pass

def exit_code(e):
    code = e.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        sys.stderr.write(str(code) + "\n")
    except Exception:
        pass
    return 1

def run_inline(path):
    """In the forked child: run `path` as `python -s -u path` runs a script, then exit."""
    sys.argv = [path]  # as given on the command line
    path = os.path.abspath(path)
    sys.path[0] = os.path.dirname(path)
    main = types.ModuleType("__main__")
    main.__file__, main.__cached__, main.__builtins__ = path, None, builtins
    sys.modules["__main__"] = main
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8")
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8",
                                                   write_through=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                                   errors="backslashreplace", write_through=True)
    code = 0
    try:
        with open(path, "rb") as f:
            source = f.read()
        exec(compile(source, path, "exec"), main.__dict__)
    except SystemExit as e:
        code = exit_code(e)
    except BaseException as e:
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None  # not this runner's frame
        traceback.print_exception(type(e), e, tb)
        code = 1
    try:
        threading._shutdown()  # like interpreter exit: wait for non-daemon threads, then atexit handlers
        atexit._run_exitfuncs()
    except SystemExit as e:
        code = exit_code(e)
    except BaseException:
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)

def kill_all():
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        pass
    end = time.monotonic() + 5
    while time.monotonic() < end:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.001)

def run(req):
    rid = req["id"]
    work = "/work/run-%s" % rid
    os.mkdir(work, 0o700)
    for path, b64 in req["files"].items():
        full = os.path.join(work, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "wb") as f:
            f.write(base64.b64decode(b64))
    stdin_path = "/tmp/.stdin-%s" % rid
    with open(stdin_path, "wb") as f:
        f.write(base64.b64decode(req["stdin"]))
    o_r, o_w = os.pipe()
    e_r, e_w = os.pipe()
    oom_before = oom_count()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            os.chdir(work)
            fd = os.open(stdin_path, os.O_RDONLY)
            os.unlink(stdin_path)  # open already: /tmp is the run's own, empty, as in a fresh sandbox
            os.dup2(fd, 0); os.dup2(o_w, 1); os.dup2(e_w, 2)
            os.closerange(3, 65536)
            try:
                with open("/proc/self/oom_score_adj", "w") as f:
                    f.write("1000")  # the OOM killer takes the code, never the agent
            except OSError:
                pass
            mem = req["memory_bytes"]
            resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
            resource.setrlimit(resource.RLIMIT_CPU, (req["cpu_s"], req["cpu_s"] + 1))
            resource.setrlimit(resource.RLIMIT_FSIZE, (req["fsize_bytes"], req["fsize_bytes"]))
            resource.setrlimit(resource.RLIMIT_NOFILE, (req["nofile"], req["nofile"]))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            if req.get("nproc"):
                resource.setrlimit(resource.RLIMIT_NPROC, (req["nproc"], req["nproc"]))
            if req.get("inline"):
                try:  # a normal process again (its own /proc files readable); the agent stays undumpable
                    ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)
                except Exception:
                    pass
                os.environ.clear()
                os.environ.update(ENV, HOME=work)
                run_inline(req["argv"][-1])  # never returns
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
            signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
            os.execve(req["argv"][0], req["argv"], dict(ENV, HOME=work))
        except BaseException as e:
            os.write(2, ("sandbox agent: cannot start %r: %r\n" % (req["argv"][0], e)).encode())
        os._exit(127)
    os.close(o_w); os.close(e_w)
    try:
        exit_fd = [os.pidfd_open(pid)]  # readable when the child exits: no polling delay after its pipes close
    except (AttributeError, OSError):
        exit_fd = []
    bufs = {o_r: bytearray(), e_r: bytearray()}
    open_fds = [o_r, e_r]
    limit = req["output_limit"]
    deadline = t0 + req["timeout_s"]
    timed_out = exceeded = aborted = False
    status = None
    while status is None:
        wait = deadline - time.monotonic()
        if wait <= 0:
            timed_out = True
            break
        r, _, _ = select.select(open_fds + exit_fd + [0], [], [], min(wait, 0.05 if exit_fd else 0.005))
        for fd in r:
            if fd in exit_fd:
                continue
            if fd == 0:
                msg = read_line(0)
                if msg and msg.get("abort") == rid:
                    aborted = True
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                open_fds.remove(fd)
                continue
            room = limit - len(bufs[o_r]) - len(bufs[e_r])
            bufs[fd] += chunk[:max(room, 0)]
            if len(chunk) > room:
                exceeded = True
        if exceeded or aborted:
            break
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = st
    duration = time.monotonic() - t0
    if status is None:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        _, status = os.waitpid(pid, 0)
    kill_all()  # whatever the run left behind: background processes, daemons
    for fd in open_fds:
        while True:
            r, _, _ = select.select([fd], [], [], 0.2)
            if not r:
                break
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            room = limit - len(bufs[o_r]) - len(bufs[e_r])
            bufs[fd] += chunk[:max(room, 0)]
            if len(chunk) > room:
                exceeded = True
                break
    os.close(o_r); os.close(e_r)
    for fd in exit_fd:
        os.close(fd)
    code = os.waitstatus_to_exitcode(status)
    oom = oom_count() > oom_before
    for d in ("/work", "/tmp", "/dev/shm"):
        wipe(d)
    remove_ipc()
    return {"id": rid, "exit_code": None if (timed_out or aborted) else code,
            "stdout": bufs[o_r].decode("utf-8", "replace"), "stderr": bufs[e_r].decode("utf-8", "replace"),
            "timed_out": timed_out, "output_exceeded": exceeded, "oom": oom, "aborted": aborted,
            "duration_s": duration}

send({"ready": True})
while True:
    req = read_line(None)
    if req is None or "abort" in req:
        continue  # an abort for a run that already ended
    try:
        send(run(req))
    except Exception as e:
        kill_all()
        send({"id": req.get("id"), "error": "%s: %s" % (type(e).__name__, e)})
''')
