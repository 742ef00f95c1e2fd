"""RolloutManager: exact accounting, groups, dynamic filters, partial rollouts, persistence, faults."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from slime_env import Env, Message, RolloutManager, ScriptedPolicy, Task, get_renderer, load_tasks, register
from slime_env.errors import InvalidInput
from slime_env.rollout import nonzero_std, read_groups

ROOT = Path(__file__).resolve().parents[1]


class CoinEnv(Env):
    """Two turns; the reward depends on the task's `p` and the episode seed, so some groups are
    all-equal (dropped by nonzero_std) and others are not. `boom` in the metadata makes step raise."""

    parser = None

    async def reset(self, *, seed=None, options=None):
        self.task, self.seed, self.steps = self.task_from(options), seed, 0
        return self.task.messages(), {}

    async def step(self, action):
        self.steps += 1
        if self.task.metadata.get("boom") and self.steps == 1:
            raise RuntimeError("boom")
        if self.steps == 1:
            await asyncio.sleep(self.task.metadata.get("delay", 0.0))
        if self.steps < 2:
            return [Message("user", "again")], 0.0, False, False, {}
        p = self.task.metadata.get("p", 2)
        return [], float(self.seed % p == 0), True, False, {}


register("TestCoin-v0", CoinEnv)


@pytest.fixture(scope="module")
def renderer(smollm2_tok):
    return get_renderer(smollm2_tok)


def tasks(n, **metadata):
    return [Task(prompt=f"task {i}", metadata={"p": 1 + i % 3, **metadata}, id=str(i)) for i in range(n)]


def test_ten_thousand_episodes_add_up(smollm2_tok, renderer):
    n_tasks, n = 1250, 8
    manager = RolloutManager(tasks(n_tasks), env_id="TestCoin-v0", policy=ScriptedPolicy(smollm2_tok, ["ok"]),
                             renderer=renderer, n_samples_per_prompt=n, max_concurrency=512)

    async def main():
        groups = [g async for g in manager.run(batch_size=100)]
        await manager.close()
        return groups

    groups = asyncio.run(main())  # how fast is bench/rollout.py's business; pytest-timeout catches a hang
    assert len(groups) == n_tasks and sorted(g.group_index for g in groups) == list(range(n_tasks))
    seen = collections.Counter()
    for g in groups:
        assert len(g.trajectories) == n
        for k, t in enumerate(g.trajectories):
            assert t.status == "completed" and t.metadata["sample_index"] == k
            assert t.metadata["index"] == g.group_index * n + k
            seen[(g.task.id, k)] += 1
    assert len(seen) == n_tasks * n and set(seen.values()) == {1}


def test_dynamic_filter_drops_and_refills(smollm2_tok, renderer):
    # p=1: every seed rewards 1 (all equal, dropped); p=2 and p=3: mixed rewards (kept)
    manager = RolloutManager(tasks(60), env_id="TestCoin-v0", policy=ScriptedPolicy(smollm2_tok, ["ok"]),
                             renderer=renderer, n_samples_per_prompt=4, max_concurrency=64,
                             dynamic_filter="nonzero_std", over_sampling=1.5)

    async def main():
        b1 = await manager.generate_batch(10)
        b2 = await manager.generate_batch(10)
        rest = [g async for g in manager.run()]
        return b1, b2, rest

    b1, b2, rest = asyncio.run(main())
    for b in (b1, b2):
        assert len(b.groups) == 10 and all(nonzero_std(g) for g in b.groups)
        assert all(not g.accepted and g.filter_reason == "dropped by nonzero_std" for g in b.dropped)
        assert b.metrics["rollout/groups_accepted"] == 10
        assert b.metrics["rollout/groups_dropped"] == len(b.dropped)
    delivered = [*b1.groups, *b1.dropped, *b2.groups, *b2.dropped, *rest]
    kept = [g for g in delivered if g.accepted]
    assert len(kept) == 40  # 2 of every 3 tasks have mixed rewards
    assert all(g.task.metadata["p"] != 1 for g in kept)
    assert all(g.task.metadata["p"] == 1 for g in [*b1.dropped, *b2.dropped])


def test_abort_and_partial_rollout_resume(smollm2_tok, renderer):
    policy = ScriptedPolicy(smollm2_tok, ["a reply that takes a while " * 3], latency_s=0.05)
    # tasks 0 and 1 finish first; the others are mid-way through their second generation at that moment
    ts = [Task(prompt=t.prompt, metadata={**t.metadata, "delay": 0.0 if i < 2 else 0.03}, id=t.id)
          for i, t in enumerate(tasks(12))]
    manager = RolloutManager(ts, env_id="TestCoin-v0", policy=policy, renderer=renderer,
                             n_samples_per_prompt=2, max_concurrency=24, over_sampling=3.0,
                             partial_rollout=True, mask_offpolicy=True)

    async def main():
        first = await manager.generate_batch(2)
        suspended = len(manager._carry)
        rest = [g async for g in manager.run()]
        return first, suspended, rest

    first, suspended, rest = asyncio.run(main())
    assert len(first.groups) == 2 and suspended > 0
    groups = [*first.groups, *rest]
    assert sorted(g.group_index for g in groups) == list(range(12))
    resumed = [t for g in groups for t in g.trajectories if t.metadata["resumed"]]
    assert resumed
    for t in (t for g in groups for t in g.trajectories):
        assert t.status == "completed", t.reason
        t.check()
    # the resumed turns' earlier tokens were masked as off-policy; later ones are trained on
    for t in resumed:
        kinds = {s.kind for s in t.spans}
        assert "offpolicy" in kinds and "generated" in kinds
        assert all(t.loss_mask[i] == 0 for s in t.spans if s.kind == "offpolicy" for i in range(s.start, s.end))
        text = renderer.decode(t.response_ids)
        assert text.count("a reply that takes a while") == 6  # both turns complete, nothing lost or doubled


def test_abort_without_partial_rollout_requeues(smollm2_tok, renderer):
    policy = ScriptedPolicy(smollm2_tok, ["slow"], latency_s=0.05)
    manager = RolloutManager(tasks(10), env_id="TestCoin-v0", policy=policy, renderer=renderer,
                             n_samples_per_prompt=2, max_concurrency=20, over_sampling=3.0)

    async def main():
        first = await manager.generate_batch(3)
        rest = [g async for g in manager.run()]
        return first, rest

    first, rest = asyncio.run(main())
    groups = [*first.groups, *rest]
    assert len(first.groups) == 3
    assert sorted(g.group_index for g in groups) == list(range(10))
    assert all(t.status == "completed" for g in groups for t in g.trajectories)


class _FlakyPolicy:
    """Fails or hangs for some tasks, answers for the others."""

    def __init__(self, tok):
        self.inner = ScriptedPolicy(tok, ["fine"])
        self.tok = tok

    async def generate(self, input_ids, params):
        text = self.tok.decode(input_ids)
        if "task 1\n" in text or "task 1<" in text:
            raise ConnectionError("engine 503 after retries")
        if "task 2<" in text:
            await asyncio.sleep(10)
        return await self.inner.generate(input_ids, params)


def test_faults_become_statuses(smollm2_tok, renderer):
    ts = tasks(4)
    ts[3] = Task(prompt="task 3", metadata={"boom": True}, id="3")
    ts.append(Task(prompt="task 4", metadata={"env_id": "NoSuchEnv-v0"}, id="4"))
    manager = RolloutManager(ts, env_id="TestCoin-v0", policy=_FlakyPolicy(smollm2_tok), renderer=renderer,
                             n_samples_per_prompt=2, max_concurrency=10, deadline_s=0.5)

    async def main():
        return [g async for g in manager.run()]

    groups = {g.group_index: g for g in asyncio.run(main())}
    assert len(groups) == 5 and all(len(g.trajectories) == 2 for g in groups.values())
    assert {t.status for t in groups[0].trajectories} == {"completed"}
    assert all("ConnectionError: engine 503" in t.reason for t in groups[1].trajectories)
    assert all(t.status == "truncated" and "deadline" in t.reason for t in groups[2].trajectories)
    assert all("env.step raised RuntimeError: boom" in t.reason for t in groups[3].trajectories)
    assert all("making env 'NoSuchEnv-v0' raised" in t.reason for t in groups[4].trajectories)
    assert all(t.to_slime_sample()["remove_sample"] for i in (1, 3, 4) for t in groups[i].trajectories)


def test_persistence_and_bad_resume(smollm2_tok, renderer, tmp_path):
    def manager(**kw):
        return RolloutManager(tasks(6), env_id="TestCoin-v0", policy=ScriptedPolicy(smollm2_tok, ["ok"]),
                              renderer=renderer, n_samples_per_prompt=2, out_dir=str(tmp_path), **kw)

    async def first():
        m = manager(parquet=True)
        b = await m.generate_batch(4)
        await m.close()
        return b

    b = asyncio.run(first())
    assert len(read_groups(tmp_path)) == 4 and list(tmp_path.glob("batch-*.parquet"))
    with pytest.raises(InvalidInput, match="already holds a rollout"):
        manager()
    with pytest.raises(InvalidInput, match="n_samples_per_prompt was 2, now 3"):
        RolloutManager(tasks(6), env_id="TestCoin-v0", policy=ScriptedPolicy(smollm2_tok, ["ok"]),
                       renderer=renderer, n_samples_per_prompt=3, out_dir=str(tmp_path), resume=True)

    async def second():
        m = manager(resume=True)
        assert m.remaining() == 2
        rest = [g async for g in m.run()]
        await m.close()
        return rest

    rest = asyncio.run(second())
    assert sorted(g.group_index for g in [*b.groups, *rest]) == list(range(6))
    records = read_groups(tmp_path)
    assert sorted(r["group_index"] for r in records) == list(range(6))
    import pyarrow.parquet as pq
    rows = pq.read_table(next(tmp_path.glob("batch-00000.parquet"))).to_pylist()
    assert len(rows) == 8 and set(rows[0]) >= {"prompt_ids", "response_ids", "loss_mask", "rollout_logprobs"}


def test_load_tasks_names_file_and_line(tmp_path):
    good = tmp_path / "d.jsonl"
    good.write_text('{"question": "q1", "answer": 1, "meta": {"env_id": "X-v0"}}\n\n{"question": "q2"}\n')
    ts = load_tasks(good, input_key="question", label_key="answer", metadata_key="meta")
    assert [(t.prompt, t.label, t.id) for t in ts] == [("q1", 1, "0"), ("q2", None, "1")]
    assert ts[0].metadata == {"env_id": "X-v0"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(InvalidInput, match=r"bad.jsonl:2: not valid JSON"):
        load_tasks(bad)
    bad.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(InvalidInput, match=r"bad.jsonl:2: no 'prompt' field"):
        load_tasks(bad)
    bad.write_text('{"prompt": [{"content": "x"}]}\n')
    with pytest.raises(InvalidInput, match=r"bad.jsonl:1.prompt\[0\]: chat message has no 'role'"):
        load_tasks(bad)
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist([{"prompt": "p", "label": "l"}]), tmp_path / "d.parquet")
    assert load_tasks(tmp_path / "d.parquet")[0].label == "l"


KILL_SCRIPT = textwrap.dedent("""
    import asyncio, sys
    sys.path.insert(0, {tests!r})
    from test_rollout import CoinEnv  # registers TestCoin-v0
    from slime_env import RolloutManager, ScriptedPolicy, Task, get_renderer
    from slime_env.offline_tokenizers import smollm2

    async def main():
        tok = smollm2()
        tasks = [Task(prompt=f"task {{i}}", metadata={{"p": 2}}, id=str(i)) for i in range(40)]
        m = RolloutManager(tasks, env_id="TestCoin-v0", policy=ScriptedPolicy(tok, ["ok"], latency_s=0.02),
                           renderer=get_renderer(tok), n_samples_per_prompt=4, max_concurrency=16,
                           out_dir=sys.argv[1], resume=True, workers={workers})
        async for g in m.run(batch_size=2):
            print("group", g.group_index, flush=True)
        await m.close()
        print("done", flush=True)

    if __name__ == "__main__":  # rollout workers are spawned: they import this file without running it
        asyncio.run(main())
