"""`RankProcess` (slime_env.trainers.run.rank_process): an object in a child process, called over a pipe; what
`cluster.backend: process` runs every trainer rank in. Real child processes, a real SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from slime_env.trainers.run.rank_process import RankDied, RankProcess

HERE = os.path.dirname(os.path.abspath(__file__))


def _child(tmp_path) -> RankProcess:
    return RankProcess("rank_target:Target", name="rank 7", log=tmp_path / "rank.log",
                       env={"PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")})


def _gone(pid: int, within: float = 30.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] == "Z":
                    return True  # exited, not yet reaped by its parent
        except OSError:
            return True
        time.sleep(0.1)
    return False


def test_calls_answer_in_the_child_and_its_exceptions_arrive_with_their_traceback(tmp_path):
    rank = _child(tmp_path)
    try:
        assert rank.call("add", 2, b=3) == 5 and rank.call("add", 1) == 1
        value, pid = rank.call("later", {"x": [1, 2]})
        assert value == {"x": [1, 2]} and pid == rank.proc.pid != os.getpid()
        with pytest.raises(KeyError, match="no such task") as info:
            rank.call("fail", "no such task")
        assert any("in rank_target:Target.fail, in process" in note and "raise KeyError(message)" in note
                   for note in info.value.__notes__)
        with pytest.raises(RuntimeError, match=r"rank 7\.unpicklable failed: TypeError: cannot pickle '_thread\.lock'"):
            rank.call("unpicklable")
        assert rank.call("add", 0) == 0  # the child still answers after a failed call
    finally:
        rank.close()
    assert rank.proc.returncode == 0


def test_a_child_killed_mid_call_raises_its_exit_code_and_the_end_of_its_log(tmp_path):
    rank = _child(tmp_path)
    import threading

    threading.Timer(2.0, lambda: os.kill(rank.proc.pid, signal.SIGKILL)).start()
    try:
        with pytest.raises(RankDied, match=r"rank 7 \(pid \d+\) exited with code -9 during say_and_wait\(\); "
                                           r"the end of .*rank\.log:\nhello from the child\nabout to wait"):
            rank.call("say_and_wait", "hello from the child")
        with pytest.raises(RankDied, match="during add"):
            rank.call("add", 1)
    finally:
        rank.close()


def test_the_child_dies_with_its_parent_even_on_sigkill(tmp_path):
    script = ("import os, sys, time\n"
              "from slime_env.trainers.run.rank_process import RankProcess\n"
              f"r = RankProcess('rank_target:Target', name='r', log={str(tmp_path / 'rank.log')!r},\n"
              f"                env={{'PYTHONPATH': {HERE!r}}})\n"
              "assert r.call('add', 1, 1) == 2\n"
              "print(r.proc.pid, flush=True)\n"
              "time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-P", "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert not _gone(child, within=0.5)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert _gone(child), f"child {child} outlived its parent"
    finally:
        parent.kill()


def test_a_failed_rank_stops_the_group_only_if_others_are_left_waiting(tmp_path):
    """`ProcessTrainerGroup`'s rule over its ranks (here two `Target`s): a failure every rank shares leaves them
    running (the run can still save the trainer); a failure while another rank still waits past the grace period
    (as in a collective that cannot complete) kills them all, and every later call says why."""
    from slime_env.trainers.run.trainer_group import ProcessTrainerGroup

    group = object.__new__(ProcessTrainerGroup)
    group.failed, group.grace_s = None, 1.0
    group.ranks = [_child(tmp_path / f"r{r}") for r in range(2)]
    try:
        with pytest.raises(KeyError, match="both"):
            group._each([("fail", "both"), ("fail", "both")])
        assert group.failed is None and group._each([("add", 1, 2), ("add", 3)]) == [3, 3]
        with pytest.raises(KeyError, match="rank 0 alone"):
            group._each([("fail", "rank 0 alone"), ("say_and_wait", "stuck")])
        assert all(_gone(r.proc.pid) for r in group.ranks)
        with pytest.raises(RuntimeError, match=r"stopped after a failure: trainer rank 0: KeyError: 'rank 0 alone'"):
            group._each([("add", 1), ("add", 1)])
    finally:
        group.close()


def test_ray_ranks_follow_the_same_rule_so_a_collective_left_waiting_never_hangs_the_run():
    """`RayTrainerGroup` on a local Ray cluster, its actors two `Target`s: the same rule as the process group. Before,
    one actor failing while the other waited in a collective left the run waiting forever."""
    ray = pytest.importorskip("ray")
    from slime_env.trainers.run.trainer_group import RayTrainerGroup

    assert not ray.is_initialized()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": HERE}})  # the actors import rank_target from here
    try:
        from rank_target import Target

        group = object.__new__(RayTrainerGroup)
        group.grace_s = 1.0
        group.actors = [ray.remote(num_cpus=0)(Target).remote() for _ in range(2)]
        with pytest.raises(KeyError, match="both"):
            group._each([("fail", "both"), ("fail", "both")])
        assert group.failed is None and group._each([("add", 1, 2), ("add", 3)]) == [3, 3]
        with pytest.raises(KeyError, match="rank 1 alone"):
            group._each([("say_and_wait", "stuck"), ("fail", "rank 1 alone")])
        with pytest.raises(RuntimeError, match=r"stopped after a failure: trainer rank 1: KeyError: 'rank 1 alone'"):
            group._each([("add", 1), ("add", 1)])
        with pytest.raises(ray.exceptions.RayActorError):  # the actors were killed, the waiting one too
            ray.get(group.actors[0].add.remote(1), timeout=60)
        group.failed = None
        group.actors = [ray.remote(num_cpus=0)(Target).remote() for _ in range(2)]
        ray.kill(group.actors[0])
        with pytest.raises(ray.exceptions.RayActorError):  # a dead actor stops the group at once, no grace needed
            group._each([("add", 1), ("say_and_wait", "stuck")])
        assert group.failed.startswith("trainer rank 0: ")
    finally:
        ray.shutdown()
