"""The sandbox interface on every backend: statuses, stdin and files, languages, limits, deadlines,
concurrency, cancellation, 1,000 runs without leaks; the SandboxFusion server and RemoteSandbox; auto()."""

from __future__ import annotations

import asyncio
import base64
import glob
import os
import time

import aiohttp
import pytest

from slime_env.errors import InvalidInput
from helpers import LocalServer
from sandbox_support import IMAGE, make_sandbox, per_backend_fixtures
from slime_env.tools_sandbox import ExecResult, auto
from slime_env.tools_sandbox.fusion import from_response, to_response
from slime_env.tools_sandbox.remote import RemoteSandbox
from slime_env.tools_sandbox.server import make_app


sandboxes, sb = per_backend_fixtures(max_concurrency=4, pool_size=4)


def test_ok_error_stdin_and_files(runner, sb):
    code = "import sys, json\nfrom helper import double\ndata = json.load(open('data/in.json'))\n" \
           "print(double(int(sys.stdin.read())) + data['add'])\nprint('warn', file=sys.stderr)"
    result = runner.run(sb.run(code, stdin="20", files={"helper.py": "def double(x):\n    return 2 * x\n",
                                                        "data/in.json": b'{"add": 2}'}))
    assert result.status == "ok" and result.exit_code == 0, result
    assert result.stdout == "42\n" and result.stderr == "warn\n"
    assert result.backend == sb.backend and result.duration_s > 0
    failed = runner.run(sb.run("raise ValueError('boom')"))
    assert failed.status == "error" and failed.exit_code == 1 and "ValueError: boom" in failed.stderr
    exited = runner.run(sb.run("import sys; sys.exit(7)"))
    assert exited.status == "error" and exited.exit_code == 7


def test_shell_language(runner, sb):
    result = runner.run(sb.run("echo hello; read x; echo got $x; exit 3", "shell", stdin="abc\n"))
    assert result.status == "error" and result.exit_code == 3
    assert result.stdout == "hello\ngot abc\n"


def test_each_run_starts_clean(runner, sb):
    first = runner.run(sb.run("open('left.txt', 'w').write('x'); import os; print(sorted(os.listdir('.')))"))
    second = runner.run(sb.run("import os; print(sorted(os.listdir('.')))"))
    assert first.status == second.status == "ok"
    assert "left.txt" in first.stdout and "left.txt" not in second.stdout


def test_bad_arguments_raise_naming_the_field(runner, sb):
    with pytest.raises(InvalidInput, match="unknown language 'cobol'"):
        runner.run(sb.run("x", "cobol"))
    with pytest.raises(InvalidInput, match=r"'\.\./escape\.py' must be a relative path"):
        runner.run(sb.run("x", files={"../escape.py": "x"}))
    with pytest.raises(InvalidInput, match="timeout_s"):
        runner.run(sb.run("x", timeout_s=-1))


def test_concurrency_cap_and_deadline(runner, sb):
    async def main():
        peak = 0

        async def watch():
            nonlocal peak
            while True:
                peak = max(peak, sb.live)
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch())
        t0 = time.monotonic()
        results = await asyncio.gather(*(sb.run("import time; time.sleep(0.3)") for _ in range(8)))
        took = time.monotonic() - t0
        # With 4 slots and 8 runs of 2 s, a 3 s deadline leaves the queued ones waiting past it, while the first
        # four have a second to spare for starting (a 0.3 s run under a 0.45 s deadline timed out on a busy machine)
        late = await asyncio.gather(*(sb.run("import time; time.sleep(2)", deadline_s=3.0) for _ in range(8)))
        watcher.cancel()
        return peak, took, results, late

    peak, took, results, late = runner.run(main())
    assert peak == 4
    assert all(r.status == "ok" for r in results)
    assert took >= 0.6  # two waves
    statuses = sorted(r.status for r in late)
    assert statuses.count("ok") >= 2 and statuses.count("timeout") >= 2, statuses
    assert all("deadline" in r.reason for r in late if r.status == "timeout")