""")


@pytest.mark.parametrize("workers", [0, 2])
def test_kill_minus_nine_and_resume(tmp_path, workers):
    script = tmp_path / "run.py"
    script.write_text(KILL_SCRIPT.format(tests=str(ROOT / "tests"), workers=workers))
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(script), str(out)], stdout=subprocess.PIPE, text=True)
    seen = 0
    for line in proc.stdout:
        seen += line.startswith("group")
        if seen >= 8:
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = read_groups(out)
    assert 0 < len(before) < 40
    finished = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0 and "done" in finished.stdout, finished.stderr[-2000:]
    records = read_groups(out)
    keys = collections.Counter((r["task_id"], t["metadata"]["sample_index"]) for r in records
                               for t in r["trajectories"])
    assert len(keys) == 40 * 4 and set(keys.values()) == {1}  # none lost, none duplicated
    assert json.loads((out / "manifest.json").read_text())["config"]["n_samples_per_prompt"] == 4


def test_rollout_command_with_the_embedded_engine_on_uvloop(tmp_path):
    """`slime-env rollout` end to end with the default local model (its engine thread hands results to a uvloop
    loop): every group written, statuses counted."""
    data = tmp_path / "tasks.jsonl"
    data.write_text('{"prompt": "What is 3 * 4?", "label": 12}\n{"prompt": "What is 5 + 9?", "label": 14}\n')
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "slime_env", "rollout", "--env", "Calculator-v0", "--data", str(data),
                          "--out", str(out), "--n", "2", "--batch-size", "2", "--max-turns", "2",
                          "--max-new-tokens", "8"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "SLIME_ENV_UVLOOP": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "batch 1: 2 groups (0 dropped)" in run.stdout
    records = read_groups(out)
    assert sorted(r["group_index"] for r in records) == [0, 1]
    assert all(len(r["trajectories"]) == 2 for r in records)
