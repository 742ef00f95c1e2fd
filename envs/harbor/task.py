"""Harbor task folders: `load_task(path) -> HarborTask`, `load_dataset(path) -> list[HarborTask]`.

A task folder (Harbor 0.26's layout)::

    task.toml          the config (`config.TaskConfig`)
    instruction.md     what the agent is told (leading canary comment lines stripped, as Harbor strips them)
    environment/       the image's build context (Dockerfile), unless [environment].docker_image names one
    tests/test.sh      the verifier (test.bat for os = "windows"); tests/Dockerfile: a separate verifier image
    solution/solve.sh  the reference solution (the oracle)
    steps/<name>/...   multi-step tasks ([[steps]])

`load_task` applies Harbor's validity rules (`Task.is_valid_dir` and the checks `Task()` makes) and raises
`slime_env.InvalidInput` naming the file and the field path (`tasks/x/task.toml: environment.cpus: ...`).
Never imports `harbor` (it needs Python >= 3.12); the tests compare this reader with Harbor's own models.
"""

from __future__ import annotations

import hashlib
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from slime_env.envs.harbor.config import FieldError, ParseNotes, TaskConfig, parse_task_config, resolve_env
from slime_env.errors import InvalidInput

CONFIG = "task.toml"
IMAGE_REPO = "slime-env-harbor"
IGNORE_FILE = ".harborignore"
_CANARY = re.compile(r"^(<!--.*canary.*-->|#.*canary.*)$", re.IGNORECASE)


def strip_canary(text: str) -> str:
    """Harbor's `strip_canary`: leading canary comment lines (`# ... canary ...`, `<!-- ... canary ... -->`) and
    the blank lines right after them are removed; nothing else changes."""
    lines = text.split("\n")
    i = 0
    while i < len(lines) and _CANARY.match(lines[i].strip()):
        i += 1
    while i < len(lines) and lines[i].strip() == "":
        i += 1
    return "\n".join(lines[i:])