def test_thousand_runs_leave_nothing_behind(runner, sb):
    """1,000 runs, every tenth cancelled mid-execution: no container, process, temp dir or fd left."""
    marker = "leakprobe"

    def snapshot():
        procs = 0
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                        procs += marker.encode() in f.read()
                except OSError:
                    pass
        return (len(os.listdir("/proc/self/fd")), len(glob.glob("/tmp/slime_env-run-*")), procs)

    async def stop_fork_servers():
        # The fork server's idle sandboxes hold their pipes on purpose: both snapshots are taken without them.
        fork = getattr(sb, "_fork", None)
        if fork is not None:
            await fork.close()

    async def one(i):
        if i % 10 == 0:
            task = asyncio.ensure_future(sb.run(f"import time  # {marker}\ntime.sleep(30)"))
            await asyncio.sleep(0.15)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                if not task.cancelled():
                    raise  # this task itself was cancelled, not the run
                return None
            raise AssertionError("a cancelled run returned normally")
        return await sb.run(f"print({i})  # {marker}")

    async def main():
        async with asyncio.timeout(60):
            await sb.run("print('warm')")
        await stop_fork_servers()
        before = snapshot()
        sem = asyncio.Semaphore(8)

        async def limited(i):
            async with sem:
                return await one(i)

        tasks = [asyncio.ensure_future(limited(i)) for i in range(1000)]
        pending: set = set(tasks)
        while pending:  # a slow machine may take long; no run finishing for 60 s is a hang
            done, pending = await asyncio.wait(pending, timeout=60)
            if not done:
                break
        if pending:  # a hang here is a bug: fail with the state of every task, not a CI timeout
            import io

            state = {"live": sb.live, "idle": getattr(getattr(sb, "_idle", None), "qsize", lambda: None)(),
                     "containers": len(getattr(sb, "_all", ())), "replaced": getattr(sb, "replaced", None),
                     "pending": len(pending)}
            stacks = io.StringIO()
            for t in [t for t in asyncio.all_tasks() if "Sandbox.run" in repr(t)][:4]:
                coro = t.get_coro()
                while coro is not None:  # the whole await chain (Task.print_stack shows only the outer frame)
                    frame = getattr(coro, "cr_frame", None)
                    if frame is not None:
                        print(f"  {frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}", file=stacks)
                    coro = getattr(coro, "cr_await", None)
                print("--", file=stacks)
            for t in pending:
                t.cancel()
            pytest.fail(f"no run of the 1,000 finished in 60 s on {sb.backend}: {state}\n{stacks.getvalue()}")
        results = [t.result() for t in tasks]
        await asyncio.sleep(0.5 if sb.backend != "docker" else 3.5)  # docker: cancelled runs are recovered
        await stop_fork_servers()
        return before, results

    before, results = runner.run(main())
    done = [(i, r) for i, r in enumerate(results) if r is not None]
    assert len(done) == 900
    assert all(r.status == "ok" and r.stdout == f"{i}\n" for i, r in done)
    deadline = time.monotonic() + 5
    while snapshot()[2] and time.monotonic() < deadline:
        time.sleep(0.1)
    after = snapshot()
    assert after[1] == before[1], "temp dirs left behind"
    assert after[2] == 0, "sandboxed processes left behind"
    # The docker SDK keeps up to 10 pooled connections to the engine (used from worker threads): not a leak.
    slack = 2 + (10 if sb.backend == "docker" else 0)
    assert after[0] <= before[0] + slack, f"fds leaked: {before[0]} -> {after[0]}"
    if sb.backend == "docker":
        import docker

        labelled = docker.from_env().containers.list(all=True, filters={"label": "slime_env.sandbox"},
                                                 sparse=True)
        assert len([c for c in labelled if c.id in {b.container.id for b in sb._all}]) == sb.pool_size
        assert sb._idle.qsize() == sb.pool_size  # every container came back to the pool


