"""A SWE task as a Harbor task folder: `write_task(out, task)` emits one, `load_task(path)` reads one back.

```
<name>/
  task.toml                 Harbor's fields + [metadata.swe] (repo, pins, test ids, the mutation: teacher-only)
  instruction.md            the problem statement (from the failing tests' names and messages)
  environment/Dockerfile    the repository image's lines, then: apply bug.patch, delete the hidden tests, new git
  environment/bug.patch     the bug (a git diff of one file)
  solution/solve.sh         the oracle: the bug reversed
  tests/test.sh             Harbor's verifier (shared mode): runs tests/grade.py
  tests/grade.py            the grading code, a verbatim copy of slime_env/envs/swe/grade.py
  tests/spec.json           FAIL_TO_PASS, PASS_TO_PASS, hidden test paths, what pytest runs
  tests/hidden/<path>       the FAIL_TO_PASS test files, as they are in the clean repository
```
"""

from __future__ import annotations

import hashlib
import json
import shlex
import shutil
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from slime_env.errors import InvalidInput
from slime_env.envs.swe.manifest import GIT_IDENTITY, TASK_MARKER, WORKDIR, RepoSpec, repo_lines_of

GRADE_SOURCE = Path(__file__).with_name("grade.py")
PATCH_EOF = "SLIME_ENV_SWE_PATCH"


@dataclass(frozen=True)
class SweTask:
    """One task: the repository (`repo`, `version`, `sdist_sha256`, its image `image` and Dockerfile lines
    `repo_dockerfile`), what a fix may edit (`source_dir`), what pytest runs (`test_paths` minus `deselect`), the
    tests that must pass (`fail_to_pass`, `pass_to_pass`), the test files the agent does not see
    (`hidden_tests`), the bug (`bug_patch`, `mutation`: teacher-only), the statement (`instruction`) and the
    sha256 of each file the agent must not change (`protected`: visible tests, configuration; Harbor's check)."""

    name: str
    repo: str
    version: str
    sdist_sha256: str
    image: str
    repo_dockerfile: str
    source_dir: str
    test_paths: tuple[str, ...]
    deselect: tuple[str, ...]
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    hidden_tests: tuple[str, ...]
    bug_patch: str
    mutation: dict
    instruction: str
    protected: Mapping[str, str] = field(default_factory=dict)
    difficulty: str = "medium"
    verifier_timeout_s: float = 300.0
    agent_timeout_s: float = 1800.0
    cpus: float = 1.0
    memory_mb: int = 2048
    path: Path | None = field(default=None, compare=False)

    def repo_spec(self) -> RepoSpec:
        """The repository's paths as a RepoSpec (which paths are tests, which are source)."""
        return RepoSpec(name=self.repo, version=self.version, sdist_sha256=self.sdist_sha256,
                        source_dir=self.source_dir, test_paths=self.test_paths, deselect=self.deselect)

    def task_dockerfile(self) -> str:
        """The agent's image: the repository's lines, then the bug, the hidden tests removed and git restarted
        (one commit: the history holds neither the clean code nor the hidden tests)."""
        rm = " ".join(shlex.quote(p) for p in self.hidden_tests)
        return (self.repo_dockerfile + f"{TASK_MARKER} {self.name}: the bug, and the hidden tests out of view ---\n"
                "COPY bug.patch /tmp/bug.patch\n"
                f"RUN git apply /tmp/bug.patch && rm /tmp/bug.patch && rm -f {rm} && rm -rf .git && git init -q "
                f"&& git add -A && {GIT_IDENTITY} git commit -q -m \"{self.repo} {self.version}\"\n")


