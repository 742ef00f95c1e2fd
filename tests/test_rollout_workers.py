"""RolloutManager(workers=N): groups run in spawned driver processes, the output stays exactly-once."""

from __future__ import annotations

import asyncio
import collections
import os
import signal

import pytest
from test_rollout import tasks  # noqa: F401 - importing registers TestCoin-v0 (the workers get its spec)

from slime_env import RolloutManager, ScriptedPolicy, get_renderer
from slime_env.errors import InvalidInput
from slime_env.rollout import read_groups


def _check_exactly_once(groups, n_tasks, n):
    keys = collections.Counter((g.group_index, t.metadata["sample_index"]) for g in groups for t in g.trajectories)
    assert len(keys) == n_tasks * n and set(keys.values()) == {1}  # none lost, none duplicated
    for g in groups:  # each group in sample order, indices consistent
        assert [t.metadata["index"] for t in g.trajectories] == [g.group_index * n + k for k in range(n)]
        assert {t.task.id for t in g.trajectories} == {str(g.group_index)}


def test_ten_thousand_episodes_across_two_workers(smollm2_tok, tmp_path):
    n_tasks, n = 1250, 8

    async def main():
        manager = RolloutManager(tasks(n_tasks), env_id="TestCoin-v0", policy=ScriptedPolicy(smollm2_tok, ["ok"]),
                                 renderer=get_renderer(smollm2_tok), n_samples_per_prompt=n, max_concurrency=512,
                                 out_dir=str(tmp_path), workers=2)
        batches = [await manager.generate_batch(400) for _ in range(4)]
        assert manager.remaining() == 0
        await manager.close()
        return batches

    batches = asyncio.run(main())
    assert [len(b.groups) for b in batches] == [400, 400, 400, 50]
    groups = [g for b in batches for g in b.groups]
    _check_exactly_once(groups, n_tasks, n)
    assert all(t.status == "completed" for g in groups for t in g.trajectories)
    assert sum(b.metrics["rollout/episodes"] for b in batches) == n_tasks * n
    stored = read_groups(tmp_path)
    assert sorted(r["group_index"] for r in stored) == list(range(n_tasks))  # persisted once each
    for t in groups[0].trajectories:
        t.check()


def test_large_groups_cross_whole_when_manager_and_workers_run_on_uvloop(smollm2_tok):
    """uvloop turns watched descriptors non-blocking; a group bigger than the pipe's buffer must still arrive
    whole (it once hung: the reader got half a message)."""
    pytest.importorskip("uvloop")
    from slime_env.rollout.loop import run_loop

    n_tasks, n = 120, 4
    long_answer = "word " * 400  # each group pickles to well over the socket buffer in total

    async def main():
        manager = RolloutManager(tasks(n_tasks), env_id="TestCoin-v0",
                                 policy=ScriptedPolicy(smollm2_tok, [long_answer]), renderer=get_renderer(smollm2_tok),
                                 n_samples_per_prompt=n, max_concurrency=256, max_new_tokens=1000, workers=2)
        assert type(asyncio.get_running_loop()).__module__.startswith("uvloop")
        batch = await asyncio.wait_for(manager.generate_batch(n_tasks), 120)
        await manager.close()
        return batch

    batch = run_loop(main())
    _check_exactly_once(batch.groups, n_tasks, n)
    assert all(t.status == "completed" and len(t.response_ids) > 400 for g in batch.groups for t in g.trajectories)


def test_thousands_of_groups_in_flight_on_one_worker_do_not_deadlock_the_pipe(smollm2_tok):
    """bench/rollout.py's worker row at 5,000 episodes in flight on one worker: the manager hands out groups
    while the worker sends results back, both over one pipe. With the worker reading its messages in its event
    loop, each side ended up blocked writing to the other (a full socket buffer each way) and the run hung; the
    worker now drains the pipe from a thread."""
    import sys

    # bench/ on sys.path for this test only (the workers import its module by name); taken off after, since its
    # scripts' names would shadow packages for every later test
    bench_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
    sys.path.insert(0, bench_dir)
    try:
        import rollout as bench  # its 3-turn env and 20 ms stub policy: the set-up that hung

        result = asyncio.run(asyncio.wait_for(bench.measure(bench.StubPolicy(0.02), get_renderer(smollm2_tok), 5000,
                                                            3, workers=1), 300))
    finally:
        sys.path.remove(bench_dir)
        sys.modules.pop("rollout", None)
    assert result["episodes_per_s"] > 0  # measure() raises unless every episode completed


def test_a_worker_killed_mid_batch_loses_nothing(smollm2_tok):
    n_tasks, n = 60, 4

    async def main():
        manager = RolloutManager(tasks(n_tasks, delay=0.05), env_id="TestCoin-v0",
                                 policy=ScriptedPolicy(smollm2_tok, ["word " * 300], latency_s=0.02),
                                 renderer=get_renderer(smollm2_tok), n_samples_per_prompt=n, max_concurrency=64,
                                 workers=2)
        batch = asyncio.create_task(manager.generate_batch(n_tasks))
        while not manager._pool._workers or not all(w.pending for w in manager._pool._workers):
            await asyncio.sleep(0.05)
        victim = manager._pool._workers[0]
        os.kill(victim.process.pid, signal.SIGKILL)
        result = await batch
        restarts = manager._pool.restarts
        await manager.close()
        return result, restarts

    batch, restarts = asyncio.run(main())
    assert restarts >= 1
    _check_exactly_once(batch.groups, n_tasks, n)
    assert all(t.status == "completed" for g in batch.groups for t in g.trajectories)


def test_closing_a_batch_aborts_the_groups_still_running_in_workers(smollm2_tok):
    async def main():
        manager = RolloutManager(tasks(12, delay=0.3), env_id="TestCoin-v0",
                                 policy=ScriptedPolicy(smollm2_tok, ["ok"]), renderer=get_renderer(smollm2_tok),
                                 n_samples_per_prompt=2, max_concurrency=24, over_sampling=2.0, workers=2)
        first = await manager.generate_batch(4)
        rest = [g for _ in range(3) for g in (await manager.generate_batch(4)).groups]
        await manager.close()
        return first, rest

    first, rest = asyncio.run(main())
    _check_exactly_once([*first.groups, *rest], 12, 2)  # aborted groups were requeued and rerun


def test_refusals_say_why(smollm2_tok):
    class Local:  # holds a lock: cannot be copied into another process
        def __init__(self):
            import threading

            self.lock = threading.Lock()

        async def generate(self, ids, params):
            raise AssertionError

    with pytest.raises(InvalidInput, match="cannot be pickled.*remote engine"):
        RolloutManager(tasks(2), env_id="TestCoin-v0", policy=Local(), renderer=get_renderer(smollm2_tok),
                       n_samples_per_prompt=2, workers=2)
    with pytest.raises(InvalidInput, match="partial_rollout"):
        RolloutManager(tasks(2), env_id="TestCoin-v0", policy=ScriptedPolicy(smollm2_tok, ["ok"]),
                       renderer=get_renderer(smollm2_tok), n_samples_per_prompt=2, workers=2, partial_rollout=True)
