"""Asynchronous training (`async:` in the run config): the staleness bound on the batches the trainer receives,
per-turn weight versions through an episode suspended and resumed across an update, the off-policy weights against
a hand computation, `off` equal to the synchronous loop, kill -9 and resume in `full` with exactly-once accounting,
and failures in the middle of an overlapped step.

The engine is the real embedded one (`TransformersPolicy`) on a tiny random Llama with SmolLM2's real tokenizer;
`AsyncGate-v0` (tests/async_support.py) holds chosen episodes in `env.step` until the test opens its gate, so which
episode is still running when the trainer moves on is decided by events, not by timing."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import async_support  # noqa: E402
from async_support import GATE, tiny_model_dir, write_tasks  # noqa: E402
from slime_env.trainers import algorithms as alg  # noqa: E402
from slime_env.trainers.torch_trainer import TorchTrainer  # noqa: E402
from slime_env.trainers.run import TrainConfig, train  # noqa: E402

from slime_env.errors import InvalidInput  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("async_model"))


@pytest.fixture(autouse=True)
def _closed_gate():
    GATE["open"] = False
    yield
    GATE["open"] = True  # nothing may stay blocked after a test


def _config(tmp_path: Path, model_dir: Path, *, gated=(), n_tasks=64, **over) -> TrainConfig:
    tasks = write_tasks(tmp_path / "tasks.jsonl", n_tasks, gated)
    raw = {"run_dir": str(tmp_path / "run"), "model": str(model_dir), "env": "AsyncGate-v0",
           "train_data": {"path": str(tasks)}, "steps": 4, "prompts_per_step": 2, "n_samples_per_prompt": 2,
           "max_turns": 3, "max_new_tokens": 6, "max_concurrency": 16, "seed_sampling": True, "eval_every": 100,
           "trainer": {"lr": 1e-3, "micro_batch_size": 4}, **over}
    return TrainConfig.from_dict(raw)


def _rows(cfg: TrainConfig) -> list[dict]:
    return [json.loads(line) for line in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]


def _versions(traj) -> list[int]:
    return [int(v) for v in traj.metadata["weight_versions"]]


class _Recorder:
    """Wraps TorchTrainer.step: what the trainer receives, with its version at the time."""

    def __init__(self, monkeypatch, fail_at: int | None = None):
        self.batches: list[tuple[int, list]] = []
        original = TorchTrainer.step
        recorder = self

        def step(trainer, trajectories, group_size):
            recorder.batches.append((trainer.step_count, list(trajectories)))
            if fail_at is not None and trainer.step_count + 1 == fail_at:
                raise RuntimeError("the trainer ran out of memory (injected)")
            return original(trainer, trajectories, group_size)

        monkeypatch.setattr(TorchTrainer, "step", step)


# --- the off-policy weights ------------------------------------------------------------------------------------------

def test_off_policy_weights_equal_a_hand_computation():
    old = torch.tensor([[-1.0, -0.5, -2.0, 0.0], [-0.2, -3.0, 0.0, 0.0]])
    rollout = torch.tensor([[-1.5, -0.4, -0.5, 0.0], [-0.2, -1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    rho = [[math.exp(0.5), math.exp(-0.1), math.exp(-1.5)], [1.0, math.exp(-2.0)]]

    w, stats = alg.off_policy_weights(old, rollout, mask, kind="tis", high=1.5)
    want = [[min(r, 1.5) for r in row] for row in rho]
    assert w[0, :3].tolist() == pytest.approx(want[0]) and w[1, :2].tolist() == pytest.approx(want[1])
    assert w[0, 3] == 0 and w[1, 2:].abs().sum() == 0  # masked positions weigh nothing
    assert float(stats["clipped_frac"]) == pytest.approx(1 / 5)  # exp(0.5) = 1.65 > 1.5
    gaps = [0.5, 0.1, 1.5, 0.0, 2.0]
    assert float(stats["logprob_gap"]) == pytest.approx(sum(gaps) / 5)
    k3 = [math.exp(g) - 1 - g for g in (0.5, -0.1, -1.5, 0.0, -2.0)]
    assert float(stats["kl"]) == pytest.approx(sum(k3) / 5, rel=1e-5)

    w, stats = alg.off_policy_weights(old, rollout, mask, kind="mis", low=0.5, high=1.5)
    want = [[r if 0.5 <= r <= 1.5 else 0.0 for r in row] for row in rho]  # exp(0.5), exp(-1.5), exp(-2) masked
    assert w[0, :3].tolist() == pytest.approx(want[0]) and w[1, :2].tolist() == pytest.approx(want[1])
    assert float(stats["clipped_frac"]) == pytest.approx(3 / 5)

    w, _ = alg.off_policy_weights(old, rollout, mask, kind="decoupled", high=1.5)  # AReaL: only above the cap
    want = [[r if r <= 1.5 else 0.0 for r in row] for row in rho]
    assert w[0, :3].tolist() == pytest.approx(want[0]) and w[1, :2].tolist() == pytest.approx(want[1])

    w, _ = alg.off_policy_weights(old, rollout, mask, kind="tis", level="sequence", high=100.0)
    seq = [math.exp(0.5 - 0.1 - 1.5), math.exp(0.0 - 2.0)]
    assert w[0, :3].tolist() == pytest.approx([seq[0]] * 3) and w[1, :2].tolist() == pytest.approx([seq[1]] * 2)
    w, _ = alg.off_policy_weights(old, rollout, mask, kind="tis", level="geometric", high=100.0)
    geo = [math.exp((0.5 - 0.1 - 1.5) / 3), math.exp(-2.0 / 2)]
    assert w[0, :3].tolist() == pytest.approx([geo[0]] * 3) and w[1, :2].tolist() == pytest.approx([geo[1]] * 2)


def test_bad_async_and_off_policy_configs_are_refused_by_field(tmp_path, model_dir):
    for raw, field in [({"async": {"mode": "sometimes"}}, "async.mode"),
                       ({"async": {"mode": "full", "max_staleness": -1}}, "async.max_staleness"),
                       ({"async": {"mode": "full", "interrupt": "kill"}}, "async.interrupt"),
                       ({"async": {"mode": "full", "in_flight": 1}}, "async.in_flight"),
                       ({"async": {"mod": "full"}}, "unknown field"),
                       ({"async": "full"}, "async: expected a mapping, got str"),
                       ({"trainer": {"off_policy": "magic"}}, "off_policy"),
                       ({"trainer": {"off_policy": "mis", "off_policy_low": 2.0}}, "off_policy_low"),
                       ({"async": {"mode": "overlap"}, "trainer": {"offload": True}}, "trainer.offload")]:
        with pytest.raises(InvalidInput, match=field.replace(".", r"\.")):
            _config(tmp_path, model_dir, **raw)


# --- the loop ---------------------------------------------------------------------------------------------------------

def test_off_equals_the_synchronous_loop_written_by_hand(tmp_path, model_dir, monkeypatch):
    """`mode: off` is today's loop: generate with the current weights, train, sync — compared with that loop written
    out here on the same components and seeds."""
    cfg = _config(tmp_path, model_dir, steps=3, **{"async": {"mode": "off"}})
    asyncio.run(train(cfg, log=lambda _: None))
    got = [r for r in _rows(cfg) if r["step"] > 0]

    async def by_hand() -> list[dict]:
        import random

        from slime_env.agents.policy_loader import load_policy
        from slime_env.trainers.run.engines import load_tokenizer
        from slime_env.trainers.run import load_split, make_trainer, trainer_config

        from slime_env import RolloutManager, get_renderer

        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        policy, path = load_policy(cfg.model, max_batch_size=cfg.max_concurrency, seed=cfg.seed, device="cpu")
        tok = load_tokenizer(path)
        trainer = make_trainer(trainer_config(cfg), path, policy, tok.pad_token_id, "cpu")
        await trainer.sync(policy, version="0")
        tasks = load_split(cfg.train_data, "train_data")
        manager = RolloutManager([tasks[i % len(tasks)] for i in range((cfg.steps + 1) * 2)], env_id=cfg.env,
                                 policy=policy, renderer=get_renderer(tok), n_samples_per_prompt=2, max_concurrency=16,
                                 sampling_params={"temperature": 1.0, "top_p": 1.0, "sampling_seed": "episode"},
                                 max_turns=3, max_new_tokens=6, seed=cfg.seed)
        out = []
        for step in range(1, cfg.steps + 1):
            batch = await manager.generate_batch(2)
            out.append(await asyncio.to_thread(trainer.step, [t for g in batch.groups for t in g.trajectories], 2))
            await trainer.sync(policy, version=str(step))
        await manager.close()
        policy.close()
        return out

    want = asyncio.run(by_hand())
    for g, w in zip(got, want, strict=True):
        for key in ("train/reward_mean", "train/loss", "train/grad_norm", "train/tokens", "train/clip_frac"):
            assert g[key] == w[key], key
    assert not any(k.startswith(("async/", "train/off_policy/")) for r in got for k in r)


def test_overlap_trains_each_batch_one_version_late_with_the_correction_on(tmp_path, model_dir, monkeypatch):
    rec = _Recorder(monkeypatch)
    cfg = _config(tmp_path, model_dir, steps=4, **{"async": {"mode": "overlap"}})
    asyncio.run(train(cfg, log=lambda _: None))
    for trainer_version, trajs in rec.batches:
        want = max(trainer_version - 1, 0)  # batch k + 1 was generated while step k trained
        assert {v for t in trajs for v in _versions(t)} == {want}
    rows = [r for r in _rows(cfg) if r["step"] > 0]
    assert [r["async/staleness_max"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert all("train/off_policy/clipped_frac" in r and "train/off_policy/logprob_gap" in r for r in rows)
    assert rows[1]["train/off_policy/logprob_gap"] > 0  # stale tokens: the engine's log-probs differ from the trainer's


def test_full_mode_drops_stale_groups_before_the_trainer_and_reruns_their_tasks(tmp_path, model_dir, monkeypatch):
    """Task 0's episodes are held in env.step until step 3 has trained: by then their weights (version 0) are three
    versions behind, more than max_staleness=1 — the group is dropped, counted, and its task runs again."""
    rec = _Recorder(monkeypatch)

    def open_after_step_3(step, engines, trainer):
        if step == 3:
            GATE["open"] = True

    cfg = _config(tmp_path, model_dir, gated=(0,), steps=6,
                  **{"async": {"mode": "full", "max_staleness": 1, "in_flight": 8, "interrupt": "finish"}})
    asyncio.run(train(cfg, log=lambda _: None, on_step=open_after_step_3))
    for trainer_version, trajs in rec.batches:  # what the trainer received: never staler than the bound
        assert all(trainer_version - min(_versions(t)) <= 1 for t in trajs)
    rows = [r for r in _rows(cfg) if r["step"] > 0]
    assert sum(r["async/groups_stale"] for r in rows) >= 1
    trained = [g for r in rows for g in r["async/groups"]]
    assert len(trained) == len(set(trained)) == 12  # every trained group once
    assert 0 in trained  # the dropped task ran again and was trained, fresh
    group0 = [t for _, trajs in rec.batches for t in trajs if t.task.id == "t0"]
    assert group0 and all(min(_versions(t)) >= 3 for t in group0)


def test_resume_interrupt_records_two_versions_in_one_episode(tmp_path, model_dir, monkeypatch):
    """`interrupt: resume`: an update aborts the running episodes and continues them under the new weights; the held
    episode's first turn comes from version 0, its later turns from the weights after the gate opened."""
    rec = _Recorder(monkeypatch)

    def open_after_step_1(step, engines, trainer):
        if step == 1:
            GATE["open"] = True

    cfg = _config(tmp_path, model_dir, gated=(2,), steps=3,
                  **{"async": {"mode": "full", "max_staleness": 2, "in_flight": 8, "interrupt": "resume"}})
    asyncio.run(train(cfg, log=lambda _: None, on_step=open_after_step_1))
    held = [t for _, trajs in rec.batches for t in trajs if t.task.id == "t2"]
    assert held, "the held group was trained"
    for t in held:
        versions = _versions(t)
        assert versions[0] == 0 and max(versions) >= 1 and t.metadata["resumed"] >= 1
        assert sum(t.metadata["weight_version_tokens"]) == sum(t.loss_mask)  # every generated token has a version
        assert t.num_turns == 3 and t.status == "completed"
    rows = [r for r in _rows(cfg) if r["step"] > 0]
    assert max(r["async/mixed_version_episodes"] for r in rows) > 0


