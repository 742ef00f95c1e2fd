"""The pinned repositories (`repos.toml`) and the Docker image of each, rendered from the manifest alone.

`load_manifest()` reads the shipped `repos.toml` (or another file) into `RepoSpec`s; `repo_dockerfile(spec)` is the
self-contained Dockerfile of a repository's image (Debian's python:3.11-slim, pinned pytest, the sdist checked
against its sha256 and unpacked to /repo, one git commit); `repo_image_tag(spec)` names it by the Dockerfile's
hash, so a changed recipe is a new image. `ensure_image(dockerfile, tag)` builds a tag once per host.
"""

from __future__ import annotations

import hashlib
import re
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from slime_env.errors import InvalidInput

MANIFEST = Path(__file__).with_name("repos.toml")
WORKDIR = "/repo"
TASK_MARKER = "# --- task:"  # where a task's Dockerfile leaves its repository's lines
_PIN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9][A-Za-z0-9.+!_-]*$")
GIT_IDENTITY = ("GIT_AUTHOR_NAME=slime-env GIT_AUTHOR_EMAIL=swe@slime-env.invalid GIT_COMMITTER_NAME=slime-env "
           "GIT_COMMITTER_EMAIL=swe@slime-env.invalid GIT_AUTHOR_DATE=2000-01-01T00:00:00Z "
           "GIT_COMMITTER_DATE=2000-01-01T00:00:00Z")


@dataclass(frozen=True, slots=True)
class RepoSpec:
    """One pinned repository: the PyPI project `name` at `version` (its sdist's `sdist_sha256`), the package's
    import folder `source_dir` and the suite's `test_paths` (folders or files pytest runs, relative to /repo;
    the manifest's older name `test_dirs` is still read), pinned `test_deps`, `pythonpath`
    folders (a src/ layout), node ids never run (`deselect`), and the shared `pytest` pins and `base_image`."""

    name: str
    version: str
    sdist_sha256: str
    source_dir: str
    test_paths: tuple[str, ...]
    test_deps: tuple[str, ...] = ()
    pythonpath: tuple[str, ...] = ()
    deselect: tuple[str, ...] = ()
    why: str = ""
    pytest: tuple[str, ...] = ()
    base_image: str = "python:3.11-slim"

    def is_test_path(self, path: str) -> bool:
        """Whether a /repo-relative path belongs to tests: under a test dir or any `tests`/`test` folder, or named
        `test_*.py`, `*_test.py` or `conftest.py`."""
        p = PurePosixPath(path)
        return (p.name == "conftest.py" or p.name.startswith("test_") or p.name.endswith("_test.py")
                or any(part in ("tests", "test") for part in p.parts[:-1])
                or any(p == PurePosixPath(t) or PurePosixPath(t) in p.parents for t in self.test_paths))

    def is_source_path(self, path: str) -> bool:
        """Whether a /repo-relative path is code a fix may edit: a .py file under source_dir, not a test."""
        p = PurePosixPath(path)
        return p.suffix == ".py" and PurePosixPath(self.source_dir) in p.parents and not self.is_test_path(path)


def load_manifest(path: str | Path | None = None) -> dict[str, RepoSpec]:
    """The repositories of a manifest (the shipped `repos.toml` by default), by name, in file order."""
    path = Path(path) if path else MANIFEST
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise InvalidInput(f"{path}: cannot read the SWE repository manifest: {e}") from None
    pins = tuple(data.get("pytest", ()))
    base = data.get("base_image", "python:3.11-slim")
    repos: dict[str, RepoSpec] = {}
    for i, row in enumerate(data.get("repo", [])):
        where = f"{path}: [[repo]] #{i + 1}"
        if "test_paths" in row and "test_dirs" in row:
            raise InvalidInput(f"{where}: give test_paths or its older name test_dirs, not both")
        try:
            # `test_dirs` was this field's name before a file could be named there; manifests with it still read
            old = "test_dirs" in row and "test_paths" not in row
            spec = RepoSpec(name=row["name"], version=row["version"], sdist_sha256=row["sdist_sha256"],
                            source_dir=row["source_dir"], test_paths=tuple(row["test_dirs" if old else "test_paths"]),
                            test_deps=tuple(row.get("test_deps", ())), pythonpath=tuple(row.get("pythonpath", ())),
                            deselect=tuple(row.get("deselect", ())), why=row.get("why", ""), pytest=pins,
                            base_image=base)
        except KeyError as e:
            raise InvalidInput(f"{where}: missing field {e.args[0]!r}") from None
        _check(spec, where)
        if spec.name in repos:
            raise InvalidInput(f"{where}: repository {spec.name!r} is listed twice")
        repos[spec.name] = spec
    if not repos:
        raise InvalidInput(f"{path}: no [[repo]] entries")
    return repos


