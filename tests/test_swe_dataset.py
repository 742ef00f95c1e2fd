"""The shipped SWE task set (examples/swe_tasks), checked without Docker: its size, that every folder is what the
pinned manifest and the generator make (the repository lines of each Dockerfile, the grading code, the bug and its
oracle, the hidden tests), that no statement gives the bug away, and that the build log accounts for every task.
(`tests/test_swe_forgery.py` rebuilds some of it with Docker and compares.)"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
from slime_env.envs.swe.manifest import load_manifest, repo_dockerfile, repo_image_tag
from slime_env.envs.swe.patches import patch_files
from slime_env.envs.swe.task import GRADE_SOURCE, find_tasks, load_task

ROOT = Path(__file__).resolve().parents[1] / "examples" / "swe_tasks"


@pytest.fixture(scope="module")
def tasks():
    folders = find_tasks(ROOT)
    assert folders, f"no SWE tasks under {ROOT} (make swe-tasks)"
    return [load_task(f) for f in folders]


def test_the_set_is_large_enough_and_spread_over_repositories_and_kinds(tasks):
    repos = Counter(t.repo for t in tasks)
    kinds = Counter(t.mutation["kind"] for t in tasks)
    assert len(tasks) >= 100 and len(repos) >= 3 and min(repos.values()) >= 10, repos
    assert len(kinds) >= 6, kinds
    assert len({t.name for t in tasks}) == len(tasks)


def test_every_folder_is_what_the_manifest_and_the_generator_make(tasks):
    manifest = load_manifest()
    grade_source = GRADE_SOURCE.read_text()
    for t in tasks:
        spec = manifest[t.repo]
        assert (t.version, t.sdist_sha256, t.source_dir) == (spec.version, spec.sdist_sha256, spec.source_dir)
        assert t.repo_dockerfile == repo_dockerfile(spec) and t.image == repo_image_tag(spec), t.name
        assert (t.path / "environment" / "Dockerfile").read_text() == t.task_dockerfile()
        assert (t.path / "tests" / "grade.py").read_text() == grade_source, t.name
        assert t.path.name == t.name and t.name.startswith(f"{t.repo}__{t.mutation['kind']}__")
        assert patch_files(t.bug_patch) == [t.mutation["file"]] and spec.is_source_path(t.mutation["file"])
        assert t.bug_patch in (t.path / "solution" / "solve.sh").read_text()
        assert 1 <= len(t.fail_to_pass) <= 30 and not set(t.fail_to_pass) & set(t.pass_to_pass), t.name
        assert sorted({n.split("::")[0] for n in t.fail_to_pass}) == sorted(t.hidden_tests)
        for hidden in t.hidden_tests:
            assert spec.is_test_path(hidden) and (t.path / "tests" / "hidden" / hidden).is_file()
            assert hidden not in t.protected
        assert t.difficulty in ("easy", "medium", "hard")
        assert not any(spec.is_source_path(p) for p in t.protected)


def test_no_statement_gives_the_bug_away(tasks):
    for t in tasks:
        text = t.instruction
        m = t.mutation
        assert m["file"] not in text and m["kind"] not in text and m["description"] not in text, t.name
        assert not re.search(rf"\bline {m['line']}\b|:{m['line']}\b", text), t.name
        assert "0x7f" not in text and t.fail_to_pass[0] in text


def test_the_build_log_accounts_for_every_task(tasks):
    records = [json.loads(line) for line in (ROOT / "BUILD_LOG.jsonl").read_text().splitlines()]
    kept = {r["task"] for r in records if r["event"] == "candidate" and r.get("task")}
    assert kept == {t.name for t in tasks}
    for r in records:
        if r["event"] == "candidate":
            assert r["status"] in ("kept", "rejected") and (r["status"] == "kept" or r["reason"]), r
    summary = json.loads((ROOT / "BUILD_SUMMARY.json").read_text())
    assert summary["tasks"] == len(tasks) and records[-1]["event"] == "summary"
    assert {k: v["tasks"] for k, v in summary["repos"].items()} == dict(Counter(t.repo for t in tasks))


def test_swe_tasks_hold_a_repository_out_and_name_bad_selections(tasks):
    from slime_env.envs.swe import swe_tasks

    from slime_env import InvalidInput

    held_repo = sorted({t.repo for t in tasks})[-1]
    train = swe_tasks(ROOT, exclude_repos=[held_repo])
    held = swe_tasks(ROOT, repos=[held_repo])
    assert ({t["metadata"]["repo"] for t in held} == {held_repo}
            and held_repo not in {t["metadata"]["repo"] for t in train})
    assert len(train) + len(held) == len(tasks) and len(swe_tasks(ROOT, limit=3)) == 3
    by_name = {t.name: t for t in tasks}
    for t in train[:5]:  # a Harbor-v0 task: the statement is the prompt, the folder is the task
        assert t["prompt"] == by_name[t["metadata"]["name"]].instruction
        assert Path(t["metadata"]["harbor_task"]) == Path(by_name[t["metadata"]["name"]].path)
    with pytest.raises(InvalidInput, match="no SWE task folder"):
        swe_tasks(ROOT, repos=["no-such-repo"])
    with pytest.raises(InvalidInput, match="list of repository names"):
        swe_tasks(ROOT, repos="toolz")


def test_the_training_recipe_reads_and_holds_its_eval_repository_out(monkeypatch):
    """examples/swe_train.yaml as `slime-env train` reads it (no run): its sections parse, its train and eval data
    load from the shipped set, and no eval task's repository is trained on."""
    from slime_env.trainers.run import TrainConfig
    from slime_env.trainers.run.data import load_split

    monkeypatch.chdir(ROOT.parents[1])  # the recipe's paths are relative to the repository, as users run it
    cfg = TrainConfig.from_yaml(ROOT.parent / "swe_train.yaml")
    assert cfg.env == "Harbor-v0" and cfg.sections.trainer.backend == "megatron" and cfg.async_["mode"] == "full"
    train, held = load_split(cfg.train_data, "train_data"), load_split(cfg.eval_data, "eval_data")
    train_repos = {t.metadata["repo"] for t in train}
    assert len(train) >= 60 and len(held) == 16 and {t.metadata["repo"] for t in held}.isdisjoint(train_repos)
