"""The driver's hot-path plumbing: the batch-scoped garbage-collector settings, cheap pickles of the records that
cross processes, the JSON codec of engine requests, and the event loop driver processes run on."""

from __future__ import annotations

import asyncio
import copy
import gc
import json
import math
import os
import pickle
import subprocess
import sys

import pytest

from slime_env import Env, Generation, Message, RolloutManager, ScriptedPolicy, Task, get_renderer
from slime_env.http import json_dumps, json_loads
from slime_env.ledger import Span
from slime_env.rollout.heap import YOUNG_THRESHOLD, quiet_gc
from slime_env.types import Action, ParseError, ToolCall


@pytest.fixture
def default_gc():
    before = gc.get_threshold()
    gc.unfreeze()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*before)


def test_quiet_gc_is_undone_at_exit_also_after_an_error_and_when_nested(default_gc):
    with pytest.raises(RuntimeError), quiet_gc():
        assert gc.get_threshold()[0] == YOUNG_THRESHOLD and gc.get_freeze_count() > 0
        with quiet_gc():  # a second manager in the same loop: the outer one undoes
            pass
        assert gc.get_threshold()[0] == YOUNG_THRESHOLD and gc.get_freeze_count() > 0
        raise RuntimeError("boom")
    assert gc.get_threshold() == (700, 10, 10) and gc.get_freeze_count() == 0
    with quiet_gc(enabled=False):
        assert gc.get_threshold() == (700, 10, 10) and gc.get_freeze_count() == 0