def test_docker_pool_replaces_a_stuck_container_and_cleans_up(runner):
    import docker

    sb = make_sandbox("docker", pool_size=1)
    client = docker.from_env()
    try:
        runner.run(sb.run("print(1)"))
        first = next(iter(sb._all)).container.id
        # A run the agent cannot answer in time: SIGSTOP'd agent (simulates a wedged container).
        client.api.kill(first, signal="SIGSTOP")
        result = runner.run(sb.run("print(2)", timeout_s=1))
        assert result.status == "timeout" and "replaced" in result.reason
        again = runner.run(sb.run("print(3)"))
        assert again.status == "ok" and again.stdout == "3\n"
        assert next(iter(sb._all)).container.id != first and sb.replaced == 1
        ids = [b.container.id for b in sb._all]
    finally:
        runner.run(sb.close())
    assert not client.containers.list(all=True, filters={"id": ids[0]})


def test_cleanup_removes_containers_of_dead_owners():
    import docker

    from slime_env.tools_sandbox import cleanup
    from slime_env.tools_sandbox.docker_pool import LABEL, OWNER_LABEL, cleanup as cleanup_with

    make_sandbox("docker")  # ensures the engine and the image
    client = docker.from_env()
    dead = client.containers.create(IMAGE, command=["true"],
                                    labels={LABEL: "1", OWNER_LABEL: f"{os.uname().nodename}:999999"})
    live = client.containers.create(IMAGE, command=["true"],
                                    labels={LABEL: "1", OWNER_LABEL: f"{os.uname().nodename}:{os.getpid()}"})
    gone = client.containers.create(IMAGE, command=["true"],
                                    labels={LABEL: "1", OWNER_LABEL: f"{os.uname().nodename}:999999"})
    listing = client.api.containers

    def raced(*args, **kwargs):  # another process's cleanup removes a container right after this one lists it
        found = listing(*args, **kwargs)
        client.api.remove_container(gone.id, force=True)
        return found

    client.api.containers = raced
    try:
        assert cleanup_with(client) >= 1  # before: NotFound from inspecting the container removed meanwhile
        client.api.containers = listing
        remaining = {c.id for c in client.containers.list(all=True, filters={"label": LABEL}, sparse=True)}
        assert dead.id not in remaining and gone.id not in remaining and live.id in remaining
        assert cleanup() == 0  # the public call: nothing of a dead owner is left
    finally:
        client.api.containers = listing
        live.remove(force=True)


# --- SandboxFusion server and RemoteSandbox -----------------------------------------------------------

def test_server_speaks_sandboxfusion(runner):
    sandbox = make_sandbox("bwrap", max_concurrency=2)

    async def main():
        async with LocalServer(make_app(sandbox, queue_timeout_s=0.3)) as srv, aiohttp.ClientSession() as http:
            async def post(body):
                async with http.post(f"{srv.url}/run_code", json=body) as r:
                    return r.status, await r.json()

            ok = await post({"code": "import sys; print(open('x.txt').read() + sys.stdin.read())", "language": "python",
                             "stdin": "!", "run_timeout": 5, "memory_limit_MB": -1,
                             "files": {"x.txt": base64.b64encode(b"hi").decode()}, "fetch_files": []})
            tle = await post({"code": "while True: pass", "run_timeout": 0.5})
            bad = await post({"code": 3})
            unknown = await post({"code": "x", "language": "cobol"})
            # Two slots busy for 1 s; a third request queued past 0.3 s gets 503 (its code never ran).
            busy = [asyncio.create_task(post({"code": "import time; time.sleep(1)"})) for _ in range(2)]
            await asyncio.sleep(0.1)
            full = await post({"code": "print(1)"})
            await asyncio.gather(*busy)
            async with http.get(f"{srv.url}/health") as r:
                health = await r.json()
            async with http.get(f"{srv.url}/v1/ping") as r:
                ping = await r.text()
            remote = RemoteSandbox(srv.url)
            rem = await remote.run("print(6*7)")
            rem_mem = await remote.run("x = bytearray(4 << 30)", memory_mb=128)
            await remote.close()
            return ok, tle, bad, unknown, full, health, ping, rem, rem_mem

    ok, tle, bad, unknown, full, health, ping, rem, rem_mem = runner.run(main())
    assert ok == (200, {"status": "Success", "message": "", "compile_result": None,
                        "run_result": {"status": "Finished", "execution_time": ok[1]["run_result"]["execution_time"],
                                       "return_code": 0, "stdout": "hi!\n", "stderr": ""},
                        "files": {}, "slime_env": ok[1]["slime_env"]})
    assert tle[0] == 200 and tle[1]["status"] == "Failed" and tle[1]["run_result"]["status"] == "TimeLimitExceeded"
    assert bad[0] == 400 and "'code'" in bad[1]["message"]
    assert unknown[0] == 400 and "'language'" in unknown[1]["message"]
    assert full[0] == 503 and "queue timeout" in full[1]["message"]
    assert health["backend"] == "bwrap" and health["rejected"] == 1 and ping == "pong"
    assert rem.status == "ok" and rem.stdout == "42\n" and rem.backend == "remote:bwrap"
    assert rem_mem.status == "memory"