def _p2p_digest(ids) -> str:
    return hashlib.sha256("\n".join(sorted(ids)).encode()).hexdigest()


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, (list, tuple)):
        if not v:
            return "[]"
        return "[\n" + "".join(f"    {_toml_value(x)},\n" for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _table(name: str, values: dict) -> str:
    return f"[{name}]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in values.items()) + "\n"


def task_toml(task: SweTask) -> str:
    swe = {
        "instance_id": task.name, "repo": task.repo, "version": task.version, "sdist_sha256": task.sdist_sha256,
        "image": task.image, "source_dir": task.source_dir, "test_paths": list(task.test_paths),
        "deselect": list(task.deselect), "hidden_tests": list(task.hidden_tests),
        "fail_to_pass": list(task.fail_to_pass),
        "pass_to_pass": {"file": "tests/spec.json", "count": len(task.pass_to_pass),
                         "sha256": _p2p_digest(task.pass_to_pass)},
    }
    return ("# A SWE-style bug-fix task generated by slime_env.envs.swe (slime-env swe build). The agent never sees\n"
            "# this file: [metadata.swe.mutation] says where the bug is (for teachers and oracles only).\n"
            'version = "1.0"\n\n'
            + _table("metadata", {"category": "swe", "difficulty": task.difficulty,
                                  "tags": ["swe", "python", "bug-fix", task.repo, task.mutation["kind"]]})
            + _table("metadata.swe", swe)
            + _table("metadata.swe.mutation", task.mutation)
            + _table("verifier", {"timeout_sec": float(task.verifier_timeout_s)})
            + _table("agent", {"timeout_sec": float(task.agent_timeout_s)})
            + _table("environment", {"build_timeout_sec": 900.0, "cpus": task.cpus, "memory_mb": task.memory_mb,
                                     "network_mode": "no-network", "workdir": WORKDIR})).rstrip("\n") + "\n"


TEST_SH = """#!/bin/bash
# Harbor's verifier for this task (shared mode: it runs in the agent's container, after the agent): restore the
# hidden tests, run the suite, write /logs/verifier/reward.txt. slime_env's own runner does not use this script: its
# reward (slime_env.envs.swe.reward) runs the tests on a clean copy of the repository with the agent's diff applied.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
cd /repo && python3 /tests/grade.py --spec /tests/spec.json --repo /repo --out /logs/verifier
"""


def write_task(out_dir: str | Path, task: SweTask, hidden_files: dict[str, str]) -> Path:
    """Write `task` as the Harbor folder `out_dir/<task.name>` (replacing one there); `hidden_files` holds the
    clean text of each hidden test file. Returns the folder."""
    if set(hidden_files) != set(task.hidden_tests):
        raise InvalidInput(f"task {task.name}: hidden_files must be exactly the hidden tests {task.hidden_tests}")
    root = Path(out_dir) / task.name
    if root.exists():
        shutil.rmtree(root)
    for sub in ("environment", "solution", "tests/hidden"):
        (root / sub).mkdir(parents=True)
    (root / "task.toml").write_text(task_toml(task))
    (root / "instruction.md").write_text(task.instruction.rstrip("\n") + "\n")
    (root / "environment" / "Dockerfile").write_text(task.task_dockerfile())
    (root / "environment" / "bug.patch").write_text(task.bug_patch)
    solve = root / "solution" / "solve.sh"
    solve.write_text("#!/bin/bash\n# The oracle: this task's bug, reversed.\nset -e\ncd /repo\n"
                     f"git apply -R --whitespace=nowarn <<'{PATCH_EOF}'\n{task.bug_patch}{PATCH_EOF}\n")
    test_sh = root / "tests" / "test.sh"
    test_sh.write_text(TEST_SH)
    for script in (solve, test_sh):
        script.chmod(0o755)
    shutil.copyfile(GRADE_SOURCE, root / "tests" / "grade.py")
    spec = {"fail_to_pass": list(task.fail_to_pass), "pass_to_pass": list(task.pass_to_pass),
            "hidden_tests": list(task.hidden_tests), "test_paths": list(task.test_paths),
            "deselect": list(task.deselect), "timeout_sec": task.verifier_timeout_s,
            "protected": dict(sorted(task.protected.items()))}
    (root / "tests" / "spec.json").write_text(json.dumps(spec, indent=0) + "\n")
    for rel, text in sorted(hidden_files.items()):
        target = root / "tests" / "hidden" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return root


def load_task(path: str | Path) -> SweTask:
    """Read a SWE task folder (as `write_task` writes it). InvalidInput names the file and field at fault."""
    root = Path(path)
    toml_path = root / "task.toml"
    try:
        config = tomllib.loads(toml_path.read_text())
        swe = config["metadata"]["swe"]
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise InvalidInput(f"{toml_path}: cannot read the task: {e}") from None
    except KeyError:
        raise InvalidInput(f"{toml_path}: no [metadata.swe] table: not a SWE task") from None
    try:
        p2p = swe["pass_to_pass"]
        spec_path = root / "tests" / "spec.json"
        verifier_spec = json.loads(spec_path.read_text()) if spec_path.exists() else {}
        if isinstance(p2p, dict):
            ids = json.loads((root / p2p["file"]).read_text())["pass_to_pass"]
            if len(ids) != p2p["count"] or _p2p_digest(ids) != p2p["sha256"]:
                raise InvalidInput(f"{root / p2p['file']}: its pass_to_pass list does not match task.toml's count "
                                   f"and sha256")
        else:
            ids = list(p2p)
        dockerfile = (root / "environment" / "Dockerfile").read_text()
        return SweTask(
            name=swe.get("instance_id", root.name), repo=swe["repo"], version=swe["version"],
            sdist_sha256=swe["sdist_sha256"], image=swe["image"], repo_dockerfile=repo_lines_of(dockerfile),
            source_dir=swe["source_dir"], test_paths=tuple(swe["test_paths"]), deselect=tuple(swe["deselect"]),
            fail_to_pass=tuple(swe["fail_to_pass"]), pass_to_pass=tuple(ids), hidden_tests=tuple(swe["hidden_tests"]),
            bug_patch=(root / "environment" / "bug.patch").read_text(), mutation=dict(swe.get("mutation", {})),
            instruction=(root / "instruction.md").read_text(), protected=verifier_spec.get("protected", {}),
            difficulty=config["metadata"].get("difficulty", "medium"),
            verifier_timeout_s=float(config.get("verifier", {}).get("timeout_sec", 300.0)),
            agent_timeout_s=float(config.get("agent", {}).get("timeout_sec", 1800.0)),
            cpus=config.get("environment", {}).get("cpus", 1.0),
            memory_mb=int(config.get("environment", {}).get("memory_mb", 2048)), path=root)
    except KeyError as e:
        raise InvalidInput(f"{toml_path}: [metadata.swe] lacks {e.args[0]!r}") from None
    except OSError as e:
        raise InvalidInput(f"{root}: a file of the task is missing: {e}") from None


def find_tasks(root: str | Path) -> list[Path]:
    """The SWE task folders under `root` (one level down), sorted by name."""
    return sorted(p.parent for p in Path(root).glob("*/task.toml") if "[metadata.swe]" in p.read_text())


def swe_tasks(path: str | Path, *, repos: list[str] | None = None, exclude_repos: list[str] | None = None,
              limit: int | None = None) -> list[dict]:
    """SWE task folders under `path` as `Harbor-v0` tasks for `train_data` / `eval_data`
    (`{generator: "slime_env.envs.swe:swe_tasks", path: DIR, exclude_repos: [tabulate]}`): `repos` keeps only
    those repositories, `exclude_repos` drops them (a held-out repository), `limit` keeps the first that many."""
    for name, value in (("repos", repos), ("exclude_repos", exclude_repos)):
        if value is not None and (not isinstance(value, (list, tuple)) or not all(isinstance(r, str) for r in value)):
            raise InvalidInput(f"swe_tasks: {name} must be a list of repository names, got {value!r}")
    out = []
    for folder in find_tasks(path):
        task = load_task(folder)
        if (repos is not None and task.repo not in repos) or (exclude_repos and task.repo in exclude_repos):
            continue
        out.append({"prompt": task.instruction, "metadata": {"harbor_task": str(folder), "name": task.name,
                                                              "repo": task.repo}})
    if not out:
        raise InvalidInput(f"swe_tasks: no SWE task folder under {path} matches repos={repos} "
                           f"exclude_repos={exclude_repos}")
    return out[:limit] if limit is not None else out
