"""`slime-env train` through agent harnesses working in workspaces on Harbor tasks: mini-swe-agent unchanged and a plain
OpenAI-SDK loop, one step each on the embedded SmolLM2 (CPU), with the run's workspaces gone after it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from workspace_support import require_backend

ROOT = Path(__file__).resolve().parents[1]



def _require_mini_swe_agent() -> None:
    """Skip without mini-swe-agent (`make` installs it; CI fails instead). Found, not imported: importing it here,
    before our harness sets its environment, would print its banner and make ~/.config/mini-swe-agent."""
    import importlib.util
    import os

    if importlib.util.find_spec("minisweagent") is None:
        if os.environ.get("CI"):
            pytest.fail("CI must have mini-swe-agent (the dev extra)")
        pytest.skip("mini-swe-agent is not installed")


def _config(tmp_path: Path) -> Path:
    config = yaml.safe_load((ROOT / "examples" / "harbor_agent_train.yaml").read_text())
    tasks = str(ROOT / "examples" / "harbor_tasks")
    config.update(prompts_per_step=1, n_samples_per_prompt=2, max_new_tokens=64, max_concurrency=2,
                  train_data={"generator": "slime_env.envs.harbor:harbor_tasks", "path": tasks, "split": "train",
                              "limit": 4},
                  # no evaluation: nothing here asserts it, and agent envs' evaluation through the gateway is
                  # test_examples.py's (the SDK agents' train tests evaluate)
                  eval_data={})
    # one trajectory per micro-batch: an agent's episodes run to thousands of tokens, and the fp32 logits of four of
    # them padded together (49,152 columns a token) took the run to 8.8 GB resident, 3.8 GB one at a time; the
    # step's token mean is the same
    config["trainer"] = {**config["trainer"], "micro_batch_size": 1}
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _containers_of(pid: int) -> list[str]:
    from slime_env.tools_sandbox.workspace.docker import LABEL, OWNER_LABEL, docker_client

    prefix = f"{socket.gethostname()}:{pid}:"
    return [c.id for c in docker_client().containers.list(all=True, filters={"label": LABEL}, sparse=True)
            if (c.attrs.get("Labels") or {}).get(OWNER_LABEL, "").startswith(prefix)]


@pytest.mark.parametrize("harness", ["examples/mini_swe_harbor.py:make_env",
                                     "examples/workspace_openai_agent.py:make_env"])
def test_a_harness_trains_on_harbor_tasks_through_slime_env_train(harness, tmp_path):
    require_backend("docker")
    if "mini_swe" in harness:
        _require_mini_swe_agent()
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-P", "-m", "slime_env", "train", "--config", str(_config(tmp_path)),
                             "--env", harness, "--steps", "1", "--run-dir", str(run)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=1500)
    assert proc.returncode == 0, out[-4000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["step"] == 1][0]
    assert trained["train/tokens"] > 0
    # the step's episode time split: generation, and the container's share (start, commands, scoring)
    assert trained["rollout/time/container_s"] > 0 and 0 < trained["rollout/time/container_frac"] <= 1
    assert "container " in out and "generation " in out
    # two episodes; a harness's rewritten history (mini-swe-agent drops a reply it cannot parse) adds side branches
    assert sum(trained["rollout/statuses"].values()) >= 2 and "failed" not in trained["rollout/statuses"], trained
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    episodes = [t for s in samples for t in s["trajectories"]]
    assert episodes and all(t["metadata"]["workspace"]["harbor"]["mode"] == "isolated" for t in episodes)
    assert all(t["metadata"]["workspace"]["harbor"]["status"] in ("ok", "missing") for t in episodes)
    assert _containers_of(proc.pid) == []  # the run's workspaces went with it
