"""`slime-env train` killed with SIGKILL and resumed (`resume: true`): every per-step record is rolled back to the
checkpoint (metrics.jsonl, samples.jsonl), in synchronous and asynchronous modes; a synchronous resume keeps the
run's group and episode indices, so with `seed_sampling` its rollouts are the uninterrupted run's; checkpoints are
kept by `keep_last` / `keep_every` and written so that a kill at any point leaves `latest` whole.

The run is real (the embedded engine on a tiny random Llama with SmolLM2's tokenizer, `AsyncGate-v0` with its gate
open, the torch trainer); the kill is a real SIGKILL that the killed run sends itself at a chosen point of step 2
(after its samples are written, after its metrics row, in the middle of its checkpoint), so where it dies is decided
by the test, not by timing."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

import async_support  # noqa: E402
from async_support import GATE, tiny_model_dir, write_tasks  # noqa: E402
from slime_env.trainers.run import TrainConfig, train  # noqa: E402
from slime_env.trainers.run.recorder import Recorder  # noqa: E402

STEPS = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("resume_model"))


@pytest.fixture(autouse=True)
def _open_gate():
    GATE["open"] = True


def _raw(root: Path, model_dir: Path, **over) -> dict:
    tasks = write_tasks(root / "tasks.jsonl", 16)
    return {"run_dir": str(root / "run"), "model": str(model_dir), "env": "AsyncGate-v0",
            "train_data": {"path": str(tasks)}, "steps": STEPS, "prompts_per_step": 2, "n_samples_per_prompt": 2,
            "max_turns": 2, "max_new_tokens": 4, "max_concurrency": 8, "seed_sampling": True, "eval_every": 100,
            "save_every": 1, "keep_last": 2, "trainer": {"lr": 1e-3, "micro_batch_size": 4}, **over}


def _lines(run: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (run / name).read_text().splitlines()]


def _rollouts(run: Path) -> list[tuple]:
    """What was generated, step by step: (step, group, episode index, response ids, reward) of samples.jsonl."""
    return sorted((g["step"], g["group_index"], t["metadata"]["index"], tuple(t["response_ids"]), t["reward"])
                  for g in _lines(run, "samples.jsonl") for t in g["trajectories"])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, model_dir) -> Path:
    """The synchronous run, start to end."""
    root = tmp_path_factory.mktemp("uninterrupted")
    asyncio.run(train(TrainConfig.from_dict(_raw(root, model_dir)), log=lambda _: None))
    return root / "run"


KILLED_RUN = """
import asyncio, json, os, signal, sys
sys.path.insert(0, {tests!r})
import async_support
async_support.GATE["open"] = True
from slime_env.trainers.run import TrainConfig, train
from slime_env.trainers.run.recorder import Recorder
from slime_env.trainers.torch_trainer import TorchTrainer

POINT, STEP = {point!r}, 2


