"""Workspaces on a real Docker engine and real bubblewrap: commands, files, limits, snapshots, pools, and nothing
left behind — also after the owning process is killed with -9."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from slime_env.tools_sandbox.workspace import Limits, WorkspaceError, WorkspaceSpec
from slime_env.tools_sandbox.workspace.diffs import DiffError
from slime_env.tools_sandbox.workspace.open import open_workspace
from slime_env.tools_sandbox.workspace.pool import WorkspacePool
from slime_env.tools_sandbox.workspace.watchdog import Watchdog
from workspace_support import our_containers, require_backend, workspace_image

BACKENDS = ["docker", "bwrap"]


def _run(coro):
    return asyncio.run(coro)


async def _open(backend: str, **kw) -> object:
    limits = kw.pop("limits", Limits(memory_mb=512, pids=128))
    return await open_workspace(WorkspaceSpec(image=workspace_image(), workdir="/app", limits=limits, **kw),
                                backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_commands_run_with_their_own_streams_exit_codes_cwd_env_users_and_stdin(backend):
    require_backend(backend)

    async def main():
        ws = await _open(backend, env={"GREETING": "hello"})
        try:
            r = await ws.exec("echo out; echo err >&2; exit 3")
            assert (r.status, r.exit_code, r.stdout, r.stderr) == ("error", 3, "out\n", "err\n")
            r = await ws.exec(["sh", "-c", 'echo "$GREETING $EXTRA $(pwd)"'], env={"EXTRA": "x"})
            assert r.ok and r.stdout == "hello x /app\n"
            assert (await ws.exec("pwd", cwd="/tmp")).stdout == "/tmp\n"
            assert (await ws.exec("id -u; id -g", user="nobody")).stdout.split() == ["65534", "65534"]
            assert (await ws.exec("id -u", user=1234)).stdout == "1234\n"
            assert (await ws.exec("tr a-z A-Z", stdin="shout")).stdout == "SHOUT"
            r = await ws.exec(["no-such-program"])
            assert r.status == "error" and r.exit_code == 127 and "no-such-program" in r.stderr
            r = await ws.exec("true", cwd="/no/such/dir")
            assert r.status == "error" and "/no/such/dir" in r.reason
            with pytest.raises(Exception, match="does not exist"):
                await ws.exec("true", user="nosuchuser")
            # the workspace's processes show no host path (bwrap's own command line held its overlay's folders)
            seen = (await ws.exec("cat /proc/[0-9]*/cmdline | tr '\\0' ' '")).stdout
            assert "/.slime_env/agent" in seen and "--bind" not in seen and "/merged" not in seen, seen
            # many commands at once in one workspace
            outs = await asyncio.gather(*(ws.exec(f"sleep 0.2; echo {i}") for i in range(8)))
            assert [o.stdout for o in outs] == [f"{i}\n" for i in range(8)]
        finally:
            await ws.close()

    _run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_timeouts_floods_memory_and_fork_bombs_are_statuses_and_the_workspace_lives_on(backend):
    require_backend(backend)

    async def main():
        ws = await _open(backend, limits=Limits(memory_mb=256, pids=64))
        try:
            t0 = time.monotonic()
            r = await ws.exec("sleep 30 & sleep 30", timeout_s=0.5)
            assert r.status == "timeout" and time.monotonic() - t0 < 10
            r = await ws.exec("yes flood", output_limit_bytes=4096)
            assert r.status == "output_limit" and r.truncated and len(r.stdout) <= 4096
            r = await ws.exec("python3 -c 'b = bytearray(600 << 20); print(len(b))'", timeout_s=60)
            assert r.status == "memory", r
            r = await ws.exec(["bash", "-c", ":(){ :|:& };:"], timeout_s=10)
            assert r.status in ("ok", "error", "timeout")
            # nothing the timed-out, flooding or bombing commands started is still running
            ps = await ws.exec(["ps", "-eo", "comm="])
            assert ps.ok and not {"sleep", "yes", "bash", "python3"} & set(ps.stdout.split()), ps.stdout
            assert (await ws.exec("echo alive")).stdout == "alive\n"
            # detach: a background process outlives its command until kill_processes()
            await ws.exec("sleep 60 >/dev/null 2>&1 &", detach=True)
            assert (await ws.exec("pgrep -c sleep || true")).stdout.strip() == "1"
            assert await ws.kill_processes() >= 1
            assert (await ws.exec("pgrep -c sleep || true")).stdout.strip() == "0"
        finally:
            await ws.close()

    _run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_files_folders_diffs_and_snapshots(backend, tmp_path):
    require_backend(backend)
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "src" / "pkg" / "mod.py").write_text("def f(x):\n    return x < 3\n")
    (tmp_path / "src" / "run.sh").write_text("#!/bin/sh\necho run\n")
    (tmp_path / "src" / "run.sh").chmod(0o755)

    async def main():
        ws = await _open(backend)
        try:
            blob = bytes(range(256)) * 1000
            await ws.write_file("/app/data/blob.bin", blob)
            assert await ws.read_file("data/blob.bin") == blob
            assert [(e.name, e.kind, e.size) for e in await ws.list_dir("/app/data")] == [("blob.bin", "file", 256000)]
            with pytest.raises(FileNotFoundError):
                await ws.read_file("/app/missing.txt")
            with pytest.raises(IsADirectoryError):
                await ws.read_file("/app/data")
            with pytest.raises(NotADirectoryError):
                await ws.list_dir("/app/data/blob.bin")
            await ws.upload(tmp_path / "src", "/app/repo")
            assert (await ws.exec("./run.sh", cwd="/app/repo")).stdout == "run\n"  # modes kept
            changed = await ws.apply_diff(
                "--- a/pkg/mod.py\n+++ b/pkg/mod.py\n@@ -1,2 +1,2 @@\n"
                " def f(x):\n-    return x < 3\n+    return x <= 3\n",
                cwd="/app/repo")
            assert changed == ["pkg/mod.py"]
            assert await ws.read_file("/app/repo/pkg/mod.py") == b"def f(x):\n    return x <= 3\n"
            with pytest.raises(DiffError, match="pkg/mod.py: hunk 1"):
                await ws.apply_diff("--- a/pkg/mod.py\n+++ b/pkg/mod.py\n@@ -1,2 +1,2 @@\n def f(x):\n"
                                    "-    return x > 9\n+    return 0\n", cwd="/app/repo")
            await ws.download("/app/repo", tmp_path / "back")
            assert (tmp_path / "back" / "pkg" / "mod.py").read_text().endswith("x <= 3\n")
            snap = await ws.snapshot()
            await ws.write_file("/app/repo/pkg/mod.py", "broken")
            await ws.exec("rm -rf /app/data")
            await ws.restore(snap)
            assert (await ws.read_file("/app/repo/pkg/mod.py")).endswith(b"x <= 3\n")
            assert await ws.read_file("/app/data/blob.bin") == blob
            assert (await ws.exec("echo after restore")).ok
        finally:
            await ws.close()

    _run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_wall_time_and_disk_limits_kill_the_workspace_with_a_reason(backend):
    require_backend(backend)

    async def main():
        Watchdog.for_loop().disk_interval_s = 0.5
        ws = await _open(backend, limits=Limits(wall_time_s=1.5))
        try:
            await asyncio.sleep(3)
            with pytest.raises(WorkspaceError, match="wall time of 1.5s"):
                await ws.exec("true")
        finally:
            await ws.close()
        ws = await _open(backend, limits=Limits(disk_mb=20))
        try:
            await ws.exec("head -c 60000000 /dev/zero > /app/big", timeout_s=60)
            await asyncio.sleep(3)
            with pytest.raises(WorkspaceError, match="disk limit of 20 MB"):
                await ws.exec("true")
        finally:
            await ws.close()

    _run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_network_unless_asked(backend):
    require_backend(backend)

    async def main():
        ws = await _open(backend)
        try:
            r = await ws.exec("python3 -c \"import socket; socket.create_connection(('1.1.1.1', 53), timeout=3)\"",
                              timeout_s=30)
            assert r.status == "error" and ("unreachable" in r.stderr or "timed out" in r.stderr), r.stderr[-300:]
        finally:
            await ws.close()

    _run(main())


def test_the_allowlist_network_reaches_allowed_hosts_only_through_the_proxy():
    require_backend("docker")
    server = subprocess.Popen([sys.executable, "-m", "http.server", "0", "--bind", "127.0.0.2"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        port = int(server.stdout.readline().split("port ")[1].split()[0])

        async def main():
            ws = await _open("docker", limits=Limits(network="allowlist", allowed_hosts=("127.0.0.2",)))
            try:
                fetch = ("python3 -c \"import urllib.request as u; "
                         "print(u.urlopen('http://{}:{}/', timeout=10).status)\"")
                assert (await ws.exec(fetch.format("127.0.0.2", port), timeout_s=30)).stdout == "200\n"
                refused = await ws.exec(fetch.format("127.0.0.3", port), timeout_s=30)
                assert refused.status == "error" and "403" in refused.stderr
                direct = await ws.exec("python3 -c \"import socket; socket.create_connection(('1.1.1.1', 53), "
                                       "timeout=3)\"", timeout_s=30)
                assert direct.status == "error"
            finally:
                await ws.close()

        _run(main())
    finally:
        server.kill()
        server.wait()


def test_unknown_images_and_bad_specs_are_clear_errors():
    require_backend("docker")
    with pytest.raises(WorkspaceError, match="no-such-image:1.*not on this host"):
        _run(open_workspace(WorkspaceSpec(image="no-such-image:1")))
    with pytest.raises(Exception, match="limits.network"):
        Limits(network="everything")
    with pytest.raises(Exception, match="absolute path"):
        WorkspaceSpec(image="x", workdir="relative")


def test_the_pool_hands_out_warm_workspaces_once_and_closes_what_it_made():
    require_backend("docker")
    run = f"test-pool-{uuid.uuid4().hex[:6]}"

    async def main():
        spec = WorkspaceSpec(image=workspace_image(), workdir="/app")
        pool = WorkspacePool(warm=2, run=run)
        try:
            first = await pool.acquire(spec)
            await first.write_file("/app/used", "yes")
            await pool.release(first)
            for _ in range(100):  # wait for the warm ones
                if len(pool._ready[spec.pool_key()]) == 2:
                    break
                await asyncio.sleep(0.1)
            second = await pool.acquire(spec)
            assert pool.stats["warm_hits"] == 1 and second is not first
            with pytest.raises(FileNotFoundError):  # a used workspace is never handed out again
                await second.read_file("/app/used")
        finally:
            await pool.close()
        assert our_containers(run) == []

    _run(main())


class _FakeWorkspace:
    def __init__(self, spec):
        self.spec, self.closed, self._dead = spec, False, False

    async def close(self):
        self.closed = True


def test_the_pool_sizes_itself_from_the_runs_concurrency_and_waits_for_refills_under_way(monkeypatch):
    """No engine: starts are 20 ms sleeps. A spec asked for once keeps none warm; once it is asked for again, the pool
    keeps as many warm as the run held at once (8) and the second wave waits for those rather than starting 8 more,
    so the third wave of 8 is all warm; an acquire that finds none warm
    waits for a refill under way instead of starting another; `refill_concurrency` caps the refills in flight;
    `warm=2` still wins."""
    import slime_env.tools_sandbox.workspace.pool as pool_module

    seen = []  # refills in flight at each start

    async def fake_open(spec, **kw):
        seen.append(pool._refills)
        await asyncio.sleep(0.02)
        return _FakeWorkspace(spec)

    monkeypatch.setattr(pool_module, "open_workspace", fake_open)
    spec = WorkspaceSpec(image="fake")
    key = spec.pool_key()

    async def wave():
        workspaces = await asyncio.gather(*(pool.acquire(spec) for _ in range(8)))
        for _ in range(200):  # the refills end
            if not pool._starting[key]:
                break
            await asyncio.sleep(0.01)
        return workspaces

    async def main():
        first = await wave()
        assert pool.stats["cold_starts"] == 8 and pool.target(key) == 0 and not pool._ready[key]
        await asyncio.gather(*(pool.release(ws) for ws in first))
        second = await wave()  # asked for again: its 8 start as refills, the wave waits for them, 8 more warm
        assert pool.stats["waited_for_refill"] == 8 and pool.stats["cold_starts"] == 8
        assert pool.target(key) == 8 and len(pool._ready[key]) == 8
        await asyncio.gather(*(pool.release(ws) for ws in second))
        third = await asyncio.gather(*(pool.acquire(spec) for _ in range(8)))
        assert pool.stats["warm_hits"] == 8 and pool.stats["cold_starts"] == 8
        # none warm, refills under way: the next acquire waits for one rather than starting its own
        await asyncio.sleep(0)
        assert pool._refilling[key] and not pool._ready[key]
        fourth = await pool.acquire(spec)
        assert pool.stats["waited_for_refill"] == 9 and pool.stats["cold_starts"] == 8
        await asyncio.gather(*(pool.release(ws) for ws in [*third, fourth]))
        await pool.close()

    pool = pool_module.WorkspacePool(backend="fake")
    _run(main())

    async def capped():
        await asyncio.gather(*(pool.release(ws) for ws in await wave()))
        seen.clear()
        await wave()
        assert max(seen) == 1 and pool.stats["refills"] >= 8  # one refill in flight at most
        await pool.close()

    pool = pool_module.WorkspacePool(backend="fake", refill_concurrency=1)
    _run(capped())

    async def explicit():
        await wave()
        assert pool.target(key) == 2 and len(pool._ready[key]) == 2
        await pool.close()

    pool = pool_module.WorkspacePool(backend="fake", warm=2)
    _run(explicit())


SCRIPT = textwrap.dedent("""
    import asyncio, sys
    from slime_env.tools_sandbox.workspace import WorkspaceSpec
    from slime_env.tools_sandbox.workspace.pool import WorkspacePool

    async def main():
        pool = WorkspacePool(warm=0, run=sys.argv[2], backend=sys.argv[3])
        spec = WorkspaceSpec(image=sys.argv[1])
        workspaces = await asyncio.gather(*(pool.acquire(spec) for _ in range(16)))
        busy = [asyncio.create_task(ws.exec("sleep 600", timeout_s=900)) for ws in workspaces]
        print("open", flush=True)
        await asyncio.gather(*busy)

    asyncio.run(main())