def test_fusion_mapping_of_a_plain_sandboxfusion_response():
    # What a real SandboxFusion server returns (no slime_env extension), mapped back to our statuses.
    def answer(status, run_status, code, stderr=""):
        return {"status": status, "message": "", "compile_result": None, "files": {},
                "run_result": {"status": run_status, "execution_time": 0.1, "return_code": code, "stdout": "",
                               "stderr": stderr}}

    kw = {"timeout_s": 1, "memory_mb": 256, "output_limit_bytes": 4096}
    assert from_response(answer("Success", "Finished", 0), **kw).status == "ok"
    assert from_response(answer("Failed", "Finished", 1), **kw).status == "error"
    assert from_response(answer("Failed", "TimeLimitExceeded", None), **kw).status == "timeout"
    assert from_response(answer("Failed", "Finished", 1, "Traceback...\nMemoryError\n"), **kw).status == "memory"
    assert from_response({"status": "SandboxError", "message": "down", "run_result": None},
                         **kw).status == "sandbox_error"
    assert from_response("garbage", **kw).status == "sandbox_error"
    for status in ("ok", "error", "timeout", "memory", "output_limit", "sandbox_error"):
        round_trip = from_response(to_response(ExecResult(status, exit_code=1, reason="r")), **kw)
        assert round_trip.status == status


def test_remote_sandbox_reports_an_unreachable_server(runner):
    remote = RemoteSandbox("http://127.0.0.1:9", max_retries=0)
    result = runner.run(remote.run("print(1)"))
    runner.run(remote.close())
    assert result.status == "sandbox_error" and "connection failed" in result.reason


def test_auto_picks_the_strongest_and_says_why(runner, monkeypatch):
    make_sandbox("docker")  # the image exists (CI: must)
    chosen = auto(shared=False)
    assert chosen.backend == "docker" and chosen.auto_notes == []
    monkeypatch.setenv("SLIME_ENV_SANDBOX", "process")
    assert auto(shared=False).backend == "process"
    skipped = auto(("bwrap", "process"), shared=False, options={"bwrap": {"bwrap": "no-such-bwrap"}})
    assert skipped.backend == "process" and "bwrap" in skipped.auto_notes[0]
    assert auto(("process",)) is auto(("process",))  # shared per configuration
    with pytest.raises(InvalidInput, match="unknown sandbox backend"):
        auto(("vm",), shared=False)
    runner.run(chosen.close())


def test_sandbox_info_names_the_backend_auto_picks_and_times_each(tmp_path):
    """`slime-env sandbox info` says what `auto()` picks here (the docs and the code agree: strongest isolation
    first) and times every backend that works."""
    import subprocess
    import sys

    from slime_env.tools_sandbox.auto import auto

    sandbox = auto(shared=False)
    want = sandbox.backend
    asyncio.run(sandbox.close())
    out = subprocess.run([sys.executable, "-m", "slime_env", "sandbox", "info", "--runs", "2"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"auto() picks: {want} ")
    timed = [line.split()[0] for line in lines if " p50 " in line]
    assert want in timed and "process" in timed
    order = ["docker", "bwrap", "process"]
    skipped = [line.split()[1].rstrip(":") for line in lines if line.startswith("  skipped ")]
    assert skipped == order[:order.index(want)]  # every stronger backend skipped is named with its reason