def die():
    from slime_env import lifeline

    print("PROCESSES", *(pid for pid, _ in lifeline.labelled(os.environ[lifeline.LABEL_ENV])), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def after(cls, name, when):
    original = getattr(cls, name)

    def patched(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if when(self, *args):
            die()
        return out

    setattr(cls, name, patched)


if POINT == "after_samples":  # the step's groups are in samples.jsonl; not trained on yet
    after(Recorder, "samples", lambda self, step, groups: step == STEP)
elif POINT == "after_metrics":  # trained, its row written; not saved
    after(Recorder, "record", lambda self, step, metrics: step == STEP)
elif POINT == "mid_checkpoint":  # the weights of the step written, the optimizer not yet
    original = TorchTrainer.save

    def save(self, path):
        if self.step_count == STEP:
            self.model.save_pretrained(os.path.join(path, "model"), safe_serialization=True)
            die()
        return original(self, path)

    TorchTrainer.save = save
cfg = TrainConfig.from_dict(json.loads({raw!r}))
asyncio.run(train(cfg, log=print))
"""


def _killed_then_resumed(root: Path, raw: dict, point: str) -> Path:
    script = root / "run.py"
    script.write_text(KILLED_RUN.format(tests=str(Path(async_support.__file__).parent), raw=json.dumps(raw),
                                        point=point))
    done = subprocess.run([sys.executable, "-P", str(script)], capture_output=True, text=True, timeout=600)
    assert done.returncode == -9, f"the run was not killed at {point}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
    run = Path(raw["run_dir"])
    assert (run / "checkpoints" / "latest").read_text() == "step_1"
    asyncio.run(train(TrainConfig.from_dict({**raw, "resume": True}), log=lambda _: None))
    return run


@pytest.mark.parametrize("point", ["after_samples", "after_metrics", "mid_checkpoint"])
def test_sigkill_mid_step_then_resume_equals_the_uninterrupted_run(tmp_path, model_dir, uninterrupted, point):
    run = _killed_then_resumed(tmp_path, _raw(tmp_path, model_dir), point)
    rows = _lines(run, "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # each step once
    assert [g["step"] for g in _lines(run, "samples.jsonl")] == [s for s in range(1, STEPS + 1) for _ in range(2)]
    got, want = _rollouts(run), _rollouts(uninterrupted)
    assert len({(step, index) for step, _, index, _, _ in got}) == len({index for _, _, index, _, _ in got})
    assert [r[:3] for r in got] == [r[:3] for r in want]  # indices go on from the checkpoint (none reused)
    assert got == want  # and so do the seeds: the same episodes, token for token
    base = {r["step"]: r for r in _lines(uninterrupted, "metrics.jsonl")}
    for r in rows:
        assert r["train/reward_mean"] == base[r["step"]]["train/reward_mean"]
        assert r["train/loss"] == pytest.approx(base[r["step"]]["train/loss"], rel=1e-4, abs=1e-6)
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["latest", "step_2", "step_3"]  # keep_last: 2, nothing partial left
    # the resumed run's clock goes on from the checkpoint's step (before: it restarted at 0)
    for before, after in zip(rows, rows[1:]):
        assert after["time/elapsed_s"] >= before["time/elapsed_s"] + after["time/step_s"], (before, after)
    assert json.loads((run / "summary.json").read_text())["elapsed_s"] >= rows[-1]["time/elapsed_s"]


def test_sigkill_in_full_async_mode_rolls_samples_back_too(tmp_path, model_dir):
    raw = _raw(tmp_path, model_dir, **{"async": {"mode": "full", "max_staleness": 1, "in_flight": 4}})
    run = _killed_then_resumed(tmp_path, raw, "after_metrics")
    assert [r["step"] for r in _lines(run, "metrics.jsonl")] == list(range(1, STEPS + 1))
    samples = _lines(run, "samples.jsonl")
    assert [g["step"] for g in samples] == [s for s in range(1, STEPS + 1) for _ in range(2)]
    trained = [g["group_index"] for g in samples]
    assert len(set(trained)) == len(trained)  # no group of the rolled-back step left beside its redo


class _FakeTrainer:
    def __init__(self):
        self.step_count = 0

    def save(self, path):
        Path(path).mkdir(parents=True)
        (Path(path) / "trainer.pt").write_text(str(self.step_count))

    def load(self, path):
        self.step_count = int((Path(path) / "trainer.pt").read_text())


def test_checkpoints_kept_are_the_last_and_every_kth_and_a_resume_finds_a_whole_one(tmp_path):
    rec = Recorder(tmp_path, sample_groups=0, log=lambda _: None, keep_last=2, keep_every=3)
    trainer = _FakeTrainer()
    for step in range(1, 8):
        trainer.step_count = step
        rec.checkpoint(trainer, f"step_{step}", {"trained_groups": [step]})
    assert sorted(p.name for p in rec.checkpoints.iterdir()) == ["latest", "step_3", "step_6", "step_7"]
    rec.checkpoint(trainer, "step_7", None)  # the same step saved again (a run that ends where it saved)
    (rec.checkpoints / "step_8.partial").mkdir()  # a kill in the middle of the next save
    rec.checkpoints.joinpath("step_7").rename(rec.checkpoints / "step_7.old")  # ... or while replacing step_7
    for name, rows in (("metrics.jsonl", [0, 6, 7, 8]), ("samples.jsonl", [7, 8, 8])):
        (tmp_path / name).write_text("".join(json.dumps({"step": s}) + "\n" for s in rows) + '{"step": 9, "tor')
    resumed = Recorder(tmp_path, sample_groups=0, log=lambda _: None)
    assert resumed.resume(_FakeTrainer()) == (7, {})
    assert not (rec.checkpoints / "step_8.partial").exists() and (rec.checkpoints / "step_7").is_dir()
    assert [r["step"] for r in _lines(tmp_path, "metrics.jsonl")] == [0, 6, 7]
    assert [r["step"] for r in _lines(tmp_path, "samples.jsonl")] == [7]


def test_a_resume_without_a_checkpoint_starts_over(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0}) + "\n")
    (tmp_path / "samples.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    rec = Recorder(tmp_path, sample_groups=0, log=lambda _: None)
    assert rec.resume(_FakeTrainer()) == (0, {})
    rec.begin(resume=True)
    rec.close()
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "samples.jsonl").exists()


def test_sigkill_of_the_run_takes_its_engines_and_a_resume_reaps_what_is_left(tmp_path, model_dir):
    """`engine: serve`: the run's engine process dies with the run (its lifeline); a process of the run's label
    whose owner is gone (what a lifeline could not stop) is killed by the resumed run, which starts its own engine
    and leaves none behind."""
    import os

    from slime_env import lifeline

    raw = _raw(tmp_path, model_dir, engine={"kind": "serve", "count": 1, "device": "cpu", "weight_sync": "disk"})
    label = str(Path(raw["run_dir"]).resolve())
    script = tmp_path / "run.py"
    script.write_text(KILLED_RUN.format(tests=str(Path(async_support.__file__).parent), raw=json.dumps(raw),
                                        point="after_metrics"))
    done = subprocess.run([sys.executable, "-P", str(script)], capture_output=True, text=True, timeout=600)
    assert done.returncode == -9, done.stdout[-2000:] + done.stderr[-2000:]
    engines = [int(pid) for line in done.stdout.splitlines() if line.startswith("PROCESSES")
               for pid in line.split()[1:]]
    assert len(engines) == 1 and _gone(engines[0])  # the engine saw its lifeline end
    sync = Path(raw["run_dir"]) / "weight_sync"  # weight_sync: disk writes there; SIGKILL ran no cleanup
    left = [p.name for p in sync.iterdir()]
    assert len(left) == 1 and left[0].startswith("weights_"), left  # only the version the engine loaded last
    dead_owner = lifeline.owner_id().rsplit(":", 1)[0] + ":0"
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                              env={**os.environ, lifeline.LABEL_ENV: label, lifeline.OWNER_ENV: dead_owner})
    try:
        logs: list[str] = []
        asyncio.run(train(TrainConfig.from_dict({**raw, "resume": True}), log=logs.append))
        assert orphan.wait(30) == -9
        assert any(f"pids [{orphan.pid}]" in line for line in logs)
    finally:
        orphan.kill()
        orphan.wait()
    assert [r["step"] for r in _lines(Path(raw["run_dir"]), "metrics.jsonl")] == list(range(1, STEPS + 1))
    assert lifeline.labelled(label) == []  # the resumed run's engine stopped with it
    assert not sync.exists()  # the resumed run emptied what the killed one left, and removed it at its end


def _gone(pid: int, within_s: float = 60.0) -> bool:
    import time

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False
