"""The examples users copy must keep running."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_guess_number_example():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "guess_number_env.py")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "status=completed turns=3 reward=1.0" in out.stdout
    assert "status=completed" in out.stdout.splitlines()[-1]


def test_sandbox_example():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "sandbox_run.py")], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    for status in ("ok", "error", "timeout", "memory", "output_limit"):
        assert f"{status:13s} -> {status} " in out.stdout, out.stdout


def test_math_example():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "math_envs.py")], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("Math-v0       reward=1.0")
    assert lines[1].startswith("MathTool-v0   reward=1.0 turns=2 tool output='385'")
    assert lines[2].endswith("reward=1.0")


def test_code_example():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "code_env.py")], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Code-v0: status=completed reward=1.0 turn_rewards=[0.0, 1.0]" in out.stdout
    assert "Expected:\n  3\n  Got:\n  2" in out.stdout
    assert "HumanEval canonical solutions: 10/10 pass" in out.stdout
    forged, honest = re.search(r"forged reports pass (\d+)/\d+ cases; `return True` passes (\d+)/", out.stdout).groups()
    assert int(forged) <= int(honest)


def test_multi_agent_example():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "multi_agent_game.py")], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "tic-tac-toe x: status=completed reward=+1 turns=4" in out.stdout
    assert "tic-tac-toe o: status=completed reward=-1 turns=3" in out.stdout
    assert "{'player_0': [-1.0, 1.0, 0.0], 'player_1': [1.0, -1.0, 0.0]}" in out.stdout
    assert "against the perfect bot: reward -1" in out.stdout


def test_search_example():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "search_env.py")], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "information (masked): <information>Doc 1(Title:" in out.stdout
    assert out.stdout.strip().splitlines()[-1].startswith("status=completed reward=1.0")


def test_tool_env_example():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "tool_env.py")], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "tool road_distance [call_1_0]: 465.0\ntool road_distance [call_1_1]: 470.0" in out.stdout
    assert "argument 'to_unit': Input should be 'm', 'km' or 'mi'" in out.stdout
    assert "status=completed reward=1.1 turns=4" in out.stdout


def test_tool_env_trains_from_its_file(tmp_path):
    """From a function to a training run: `slime-env train` builds the env and the tasks (train and held-out, two of
    those here) from the example file."""
    out = subprocess.run([sys.executable, "-m", "slime_env", "train", "--config", "examples/tool_env.yaml",
                          "--steps", "1", "--set", "eval_data.n=2", "--run-dir", str(tmp_path / "run")],
                         capture_output=True, text=True,
                         timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["step"] == 1][0]
    assert trained["train/tokens"] > 0 and sum(trained["rollout/statuses"].values()) == 8


def test_an_openai_sdk_agent_trains_unchanged_from_its_example(tmp_path):
    """examples/agent_train.yaml as a user runs it (one step): the plain OpenAI-SDK agent of examples/openai_agent.py
    runs against the gateway in front of the embedded SmolLM2, every episode ends completed, GRPO trains on the
    recorded tokens, and the held-out evaluation runs the same agent greedily (on four tasks here)."""
    out = subprocess.run([sys.executable, "-m", "slime_env", "train", "--config", "examples/agent_train.yaml",
                          "--steps", "1", "--set", "eval_data.n=4", "--run-dir", str(tmp_path / "run")],
                         capture_output=True, text=True,
                         timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["step"] == 1][0]
    assert trained["train/tokens"] > 0 and trained["rollout/statuses"] == {"completed": 8}
    assert trained["eval/failed"] == 0 and 0.0 <= trained["eval/accuracy"] <= 1.0


@pytest.mark.parametrize("example", ["anthropic_agent", "langgraph_agent"])
def test_anthropic_and_langgraph_agents_train_unchanged_from_their_examples(example, tmp_path):
    """The same run with `--env` swapped: an Anthropic-SDK agent (the Messages route, `api="anthropic"`) and
    LangGraph's prebuilt ReAct agent on langchain-openai train one GRPO step; every episode completes with a strict
    ledger and the held-out evaluation (four tasks here) runs the same agent."""
    pytest.importorskip("anthropic" if example == "anthropic_agent" else "langgraph")
    out = subprocess.run([sys.executable, "-m", "slime_env", "train", "--config", "examples/agent_train.yaml",
                          "--env", f"examples/{example}.py:make_env", "--steps", "1", "--set", "eval_data.n=4",
                          "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"training examples/{example}.py:make_env" in out.stdout
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["step"] == 1][0]
    assert trained["train/tokens"] > 0 and trained["rollout/statuses"] == {"completed": 8}
    assert trained["eval/failed"] == 0 and 0.0 <= trained["eval/accuracy"] <= 1.0
    groups = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    trajs = [t for g in groups for t in g["trajectories"]]
    assert trajs and all(sum(t["loss_mask"]) > 0 and t["metadata"]["calls"] for t in trajs)


def test_rollout_workers_example():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "rollout_workers.py")], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("completed 512, mean reward 1.00"), out.stdout
    assert out.stdout.startswith("64 groups, 512 episodes")


def test_pipeline_example_trains_against_two_engine_servers(tmp_path):
    """examples/pipeline_serve.yaml as a user runs it (one step, no evaluation): two serve-engine processes."""
    out = subprocess.run([sys.executable, "-m", "slime_env", "train", "--config", "examples/pipeline_serve.yaml",
                          "--steps", "1", "--set", "eval_data={}", "--run-dir", str(tmp_path / "run")], cwd=ROOT,
                         capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 1 and rows[-1]["engines/up"] == 2 and rows[-1]["sync/bytes"] > 0
    assert len(list((tmp_path / "run" / "engines").glob("engine_*.log"))) == 2


def test_two_gpu_async_example_places_the_engine_on_gpu_1():
    """examples/async_two_gpu.yaml (a GPU run: on two H100s in docs/benchmarks.md) is a valid config that puts the
    engine on GPU 1 and trains asynchronously."""
    from slime_env.trainers.run.engines import EngineConfig
    from slime_env.trainers.run import TrainConfig

    cfg = TrainConfig.from_yaml(ROOT / "examples" / "async_two_gpu.yaml")
    engine = EngineConfig.from_dict(cfg.engine)
    assert engine.kind == "serve" and engine.gpus == [1] and cfg.async_["mode"] == "overlap"


def test_async_example_trains_fully_asynchronously(tmp_path):
    """examples/async_train.yaml as a user runs it (two steps, no evaluation): every batch at most one version old."""
    out = subprocess.run([sys.executable, "-m", "slime_env", "train", "--config", "examples/async_train.yaml",
                          "--steps", "2", "--set", "eval_data={}", "--run-dir", str(tmp_path / "run")], cwd=ROOT,
                         capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["async/staleness_max"] <= 1 and "train/off_policy/clipped_frac" in r for r in steps)
    assert (tmp_path / "run" / "checkpoints" / "step_2" / "async_state.json").exists()