def _check(spec: RepoSpec, where: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", spec.name):
        raise InvalidInput(f"{where}: name {spec.name!r} is not a PyPI project name")
    if not re.fullmatch(r"[0-9a-f]{64}", spec.sdist_sha256):
        raise InvalidInput(f"{where}: sdist_sha256 must be 64 lower-case hex digits")
    for pin in (*spec.pytest, *spec.test_deps, f"{spec.name}=={spec.version}"):
        if not _PIN.match(pin):
            raise InvalidInput(f"{where}: {pin!r} is not an exact pin (name==version)")
    for rel in (spec.source_dir, *spec.test_paths, *spec.pythonpath):
        if not rel or rel.startswith("/") or ".." in PurePosixPath(rel).parts:
            raise InvalidInput(f"{where}: {rel!r} must be a path relative to /repo")
    if not spec.test_paths:
        raise InvalidInput(f"{where}: test_paths is empty")


def repo_dockerfile(spec: RepoSpec) -> str:
    """The Dockerfile of a repository's image: the same text for the same manifest entry (Docker's cache then
    builds each repository once, and every task's Dockerfile starts with exactly these lines)."""
    lines = [
        f"# slime_env SWE repository image: {spec.name} {spec.version} (rendered from envs/swe/repos.toml)",
        f"FROM {spec.base_image}",
        "ENV PIP_BREAK_SYSTEM_PACKAGES=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1",
        "RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends git "
        ">/dev/null && rm -rf /var/lib/apt/lists/*",
        "RUN git config --system user.name agent && git config --system user.email agent@localhost "
        "&& git config --system --add safe.directory /repo",
        f"RUN python -m pip install -q --no-deps {' '.join(spec.pytest)}",
    ]
    if spec.test_deps:
        lines.append(f"RUN python -m pip install -q --no-deps {' '.join(spec.test_deps)}")
    lines += [
        f"RUN mkdir -p /tmp/sdist {WORKDIR} && cd /tmp/sdist "
        f"&& python -m pip download -q --no-deps --no-binary :all: {spec.name}=={spec.version} "
        f"&& f=$(ls) && echo \"{spec.sdist_sha256}  $f\" | sha256sum -c --quiet - "
        f"&& tar -xzf \"$f\" --strip-components=1 -C {WORKDIR} && cd / && rm -rf /tmp/sdist",
    ]
    if spec.pythonpath:
        lines.append(f"ENV PYTHONPATH={':'.join(f'{WORKDIR}/{p}' for p in spec.pythonpath)}")
    lines += [
        f"WORKDIR {WORKDIR}",
        f"RUN git init -q && git add -A && {GIT_IDENTITY} git commit -q -m \"{spec.name} {spec.version} (sdist)\"",
    ]
    return "\n".join(lines) + "\n"


def repo_image_tag(spec_or_dockerfile: RepoSpec | str) -> str:
    """`slime-env-swe/<name>:<version>-<hash of its Dockerfile>`."""
    text = spec_or_dockerfile if isinstance(spec_or_dockerfile, str) else repo_dockerfile(spec_or_dockerfile)
    m = re.match(r"# slime_env SWE repository image: (\S+) (\S+) ", text)
    if not m:
        raise InvalidInput("not a slime_env SWE repository Dockerfile (its first line names the repository)")
    return f"slime-env-swe/{m[1].lower()}:{m[2]}-{hashlib.sha256(text.encode()).hexdigest()[:10]}"


def repo_lines_of(task_dockerfile: str) -> str:
    """The repository part of a task's Dockerfile (everything before the task marker)."""
    head, marker, _ = task_dockerfile.partition(TASK_MARKER)
    if not marker:
        raise InvalidInput(f"a SWE task's Dockerfile has no {TASK_MARKER!r} line")
    return head


async def ensure_image(dockerfile: str, tag: str, *, log=None) -> str:
    """Build `dockerfile` (a self-contained one: no COPY) as `tag` unless the host has it; returns the tag."""
    import asyncio

    from slime_env.tools_sandbox.workspace.base_images import image_exists
    from slime_env.tools_sandbox.workspace.docker import docker_client
    from slime_env.tools_sandbox.workspace.images import build_image_async

    client = await asyncio.to_thread(docker_client)
    if await asyncio.to_thread(image_exists, client, tag):
        return tag
    with tempfile.TemporaryDirectory(prefix="slime-env-swe-") as tmp:
        (Path(tmp) / "Dockerfile").write_text(dockerfile)
        await build_image_async(tmp, tag, client=client, log=log, timeout_s=1800.0)
    return tag
