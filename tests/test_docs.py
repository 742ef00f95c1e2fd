"""The documentation site builds with `mkdocs build --strict`: a broken link, a missing page or an API
reference that no longer resolves fails the suite."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("material", reason="the [docs] extra is not installed")
    pytest.importorskip("mkdocstrings")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    site = tmp_path / "site"
    api = (site / "api" / "index.html").read_text()
    assert "ToolEnv" in api and "StatefulToolEnv" in api and "run_episode" in api
    assert (site / "_src" / "examples" / "tool_env.py").is_file()  # linked example files are in the site
    tools = (site / "tools" / "index.html").read_text()
    assert "../_src/examples/tool_env.py" in tools
    assert "fonts.googleapis" not in (site / "index.html").read_text()  # no fetch from outside: works offline


def test_the_index_lists_every_page():
    """docs/index.md is where a newcomer starts: every page of docs/ has its row there."""
    import re

    listed = set(re.findall(r"\]\(([\w.-]+\.md)\)", (ROOT / "docs" / "index.md").read_text()))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"index.md"}
    assert sorted(pages - listed) == []


def test_every_training_config_field_is_documented():
    """The config reference (docs/trainers.md, with megatron.md for the GPU backend) names every field."""
    import dataclasses

    from slime_env.trainers.torch_trainer import TrainerConfig
    from slime_env.trainers.run import TrainConfig

    text = (ROOT / "docs" / "trainers.md").read_text() + (ROOT / "docs" / "megatron.md").read_text()
    fields = [f.name.rstrip("_") for f in dataclasses.fields(TrainConfig) + dataclasses.fields(TrainerConfig)]
    assert [f for f in fields if f"`{f}`" not in text] == []


def test_the_getting_started_snippets_run_as_written(capsys):
    """docs/getting-started.md's Python blocks, run in order in one namespace: the env it writes gets its tasks
    (`default_tasks` for a reset without one, `options` for a given one) and works from Gymnasium as the page says."""
    import re

    import slime_env

    page = (ROOT / "docs" / "getting-started.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, re.S)
    assert len(blocks) >= 2 and any("gymnasium.make" in b for b in blocks)
    namespace: dict = {"__name__": "getting_started"}
    try:
        for block in blocks:
            exec(compile(block, "docs/getting-started.md", "exec"), namespace)
    finally:
        import gymnasium

        slime_env.registry._REGISTRY.pop("Echo-v0", None)
        gymnasium.registry.pop("slime_env/Echo-v0", None)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("completed 1.0") and out[-1] == " 1.0 True"