@dataclass(frozen=True, slots=True)
class HarborTask:
    """One loaded task folder. `name` is `[task].name` if the file has a `[task]` section, else the folder's
    name (Harbor's rule); `instruction` is "" for multi-step tasks (see `step_instruction`); `notes` lists what
    Harbor accepts silently but a task author should know (unknown keys, deprecated fields)."""

    path: Path
    name: str
    config: TaskConfig
    instruction: str
    notes: tuple[str, ...] = ()
    given_path: str = field(default="", compare=False)

    # --- folders and scripts ---------------------------------------------------------------------------------
    @property
    def short_name(self) -> str:
        return self.config.task.short_name if self.config.task is not None else self.name

    @property
    def environment_dir(self) -> Path:
        return self.path / "environment"

    @property
    def tests_dir(self) -> Path:
        return self.path / "tests"

    @property
    def solution_dir(self) -> Path:
        return self.path / "solution"

    @property
    def script_ext(self) -> str:
        return ".bat" if self.config.environment.os == "windows" else ".sh"

    @property
    def test_script(self) -> Path | None:
        path = self.tests_dir / f"test{self.script_ext}"
        return path if path.exists() else None

    @property
    def solve_script(self) -> Path | None:
        path = self.solution_dir / f"solve{self.script_ext}"
        return path if path.exists() else None

    @property
    def has_steps(self) -> bool:
        return bool(self.config.steps)

    def step_instruction(self, step: str) -> str:
        return strip_canary((self.path / "steps" / step / "instruction.md").read_text(encoding="utf-8"))

    @property
    def verifier_mode(self) -> str:
        """`shared` (tests run in the agent's container) or `separate` (a container of their own)."""
        return self.config.verifier.mode

    @property
    def bundled_tests(self) -> bool:
        """Separate mode whose image holds the tests already (tests/Dockerfile or [verifier.environment]
        .docker_image): nothing is uploaded to /tests."""
        if self.verifier_mode != "separate":
            return False
        venv = self.config.verifier.environment
        return bool(venv is not None and venv.docker_image) or any(
            (self.tests_dir / n).is_file() for n in ("Dockerfile", "docker-compose.yaml"))

    # --- images --------------------------------------------------------------------------------------------
    def environment_hash(self, folder: Path | None = None) -> str:
        """A content hash of a build context (default environment/): paths, executable bits and bytes."""
        folder = folder or self.environment_dir
        h = hashlib.sha256()
        for p in sorted(folder.rglob("*")):
            if p.is_file():
                rel = p.relative_to(folder).as_posix()
                h.update(f"{rel}\0{p.stat().st_mode & 0o111:o}\0{p.stat().st_size}\0".encode())
                h.update(p.read_bytes())
        return h.hexdigest()[:16]

    def image_tag(self, folder: Path | None = None, suffix: str = "") -> str:
        """The tag `build_image` gives this task's image: the task's name and a hash of the build context, so an
        unchanged environment/ reuses its image."""
        name = re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-")[:80] or "task"
        return f"{IMAGE_REPO}/{name}{suffix}:{self.environment_hash(folder)}"

    # --- env ---------------------------------------------------------------------------------------------
    def resolved_env(self, section: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """`[verifier].env`, `[solution].env` or `[environment].env` with `${VAR}` / `${VAR:-default}` resolved
        from `environ` (default: this process's environment). InvalidInput names the file and the variable."""
        env = {"verifier": self.config.verifier.env, "solution": self.config.solution.env,
               "environment": self.config.environment.env}[section]
        try:
            return resolve_env(env, os.environ if environ is None else environ, f"{section}.env")
        except FieldError as e:
            raise InvalidInput(f"{self.given_path or self.path}/{CONFIG}: {e}") from None

    # --- uploads -------------------------------------------------------------------------------------------
    def upload_files(self, folder: Path) -> list[tuple[Path, str]]:
        """(file, path relative to `folder`) for what Harbor uploads of tests/ or solution/: every file but those
        `.harborignore` files (in the folder or below it, gitignore rules) exclude, and the ignore files."""
        folder = Path(folder)
        out = []
        for p in sorted(folder.rglob("*")):
            if p.is_file() and not _ignored(folder, p):
                out.append((p, p.relative_to(folder).as_posix()))
        return out


def _ignored(root: Path, path: Path) -> bool:
    """Harbor's `TaskFileFilter`: rules of every `.harborignore` from `root` down to the path's folder, the last
    matching rule wins; an excluded folder excludes what it holds."""
    rel = path.relative_to(root)
    if rel.name == IGNORE_FILE:
        return True
    if not any((root / p).is_file() for p in [IGNORE_FILE, *(f"{d}/{IGNORE_FILE}" for d in _dirs(rel))]):
        return False
    try:
        from pathspec import GitIgnoreSpec
    except ImportError:
        raise InvalidInput(f"{root}: {IGNORE_FILE} needs the `pathspec` package (pip install pathspec)") from None
    specs = []
    here = root
    for part_i, part in enumerate(rel.parts):
        ignore = here / IGNORE_FILE
        if ignore.is_file():
            specs.append((here, GitIgnoreSpec.from_lines(ignore.read_text().splitlines())))
        here = here / part
        suffix = "/" if part_i < len(rel.parts) - 1 else ""
        excluded = False
        for directory, spec in specs:
            result = spec.check_file(here.relative_to(directory).as_posix() + suffix)
            if result.include is not None:
                excluded = result.include
        if excluded:
            return True
    return False


def _dirs(rel: Path) -> list[str]:
    return ["/".join(rel.parts[:i]) for i in range(1, len(rel.parts))]


# --- loading -------------------------------------------------------------------------------------------------
def load_task(path: str | os.PathLike, *, disable_verification: bool = False) -> HarborTask:
    """Read and check one task folder (Harbor's rules); InvalidInput names the file and field of the problem.
    `disable_verification` skips the test-script checks (Harbor's `--disable-verification`)."""
    given = str(path)
    folder = Path(path)
    toml_path = folder / CONFIG
    where = f"{given.rstrip('/')}/{CONFIG}"
    if not folder.is_dir():
        raise InvalidInput(f"{given}: not a task folder (no such directory)")
    if not toml_path.is_file():
        raise InvalidInput(f"{where}: missing (a Harbor task folder needs task.toml)")
    try:
        data = tomllib.loads(toml_path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise InvalidInput(f"{where}: not valid TOML: {e}") from None
    notes = ParseNotes()
    try:
        config = parse_task_config(data, notes)
    except FieldError as e:
        raise InvalidInput(f"{where}: {e}") from None
    root = folder.resolve()
    task = HarborTask(path=root, name=config.task.name if config.task is not None else root.name, config=config,
                      instruction="", given_path=given.rstrip("/"),
                      notes=tuple([f"unknown field {k} (ignored)" for k in notes.unknown]
                                  + [f"deprecated field {k}" for k in notes.deprecated]))
    _check_layout(task, disable_verification)
    if not task.has_steps:
        instruction = strip_canary((root / "instruction.md").read_text(encoding="utf-8"))
        object.__setattr__(task, "instruction", instruction)
    return task


def _check_layout(task: HarborTask, disable_verification: bool) -> None:
    """Harbor's `Task.is_valid_dir` / `Task()` checks, each failure an InvalidInput naming the folder."""
    config, root, given = task.config, task.path, task.given_path

    def fail(message: str):
        raise InvalidInput(f"{given}: {message}")

    if not config.environment.docker_image and not task.environment_dir.is_dir():
        fail("no environment/ folder and no [environment].docker_image: the task has no container")
    inputs = [task.tests_dir, task.solution_dir] + [root / "steps" / s.name for s in config.steps or ()]
    for tree in inputs:
        _inside(tree, root, given)
    if not config.steps:
        if not (root / "instruction.md").is_file():
            fail("missing instruction.md")
        if disable_verification or task.bundled_tests:
            return
        if task.test_script is None:
            fail(f"missing tests/test{task.script_ext} (the verifier; [environment].os = "
                 f"{config.environment.os!r})")
        if _ignored(task.tests_dir, task.tests_dir / f"test{task.script_ext}"):
            fail(f"tests/test{task.script_ext} is excluded by {IGNORE_FILE}")
        return
    for step in config.steps:
        step_dir = root / "steps" / step.name
        if not step_dir.is_dir():
            fail(f"step {step.name!r}: missing steps/{step.name}/")
        if not (step_dir / "instruction.md").is_file():
            fail(f"step {step.name!r}: missing steps/{step.name}/instruction.md")
        if disable_verification or step.verifier.mode == "separate" or task.bundled_tests:
            continue
        if not (step_dir / "tests" / f"test{task.script_ext}").exists() and task.test_script is None:
            fail(f"step {step.name!r}: no steps/{step.name}/tests/test{task.script_ext} and no "
                 f"tests/test{task.script_ext}")


def _inside(tree: Path, root: Path, given: str) -> None:
    """Harbor's `validate_input_tree`: no link in an input folder leads out of the task, nor in a cycle."""
    def visit(p: Path, ancestors: frozenset[Path]) -> None:
        resolved = p.resolve()
        if not resolved.is_relative_to(root):
            raise InvalidInput(f"{given}: {p.relative_to(root)} leads out of the task folder (to {resolved})")
        if not p.is_dir():
            return
        if resolved in ancestors:
            raise InvalidInput(f"{given}: {p.relative_to(root)}: folder links form a cycle")
        for child in p.iterdir():
            visit(child, ancestors | {resolved})

    if tree.exists() or tree.is_symlink():
        visit(tree, frozenset())


def is_task_dir(path: str | os.PathLike) -> bool:
    """Whether `path` is a valid task folder (Harbor's `Task.is_valid_dir`)."""
    try:
        load_task(path)
    except (InvalidInput, OSError):
        return False
    return True


def task_dirs(path: str | os.PathLike) -> list[Path]:
    """The task folders `path` names: itself if it holds task.toml; the lines of a list file (paths relative to
    the file, `#` comments); else its sub-folders that hold a task.toml, sorted (Harbor's local dataset)."""
    path = Path(path)
    if path.is_file():
        out = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            line = line.split("#", 1)[0].strip() if not line.lstrip().startswith("#") else ""
            if line:
                p = Path(line) if Path(line).is_absolute() else path.parent / line
                if not (p / CONFIG).is_file():
                    raise InvalidInput(f"{path}:{n}: {line!r} is not a task folder (no {CONFIG})")
                out.append(p)
        return out
    if (path / CONFIG).is_file():
        return [path]
    if not path.is_dir():
        raise InvalidInput(f"{path}: no such task folder, dataset folder or list file")
    return [p for p in sorted(path.iterdir()) if p.is_dir() and (p / CONFIG).is_file()]


def load_dataset(path: str | os.PathLike, *, skip_invalid: bool = False) -> list[HarborTask]:
    """Every task `path` names (see `task_dirs`). An invalid task raises InvalidInput, or is left out with
    `skip_invalid` (what Harbor does with a dataset folder); a dataset with no task raises InvalidInput."""
    tasks = []
    for p in task_dirs(path):
        try:
            tasks.append(load_task(p))
        except InvalidInput:
            if not skip_invalid:
                raise
    if not tasks:
        raise InvalidInput(f"{path}: no Harbor task folders (folders with a valid {CONFIG})")
    names: dict[str, Path] = {}
    for t in tasks:
        if t.name in names:
            raise InvalidInput(f"{path}: two tasks are named {t.name!r}: {names[t.name]} and {t.path}")
        names[t.name] = t.path
    return tasks
