"""Terminal tasks as Harbor task folders: `write_task(out, kind, seed)` writes one; `terminal_tasks(n, seed, split,
kinds)` is a dataset (`train_data: {generator: "slime_env.envs.terminal:terminal_tasks", ...}`) whose folders are
written on first use under a cache folder and reused.

A folder is a plain Harbor task: task.toml (`[environment].docker_image` and workdir /app, no network; the kind,
seed and split in `[metadata]`), instruction.md, environment/ (the files the agent starts from: Harbor uploads the
environment folder of a prebuilt image into its workdir), tests/test.sh + check.py + expected.json (the verifier:
the final files only) and solution/solve.sh (the scripted solution).

Splits: an instance is `test` (held-out seeds) iff a hash of (kind, seed) falls in one fifth, so a train and a test
split of any seeds never share an instance; held-out kinds (`HELDOUT_KINDS`) are never in `kinds="train"`.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import uuid
import zlib
from pathlib import Path
from typing import Any

from slime_env.envs.terminal.kinds import HELDOUT_KINDS, KINDS, TRAIN_KINDS, WORKDIR, make_instance
from slime_env.errors import InvalidInput

VERSION = 2  # of the generator (2: paraphrases, four primitive kinds): changed kinds never reuse stale folders
DEFAULT_IMAGE = "python:3.11-slim"
CACHE_ENV = "SLIME_ENV_TERMINAL_TASKS"
CHECK_SCRIPT = Path(__file__).with_name("verifier_check.py")
TEST_SH = """#!/bin/bash
# The verdict is the final files in /app alone (check.py); what the agent printed counts for nothing.
if python3 -I /tests/check.py /tests/expected.json; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""
TASK_TOML = """version = "1.0"

[metadata]
category = "terminal"
generator = "slime_env.envs.terminal"
generator_version = {version}
kind = "{kind}"
seed = {seed}
split = "{split}"

[verifier]
timeout_sec = 30.0

[agent]
timeout_sec = 300.0

[environment]
docker_image = "{image}"
workdir = "{workdir}"
network_mode = "no-network"
cpus = 1
memory_mb = 512
"""


def split_of(kind: str, seed: int) -> str:
    """`test` for one (kind, seed) pair in five (held-out seeds), else `train`."""
    return "test" if zlib.crc32(f"{kind}:{seed}".encode()) % 5 == 0 else "train"


def task_name(kind: str, seed: int) -> str:
    return f"{kind.replace('_', '-')}-{seed}"


def cache_root() -> Path:
    """Where `terminal_tasks` writes its folders: $SLIME_ENV_TERMINAL_TASKS, else ~/.cache/slime_env/terminal."""
    given = os.environ.get(CACHE_ENV)
    base = Path(given) if given else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "slime_env" \
        / "terminal"
    return base / f"v{VERSION}"


def write_task(out: str | Path, kind: str, seed: int, *, image: str = DEFAULT_IMAGE) -> Path:
    """Write the Harbor task folder of (`kind`, `seed`) under `out` (replacing one of the same name); its path."""
    inst = make_instance(kind, seed)
    folder = Path(out) / task_name(kind, seed)
    tmp = folder.with_name(f".{folder.name}.tmp-{uuid.uuid4().hex[:8]}")
    (tmp / "environment").mkdir(parents=True)
    (tmp / "task.toml").write_text(TASK_TOML.format(version=VERSION, kind=kind, seed=seed, split=split_of(kind, seed),
                                                    image=image, workdir=WORKDIR))
    (tmp / "instruction.md").write_text(inst.instruction + "\n")
    for rel, text in inst.files.items():
        (tmp / "environment" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / "environment" / rel).write_text(text)
    (tmp / "tests").mkdir()
    (tmp / "tests" / "test.sh").write_text(TEST_SH)
    (tmp / "tests" / "test.sh").chmod(0o755)
    shutil.copyfile(CHECK_SCRIPT, tmp / "tests" / "check.py")
    (tmp / "tests" / "expected.json").write_text(json.dumps(inst.checks, indent=1) + "\n")
    (tmp / "solution").mkdir()
    solve = "#!/bin/bash\n" + "".join(f"{c}\n" for c in inst.solution)
    (tmp / "solution" / "solve.sh").write_text(solve)
    (tmp / "solution" / "solve.sh").chmod(0o755)
    if folder.exists():
        shutil.rmtree(folder)
    try:
        tmp.rename(folder)
    except OSError:  # another process wrote the same folder meanwhile: it is the same task
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def resolve_kinds(kinds: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """Kind names from a list, or `train` (default) / `heldout` / `all`; InvalidInput naming an unknown one."""
    named = {"train": TRAIN_KINDS, "heldout": HELDOUT_KINDS, "all": tuple(KINDS)}
    if kinds is None or isinstance(kinds, str):
        if (kinds or "train") not in named:
            raise InvalidInput(f"terminal_tasks: kinds must be a list of kinds or one of {sorted(named)}, "
                               f"got {kinds!r}")
        return named[kinds or "train"]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise InvalidInput(f"terminal_tasks: unknown kinds {unknown} (the kinds are {sorted(KINDS)})")
    return tuple(kinds)


def instances(n: int, seed: int = 0, split: str | None = None,
              kinds: str | list[str] | None = None) -> list[tuple[str, int]]:
    """`n` (kind, instance seed) pairs from `seed`: kinds in turn, instance seeds drawn from `seed`, only those of
    `split` (train / test / None: both)."""
    if split not in (None, "train", "test"):
        raise InvalidInput(f"terminal_tasks: split must be 'train', 'test' or None, got {split!r}")
    if n < 0:
        raise InvalidInput(f"terminal_tasks: n must be >= 0, got {n}")
    names, rng, out = resolve_kinds(kinds), random.Random(seed), []
    while len(out) < n:
        kind = names[len(out) % len(names)]
        s = rng.randrange(1 << 31)
        if split is None or split_of(kind, s) == split:
            out.append((kind, s))
    return out


def terminal_tasks(n: int, seed: int = 0, split: str | None = None, kinds: str | list[str] | None = None,
                   root: str | None = None, image: str = DEFAULT_IMAGE) -> list[dict[str, Any]]:
    """`n` tasks for `train_data` / `eval_data`: `{"prompt": instruction, "metadata": {"harbor_task": folder, ...}}`,
    folders (their `docker_image`: `image`) written under `root` (default `cache_root()`) when missing. See
    `instances` for n, seed, split, kinds."""
    base = (Path(root) if root else cache_root()) / re.sub(r"[^A-Za-z0-9._-]", "_", image)  # one set per image
    base.mkdir(parents=True, exist_ok=True)
    out = []
    for kind, s in instances(n, seed, split, kinds):
        folder = base / task_name(kind, s)
        if not (folder / "solution" / "solve.sh").exists():
            folder = write_task(base, kind, s, image=image)
        out.append({"prompt": (folder / "instruction.md").read_text().strip(),
                    "metadata": {"harbor_task": str(folder), "name": folder.name, "kind": kind, "seed": s}})
    return out
