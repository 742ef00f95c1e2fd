"""`slime_env.lifeline`: a child started with the lifeline dies when its parent is killed with SIGKILL, and `reap`
kills the processes of a run label whose owner is gone, never those of a live owner. Real processes, real signals;
the tests wait for events (a process gone), bounded, never for a fixed time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from slime_env import lifeline

PARENT = """
import subprocess, sys
from slime_env.lifeline import lifeline_popen
child = subprocess.Popen([sys.executable, "-P", "-c", {child!r}], **lifeline_popen())
print(child.pid, flush=True)
child.wait()
"""
CHILD = "from slime_env.lifeline import hold_lifeline; import time; assert hold_lifeline(); time.sleep(600)"


def _gone(pid: int, within_s: float = 60.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] == "Z":  # exited, not yet waited for
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def test_a_child_on_the_lifeline_dies_with_its_parent_killed_by_sigkill():
    parent = subprocess.Popen([sys.executable, "-P", "-c", PARENT.format(child=CHILD)], stdout=subprocess.PIPE,
                              text=True)
    child = int(parent.stdout.readline())
    assert not _gone(child, within_s=0.5)  # it lives while its parent does
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(30)
    assert _gone(child)


def test_reap_kills_a_dead_owners_processes_of_the_label_only(tmp_path):
    label = str(tmp_path)
    dead_owner = lifeline.owner_id().rsplit(":", 1)[0] + ":0"  # this pid, another start time: a gone process
    sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
    env = {**os.environ, lifeline.LABEL_ENV: label}
    orphan = subprocess.Popen(sleep, env={**env, lifeline.OWNER_ENV: dead_owner})
    owned = subprocess.Popen(sleep, env={**env, lifeline.OWNER_ENV: lifeline.owner_id()})
    other = subprocess.Popen(sleep, env={**env, lifeline.LABEL_ENV: label + "-other",
                                         lifeline.OWNER_ENV: dead_owner})
    try:
        assert {pid for pid, _ in lifeline.labelled(label)} == {orphan.pid, owned.pid}
        assert lifeline.reap(label) == [orphan.pid]
        assert orphan.wait(30) == -signal.SIGKILL
        assert owned.poll() is None and other.poll() is None
    finally:
        for p in (orphan, owned, other):
            p.kill()
            p.wait()


def test_run_scope_labels_children_and_restores_the_environment(tmp_path):
    before = dict(os.environ)
    with lifeline.run_scope(str(tmp_path)):
        out = subprocess.run([sys.executable, "-c", f"import os; print(os.environ[{lifeline.OWNER_ENV!r}], "
                              f"os.environ[{lifeline.LABEL_ENV!r}])"], capture_output=True, text=True).stdout.split()
    assert out == [lifeline.owner_id(), str(tmp_path)]
    assert dict(os.environ) == before