def test_a_trainer_exception_mid_overlapped_step_ends_the_run_with_the_reason_and_a_checkpoint(tmp_path, model_dir,
                                                                                                monkeypatch):
    _Recorder(monkeypatch, fail_at=2)
    cfg = _config(tmp_path, model_dir, steps=4, **{"async": {"mode": "overlap"}})
    with pytest.raises(RuntimeError, match=r"ran out of memory \(injected\); the trainer after step 1 is saved"):
        asyncio.run(asyncio.wait_for(train(cfg, log=lambda _: None), 600))  # the bound is a safety net only
    saved = Path(cfg.run_dir) / "checkpoints"
    assert (saved / "latest").read_text() == "step_1" and (saved / "step_1" / "model").is_dir()


def test_an_engine_error_during_a_weight_sync_in_full_mode_ends_the_run_with_a_checkpoint(tmp_path, model_dir,
                                                                                          monkeypatch):
    from slime_env.agents.transformers_policy import TransformersPolicy

    original = TransformersPolicy.update_weights
    calls = {"n": 0}

    async def update_weights(self, weights, weight_version, **kw):
        calls["n"] += 1
        if calls["n"] == 3:  # the initial sync, step 1's, then step 2's fails
            raise RuntimeError("CUDA error: an illegal memory access (injected)")
        return await original(self, weights, weight_version, **kw)

    monkeypatch.setattr(TransformersPolicy, "update_weights", update_weights)
    cfg = _config(tmp_path, model_dir, steps=4, **{"async": {"mode": "full", "in_flight": 8}})
    with pytest.raises(RuntimeError, match=r"illegal memory access \(injected\); the trainer after step 2 is saved"):
        asyncio.run(asyncio.wait_for(train(cfg, log=lambda _: None), 600))
    state = json.loads((Path(cfg.run_dir) / "checkpoints" / "step_2" / "async_state.json").read_text())
    assert len(state["trained_groups"]) == 4


