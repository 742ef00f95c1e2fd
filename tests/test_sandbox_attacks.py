"""The attack suite: hostile code against every sandbox backend available (real Docker, real bubblewrap).

Each attack must be contained, bounded in time, reported with the right status, and leave nothing
behind. `ProcessSandbox` is not isolation and is exempt from the isolation cases (network, host
files, writes outside the work dir, killing the parent); it still must bound time, memory and output.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
import uuid

import pytest

from sandbox_support import ISOLATING, make_sandbox, per_backend_fixtures

CHECKOUT_FILE = os.path.abspath(__file__)


sandboxes, sb = per_backend_fixtures()


def isolating(sb):
    if sb.backend not in ISOLATING:
        pytest.skip("ProcessSandbox is not isolation (documented); exempt from this case")


def processes_with(marker: str) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry.name))
            except OSError:
                pass
    return found


def run(runner, sb, code, **kw):
    t0 = time.monotonic()
    result = runner.run(sb.run(code, **kw))
    return result, time.monotonic() - t0


# --- isolation ------------------------------------------------------------------------------------

def test_tcp_egress_reaches_nothing(runner, sb):
    isolating(sb)
    server = socket.socket()
    server.bind(("0.0.0.0", 0))
    server.listen(8)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    accepted = []

    def accept():
        end = time.monotonic() + 8
        while time.monotonic() < end:
            try:
                accepted.append(server.accept())
            except OSError:
                pass

    t = threading.Thread(target=accept)
    t.start()
    host_ips = {"127.0.0.1", "172.17.0.1", "1.1.1.1"}
    try:
        host_ips.add(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    code = f"""
import socket
ok = []
for ip in {sorted(host_ips)!r}:
    try:
        socket.create_connection((ip, {port}), timeout=2).close(); ok.append(ip)
    except OSError as e:
        print(ip, type(e).__name__, e)
print("CONNECTED", ok)
"""
    result, took = run(runner, sb, code, timeout_s=20)
    t.join()
    server.close()
    assert result.status == "ok", result
    assert "CONNECTED []" in result.stdout
    assert accepted == [], "a sandboxed run reached a host port"


def test_dns_does_not_resolve(runner, sb):
    isolating(sb)
    result, _ = run(runner, sb, "import socket\ntry:\n socket.getaddrinfo('pypi.org', 443)\n print('RESOLVED')\n"
                                "except OSError as e:\n print('FAILED', e)")
    assert result.status == "ok" and "FAILED" in result.stdout and "RESOLVED" not in result.stdout


# "{pid}": this process's environment, filled in when the test runs (a pid in the test's id would differ between
# xdist's workers, which must collect the same ids)
@pytest.mark.parametrize("path", ["/etc/shadow", "/etc/passwd", CHECKOUT_FILE, "/proc/{pid}/environ", "/root/.bashrc"])
def test_host_files_are_not_readable(runner, sb, path):
    isolating(sb)
    path = path.format(pid=os.getpid())
    result, _ = run(runner, sb, f"print(open({path!r}, 'rb').read()[:100])")
    assert result.status == "error", result
    assert ("No such file" in result.stderr or "Permission denied" in result.stderr), result.stderr


def test_secrets_in_environment_do_not_leak(runner, sb):
    # Every backend scrubs the environment, the process backend included.
    os.environ["SLIME_TEST_SECRET_TOKEN"] = secret = uuid.uuid4().hex
    try:
        result, _ = run(runner, sb, "import os\nprint(sorted(os.environ.items()))\n"
                                    "print(open('/proc/self/environ','rb').read())")
    finally:
        del os.environ["SLIME_TEST_SECRET_TOKEN"]
    assert result.status == "ok", result
    assert secret not in result.stdout and "SLIME_TEST_SECRET_TOKEN" not in result.stdout


@pytest.mark.parametrize("target", ["/usr/pwned", "/etc/pwned", os.path.dirname(CHECKOUT_FILE) + "/pwned", "/pwned"])
def test_writes_outside_the_work_dir_fail(runner, sb, target):
    isolating(sb)
    result, _ = run(runner, sb, f"open({target!r}, 'w').write('x')")
    assert result.status == "error"
    assert any(m in result.stderr for m in ("Read-only file system", "Permission denied", "No such file"))
    assert not os.path.exists(target)


def test_private_tmp_does_not_reach_the_host(runner, sb):
    isolating(sb)
    name = f"/tmp/slime_env_probe_{uuid.uuid4().hex}"
    result, _ = run(runner, sb, f"open({name!r}, 'w').write('x'); print('wrote')")
    assert result.status == "ok" and "wrote" in result.stdout
    assert not os.path.exists(name)


def test_killing_the_parent_is_contained(runner, sb):
    isolating(sb)
    code = "import os, signal\nfor pid in (os.getppid(), 1, -1):\n    try:\n        os.kill(pid, signal.SIGKILL)\n" \
           "    except OSError as e:\n        print(pid, e)\nprint('survived')"
    result, took = run(runner, sb, code, timeout_s=5)
    assert took < 10
    assert result.status in ("ok", "error"), result
    again, _ = run(runner, sb, "print(6 * 7)")  # the sandbox still works afterwards
    assert again.status == "ok" and again.stdout.strip() == "42"


# --- resources --------------------------------------------------------------------------------------

def test_fork_bomb_is_contained(runner, sb):
    marker = f"forkbomb{uuid.uuid4().hex[:8]}"
    code = (f"import os, time\n# {marker}\nwhile True:\n    try:\n        os.fork()\n"
            "    except OSError:\n        time.sleep(0.01)")
    result, took = run(runner, sb, code, timeout_s=3)
    assert result.status in ("timeout", "error"), result
    assert took < 15
    time.sleep(0.5)
    assert processes_with(marker) == [] or not any(os.path.exists(f"/proc/{p}") for p in processes_with(marker))
    again, _ = run(runner, sb, "print('alive')")
    assert again.status == "ok"


@pytest.mark.parametrize("code", ["x = bytearray(4 << 30)",
                                  "a = []\nwhile True:\n    a.append(bytearray(16 << 20))"])
def test_memory_bomb_reports_memory(runner, sb, code):
    result, took = run(runner, sb, code, memory_mb=256, timeout_s=20)
    assert result.status == "memory", result
    assert took < 20


def test_infinite_loop_times_out(runner, sb):
    result, took = run(runner, sb, "while True:\n    pass", timeout_s=1.5)
    assert result.status == "timeout" and result.exit_code is None
    assert 1.4 < took < 6


def test_cpu_spin_in_threads_times_out(runner, sb):
    code = "import threading\ndef spin():\n    while True: pass\n" \
           "ts = [threading.Thread(target=spin) for _ in range(8)]\n[t.start() for t in ts]\n[t.join() for t in ts]"
    result, took = run(runner, sb, code, timeout_s=2)
    assert result.status == "timeout", result
    assert took < 7


def test_huge_output_is_cut(runner, sb):
    result, took = run(runner, sb,
                       "import sys\nchunk = 'y' * (1 << 20)\nfor _ in range(100):\n    sys.stdout.write(chunk)",
                       output_limit_bytes=1 << 20, timeout_s=30)
    assert result.status == "output_limit" and result.truncated
    assert len(result.stdout.encode()) + len(result.stderr.encode()) <= 1 << 20
    assert took < 10


def test_sleeping_past_the_timeout(runner, sb):
    result, took = run(runner, sb, "import time\ntime.sleep(60)", timeout_s=1)
    assert result.status == "timeout"
    assert took < 5


def test_background_processes_do_not_survive(runner, sb):
    isolating(sb)  # the process backend kills its process group; a new session escapes it (documented)
    marker = f"{uuid.uuid4().int % 10**6}.{uuid.uuid4().int % 10**3}"
    code = f"""