def test_quiet_gc_overlapping_across_threads_undoes_when_the_last_leaves(default_gc):
    import threading

    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with quiet_gc():
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def b():
        a_in.wait(10)
        with quiet_gc():
            b_in.set()
            a_out.wait(10)
            seen["after a left"] = gc.get_threshold()[0]

    threads = [threading.Thread(target=f) for f in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen["after a left"] == YOUNG_THRESHOLD
    assert gc.get_threshold() == (700, 10, 10) and gc.get_freeze_count() == 0


def test_quiet_gc_keeps_a_freeze_it_did_not_make(default_gc):
    gc.freeze()
    frozen = gc.get_freeze_count()
    try:
        with quiet_gc():
            assert gc.get_threshold()[0] == YOUNG_THRESHOLD
        # Kept frozen: an unfreeze would empty the permanent generation. Not `== frozen`: a frozen object that
        # another thread of the process frees meanwhile (a reader thread's last line, say) leaves it.
        assert frozen * 0.99 <= gc.get_freeze_count() <= frozen and gc.get_threshold() == (700, 10, 10)
    finally:
        gc.unfreeze()


def test_cycles_made_during_a_quiet_batch_are_still_collected(default_gc):
    class Node:
        pass

    with quiet_gc():
        for _ in range(3 * YOUNG_THRESHOLD):  # more cycles than one young generation holds
            a, b = Node(), Node()
            a.other, b.other = b, a
        del a, b
        alive = sum(isinstance(o, Node) for o in gc.get_objects())
    assert alive < 2 * YOUNG_THRESHOLD  # collections ran inside: not every cycle is still there


class _Two(Env):
    async def reset(self, *, seed=None, options=None):
        self.k = 0
        return self.task_from(options).messages(), {"seed": seed}

    async def step(self, action):
        self.k += 1
        return [Message("user", "again")], 0.5, self.k >= 2, False, {"k": self.k}


def test_manager_batches_leave_the_collector_as_they_found_it(default_gc, smollm2_tok):
    async def main():
        manager = RolloutManager([Task(prompt=f"q{i}", id=str(i)) for i in range(6)], env_factory=lambda t, e: _Two(),
                                 env_id="two", policy=ScriptedPolicy(smollm2_tok, ["ok"]),
                                 renderer=get_renderer(smollm2_tok), n_samples_per_prompt=2, max_concurrency=4)
        seen = []

        async def watch():
            while True:
                seen.append(gc.get_threshold()[0])
                await asyncio.sleep(0)

        watcher = asyncio.create_task(watch())
        batch = await manager.generate_batch(3)
        watcher.cancel()
        await manager.close()
        return batch, seen

    batch, seen = asyncio.run(main())
    assert len(batch.groups) == 3 and YOUNG_THRESHOLD in seen
    assert gc.get_threshold() == (700, 10, 10) and gc.get_freeze_count() == 0


def test_records_pickle_to_equal_objects(smollm2_tok):
    """Trajectories, messages, tasks, spans and actions survive pickle and copy unchanged (fast_pickle)."""
    from test_rollout import tasks  # noqa: F401 - registers TestCoin-v0

    async def main():
        manager = RolloutManager(tasks(2), env_id="TestCoin-v0", policy=ScriptedPolicy(smollm2_tok, ["ok", "yes"]),
                                 renderer=get_renderer(smollm2_tok), n_samples_per_prompt=2, max_concurrency=4)
        batch = await manager.generate_batch(2)
        await manager.close()
        return batch

    trajectories = [t for g in asyncio.run(main()).groups for t in g.trajectories]
    others = [Message("tool", "42", name="calc", tool_call_id="c1"), Span(1, "inserted", 3, 9),
              Task(prompt=(Message("system", "s"), Message("user", "u")), label={"x": [1]}, metadata={"m": 1}, id="7"),
              Action(text="t", token_ids=(1, 2), tool_calls=(ToolCall("f", {"a": 1}, "raw", "id1"),),
                     parse_errors=(ParseError("bad", "x"),), turn=2),
              Generation((5, 6), (-0.1, -0.2), "length", weight_version="v3")]
    for record in [*trajectories, *others]:
        for copied in (pickle.loads(pickle.dumps(record, protocol=p)) for p in (2, 5)):
            assert copied == record and type(copied) is type(record)
        assert copy.deepcopy(record) == record
    t = pickle.loads(pickle.dumps(trajectories[0]))
    t.check()
    assert t.to_dict() == trajectories[0].to_dict()
    with pytest.raises(AttributeError):  # still frozen after the trip
        t.reward = 2.0


def test_json_codec_falls_back_where_orjson_cannot():
    body = {"input_ids": list(range(1000)), "sampling_params": {"temperature": 0.7, "logit_bias": {17: -1.0}}}
    assert json.loads(json_dumps(body)) == {**body, "sampling_params": {"temperature": 0.7,
                                                                        "logit_bias": {"17": -1.0}}}
    assert json.loads(json_dumps({"big": 2 ** 70})) == {"big": 2 ** 70}  # beyond orjson's 64 bits
    assert math.isnan(json_loads(b'{"x": NaN}')["x"])  # servers in Python may answer NaN
    assert json_loads('{"a": [1, 2]}') == {"a": [1, 2]}
    with pytest.raises(ValueError):
        json_loads(b"<html>")


@pytest.mark.parametrize("setting, expected", [("1", "uvloop"), ("0", "asyncio")])
def test_driver_processes_run_on_uvloop_unless_told_not_to(setting, expected):
    pytest.importorskip("uvloop")
    code = ("import asyncio; from slime_env.rollout.loop import run_loop, loop_name\n"
            "async def main(): return type(asyncio.get_running_loop()).__module__\n"
            "print(loop_name(), run_loop(main()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "SLIME_ENV_UVLOOP": setting}).stdout.split()
    assert out[0] == expected and out[1].startswith(expected)


def test_session_ids_are_unique_across_forked_processes():
    """Session ids key the engine's per-session prefix cache and the router: a forked child draws a new prefix."""
    import multiprocessing

    from slime_env.runner import _new_session_id

    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(2) as pool:
        children = pool.starmap(_ids, [(50,), (50,)])
    mine = [_new_session_id() for _ in range(50)]
    every = [*mine, *children[0], *children[1]]
    assert len(set(every)) == len(every) and all(len(i) == 24 and int(i, 16) >= 0 for i in every)


def _ids(n: int) -> list[str]:
    from slime_env.runner import _new_session_id

    return [_new_session_id() for _ in range(n)]