KILLED_RUN = """
import asyncio, json, sys
sys.path.insert(0, {tests!r})
import async_support
async_support.GATE["open"] = True
from slime_env.trainers.run import TrainConfig, train
cfg = TrainConfig.from_dict(json.loads({raw!r}))
asyncio.run(train(cfg, log=print))
"""


def test_kill_9_and_resume_in_full_mode_trains_every_group_exactly_once(tmp_path, model_dir):
    cfg = _config(tmp_path, model_dir, steps=6, save_every=1,
                  **{"async": {"mode": "full", "max_staleness": 1, "in_flight": 8}})
    raw = {k: v for k, v in cfg.__dict__.items() if k != "async_"} | {"async": cfg.async_}
    script = tmp_path / "run.py"
    script.write_text(KILLED_RUN.format(tests=str(Path(async_support.__file__).parent), raw=json.dumps(raw)))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        for line in proc.stdout:  # the event: step 3 logged (its checkpoint follows; kill whatever state it is in)
            if line.startswith("step 3:"):
                break
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    latest = Path(cfg.run_dir) / "checkpoints" / "latest"
    assert latest.exists(), "no checkpoint before the kill"
    saved_at = int(latest.read_text().split("_")[1])
    resumed = TrainConfig.from_dict({**raw, "resume": True})
    GATE["open"] = True
    asyncio.run(train(resumed, log=lambda _: None))
    rows = [r for r in _rows(resumed) if r["step"] > 0]
    assert [r["step"] for r in rows] == list(range(1, 7))  # the rolled-back steps are not in the record twice
    trained = [g for r in rows for g in r["async/groups"]]
    assert len(trained) == len(set(trained)) == 12  # none twice, none lost
    after = [r for r in rows if r["step"] > saved_at]
    assert all(r["async/staleness_max"] <= 1 for r in after)