import os, subprocess
subprocess.Popen(["sleep", "{marker}"], start_new_session=True)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execvp("sleep", ["sleep", "{marker}"])
    os._exit(0)
print("spawned")
"""
    result, _ = run(runner, sb, code)
    assert result.status == "ok" and "spawned" in result.stdout
    deadline = time.monotonic() + 3
    while processes_with(f"sleep\0{marker}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with(f"sleep\0{marker}") == []


def test_process_sandbox_kills_its_process_group(runner, sandboxes):
    sb = sandboxes.get("process") or sandboxes.setdefault("process", make_sandbox("process"))
    marker = f"{uuid.uuid4().int % 10**6}.{uuid.uuid4().int % 10**3}"
    result, _ = run(runner, sb, f"import subprocess\nsubprocess.Popen(['sleep', '{marker}'])\nprint('spawned')")
    assert result.status == "ok"
    deadline = time.monotonic() + 3
    while processes_with(f"sleep\0{marker}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with(f"sleep\0{marker}") == []


# --- two sandboxes on one host ----------------------------------------------------------------------

_SPRAY = """import glob, os, time
end = time.time() + {seconds}
while time.time() < end:
    for path in glob.glob("/proc/*/fd/*"):  # every pipe it can open: its own, and any other run's of its uid
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            os.write(fd, b"FORGED\\n")
        except OSError:
            pass
        os.close(fd)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="runs get uids of their own only as root (otherwise they keep ours)")
def test_a_run_of_one_sandbox_cannot_write_into_another_sandboxs_runs(runner):
    """Two process sandboxes of one host (two rollout workers, say): each numbered its slots' uids from the same
    base, so slot 0 of both ran as one uid, and a solution could open the other run's stdout through /proc and
    write forged report lines into it. Leased machine-wide, the uids differ, and the other run's output is its
    own."""
    from slime_env.tools_sandbox.local_exec import Slots

    a, b = Slots(2, 62000), Slots(2, 62000)
    try:
        uids_a, uids_b = {a.acquire()[1] for _ in range(2)}, {b.acquire()[1] for _ in range(2)}
        assert len(uids_a) == len(uids_b) == 2 and not uids_a & uids_b
    finally:
        a.close()
    c = Slots(1, 62000)  # a closed sandbox's uids go back to the host
    try:
        assert c.acquire()[1] in uids_a
    finally:
        c.close()
        b.close()

    attacker, victim = make_sandbox("process"), make_sandbox("process")

    async def main():
        spray = asyncio.ensure_future(attacker.run(_SPRAY.format(seconds=4), timeout_s=30))
        await asyncio.sleep(0.5)
        outs = []
        for i in range(20):  # each run reads its own stdin slowly, so its pipes stay open while the spray runs
            r = await victim.run("import sys, time\ntime.sleep(0.1)\nprint(sys.stdin.read().strip())", stdin=f"n{i}")
            outs.append((r.status, r.stdout))
        await spray
        return outs

    try:
        outs = runner.run(main())
    finally:
        runner.run(attacker.close())
        runner.run(victim.close())
    assert outs == [("ok", f"n{i}\n") for i in range(20)]