""")


@pytest.mark.parametrize("backend", BACKENDS)
def test_kill_9_of_a_run_with_16_open_workspaces_leaves_nothing_after_the_reaper(backend, tmp_path):
    require_backend(backend)
    from slime_env.tools_sandbox.workspace.bwrap import WORK_PREFIX, work_root

    run = f"test-kill9-{uuid.uuid4().hex[:6]}"
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    proc = subprocess.Popen([sys.executable, "-P", str(script), workspace_image(), run, backend],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line == "open\n", proc.stderr.read()[-2000:] if proc.poll() is not None else line
        if backend == "docker":
            # running: a container whose start failed under load and was retried may still be on its way out
            assert len(our_containers(run, "running")) == 16
        else:
            mine = [d for d in work_root().glob(f"{WORK_PREFIX}*") if run in (d / "owner.json").read_text()]
            assert len(mine) == 16
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

    # a new run of the application: its pool's first acquire reaps what the killed run left
    async def restart():
        pool = WorkspacePool(warm=0, backend=backend)
        try:
            ws = await pool.acquire(WorkspaceSpec(image=workspace_image()))
            await pool.release(ws)
        finally:
            await pool.close()

    _run(restart())
    if backend == "docker":
        assert our_containers(run) == []
    else:
        assert not [d for d in work_root().glob(f"{WORK_PREFIX}*") if (d / "owner.json").exists()
                    and run in (d / "owner.json").read_text()]
        leftover = subprocess.run(["pgrep", "-f", f"{WORK_PREFIX}"], capture_output=True, text=True).stdout.split()
        assert leftover == []  # --die-with-parent: every sandbox died with its owner


def test_the_reaper_races_another_runs_removals_without_failing():
    """`reap()` while another run removes one of the containers it just listed (each run's first acquire reaps): the
    dead owner's containers go, the live one stays, and the call does not fail on the one already gone."""
    require_backend("docker")
    import socket

    from slime_env.tools_sandbox.workspace.docker import LABEL, OWNER_LABEL, RUN_LABEL, docker_client, reap

    client = docker_client()
    run = f"test-reap-race-{uuid.uuid4().hex[:6]}"
    dead_owner = f"{socket.gethostname()}:999999:1"

    def make(owner):
        return client.containers.create(workspace_image(), command=["true"],
                                        labels={LABEL: "1", OWNER_LABEL: owner, RUN_LABEL: run})

    from slime_env.lifeline import owner_id

    dead, gone, live = make(dead_owner), make(dead_owner), make(owner_id())
    listing = client.api.containers

    def raced(*args, **kwargs):  # another run's reaper removes a container right after this one lists it
        found = listing(*args, **kwargs)
        client.api.remove_container(gone.id, force=True)
        return found

    client.api.containers = raced
    try:
        assert reap(client)["containers"] >= 1  # before: NotFound from inspecting the container removed meanwhile
        client.api.containers = listing
        assert our_containers(run) == [live.id]
    finally:
        client.api.containers = listing
        live.remove(force=True)
        dead.remove(force=True) if our_containers(run) else None


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_named_pipe_is_refused_and_never_wedges_the_workspace(backend):
    """read_file and write_file on a FIFO (nobody at the other end): a clear error at once, and the next command is
    answered; before, the agent's one loop waited in open() and the workspace was dead."""
    require_backend(backend)

    async def main():
        ws = await _open(backend)
        try:
            assert (await ws.exec("mkfifo /app/pipe && ls -l /app/pipe")).stdout.startswith("p")
            with pytest.raises(OSError, match="not a regular file"):
                await asyncio.wait_for(ws.read_file("/app/pipe"), 120)
            with pytest.raises(OSError, match="not a regular file"):
                await asyncio.wait_for(ws.write_file("/app/pipe", "x"), 120)
            # a reader at the other end now (in the background, kept after the command by detach)
            await ws.exec("sleep 30 < /app/pipe > /dev/null 2>&1 &", detach=True)
            await asyncio.sleep(0.5)
            with pytest.raises(OSError, match="not a regular file"):
                await asyncio.wait_for(ws.write_file("/app/pipe", "x"), 120)
            assert (await asyncio.wait_for(ws.exec("echo alive"), 120)).stdout == "alive\n"
            await ws.write_file("/app/file.txt", "new")  # regular files as before: created, then truncated
            await ws.write_file("/app/file.txt", "ok")
            assert await ws.read_file("/app/file.txt") == b"ok"
        finally:
            await ws.close()

    _run(main())
