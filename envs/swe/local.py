"""SWE tasks without Docker: each pinned repository unpacked from its sdist into a clean folder on this host, and the
workspaces in bubblewrap over the host's own root file system (this host's Python runs the tests).

`stage(out, sdists)` (once per host) checks each sdist of `repos.toml` against its sha256 and unpacks it to
`out/repos/<name>`, installs the pinned pytest and the test dependencies (wheels in `sdists`, see `fetch`) into
`out/site`, puts a `python` (this interpreter) in `out/bin` and writes `out/stage.json`. Then, with
`SLIME_ENV_SWE_LOCAL=out` in the environment (read at each call, so worker processes see it too):

- `agent_workspace(task)` — `Harbor-v0`'s `workspace`: bwrap over `/` with /repo = the clean repository, the task's
  bug.patch applied and its hidden tests removed (what the task's Dockerfile does, less pip and git); the stage's
  clean repositories and the stage's `hide` paths (task folders, sdists) are deleted from its view;
- `clean_workspace(spec)` — `Harbor-v0`'s `reward_workspace`, `swe_reward`'s `start_workspace`: /repo = the clean
  repository of `spec.image` (a repository image tag, `slime-env-swe/<name>:...`).

The overlay's lower layer is the host's root *file system*: what lives on another mount (a tmpfs /tmp, a volume)
shows as an empty folder inside, so the stage and this Python must be on the root file system (`check` tells).
Needs root, bwrap and unshare (`BwrapWorkspace`). Isolation is bubblewrap's: the agent reads the host's root file
system (not its other mounts) and writes only to its own overlay.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
from functools import lru_cache
from pathlib import Path
from typing import Any

from slime_env.envs.swe.manifest import WORKDIR, RepoSpec, load_manifest
from slime_env.envs.swe.patches import apply_patch, patch_files
from slime_env.envs.swe.task import SweTask, load_task
from slime_env.errors import InvalidInput

STAGE_ENV = "SLIME_ENV_SWE_LOCAL"
FOLDER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _pins(repos: list[RepoSpec]) -> list[str]:
    return sorted({*repos[0].pytest, *(d for r in repos for d in r.test_deps)}) if repos else []


def fetch(out: str | Path, manifest: str | Path | None = None, *, log=print) -> Path:
    """Download every repository's sdist (`pip download --no-deps --no-binary :all:`, checked against its sha256)
    and the wheels of the test runner's pins into `out` — what `stage` needs on a host without internet."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    repos = list(load_manifest(manifest).values())
    pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(out)]
    for r in repos:
        if _sdist(out, r, missing_ok=True) is None:
            log(f"fetch: {r.name}=={r.version} (sdist)")
            subprocess.run([*pip, "--no-binary", ":all:", f"{r.name}=={r.version}"], check=True)
        _sdist(out, r)  # checks its sha256
    log(f"fetch: wheels {' '.join(_pins(repos))}")
    subprocess.run([*pip, "--only-binary", ":all:", *_pins(repos)], check=True)
    return out


def _sdist(folder: Path, r: RepoSpec, *, missing_ok: bool = False) -> Path | None:
    stems = {f"{n}-{r.version}" for n in (r.name, r.name.replace("-", "_"), r.name.replace("_", "-"))}
    found = [p for p in folder.glob("*.tar.gz") if p.name[:-len(".tar.gz")] in stems]
    if not found:
        if missing_ok:
            return None
        raise InvalidInput(f"no sdist of {r.name}=={r.version} in {folder} (fetch it: bench/learn_swe_gpu.py "
                           f"--fetch-sdists {folder})")
    digest = hashlib.sha256(found[0].read_bytes()).hexdigest()
    if digest != r.sdist_sha256:
        raise InvalidInput(f"{found[0]}: sha256 {digest} is not repos.toml's {r.sdist_sha256}")
    return found[0]


def stage(out: str | Path, sdists: str | Path, *, repos: list[str] | None = None, hide: list[str] = (),
          python: str | None = None, manifest: str | Path | None = None, log=print) -> Path:
    """Unpack the (checked) sdists of `repos` (default: all of repos.toml) to `out/repos/<name>`, install the test
    runner's wheels into `out/site`, link `out/bin/python` to `python` (default: this interpreter; the tests run as
    `nobody`, who must be able to run it) and write `out/stage.json` (module docstring). `hide`: host paths deleted
    from the agents' view (e.g. the task folders: their hidden tests). Returns `out`."""
    out, sdists = Path(out).resolve(), Path(sdists).resolve()
    specs = [s for s in load_manifest(manifest).values() if repos is None or s.name in repos]
    (out / "repos").mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {"repos": {}, "hide": [str(Path(h).resolve()) for h in hide]}
    for r in specs:
        root = out / "repos" / r.name
        if not (root / ".complete").exists():
            log(f"stage: unpacking {r.name}=={r.version} to {root}")
            with tarfile.open(_sdist(sdists, r)) as tar:
                members = []
                for m in tar.getmembers():
                    parts = m.name.split("/", 1)
                    if len(parts) == 2 and parts[1]:
                        m.name = parts[1]
                        members.append(m)
                tar.extractall(root, members=members, filter="data")
            (root / ".complete").write_text(r.sdist_sha256)
        config["repos"][r.name] = {"root": str(root), "pythonpath": [f"{WORKDIR}/{p}" for p in r.pythonpath]}
    site = out / "site"
    pins = _pins(specs)
    if pins and not (site / ".complete").exists():
        log(f"stage: installing {' '.join(pins)} into {site}")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--find-links", str(sdists), "--target", str(site), "--upgrade", *pins], check=True)
        (site / ".complete").write_text(" ".join(pins))
    (out / "bin").mkdir(exist_ok=True)
    python = Path(os.path.realpath(python or sys.executable))
    for name in ("python", "python3"):
        link = out / "bin" / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(python)
    config.update(site=str(site), bin=str(out / "bin"), python=str(python))
    (out / "stage.json").write_text(json.dumps(config, indent=1))
    return out


@lru_cache(maxsize=8)
def _config(folder: str) -> dict:
    path = Path(folder) / "stage.json"
    if not path.exists():
        raise InvalidInput(f"{STAGE_ENV}={folder}: no stage.json there (make it with slime_env.envs.swe.local.stage)")
    return json.loads(path.read_text())


def config() -> dict:
    """The stage named by $SLIME_ENV_SWE_LOCAL."""
    folder = os.environ.get(STAGE_ENV)
    if not folder:
        raise InvalidInput(f"local SWE workspaces need ${STAGE_ENV} (a folder made by slime_env.envs.swe.local.stage)")
    return _config(folder)


def workspace_env(repo: str) -> dict[str, str]:
    """The environment of a workspace of `repo`: the stage's `python` first on PATH, the repository's PYTHONPATH
    (as its image sets it), then the stage's test runner, then this process's own PYTHONPATH."""
    cfg = config()
    if repo not in cfg["repos"]:
        raise InvalidInput(f"repository {repo!r} is not staged in {os.environ.get(STAGE_ENV)} "
                           f"(staged: {sorted(cfg['repos'])})")
    outer = [p for p in os.environ.get("PYTHONPATH", "").split(":") if p]
    pythonpath = [*cfg["repos"][repo]["pythonpath"], cfg["site"], *outer]
    return {"PATH": f"{cfg['bin']}:{FOLDER_PATH}", "PYTHONPATH": ":".join(pythonpath), "LANG": "C.UTF-8",
            "HOME": "/root", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONDONTWRITEBYTECODE": "1"}


async def _open(repo: str, limits) -> Any:
    from slime_env.tools_sandbox.workspace import WorkspaceSpec, open_workspace

    ws = await open_workspace(WorkspaceSpec(image="/", workdir=WORKDIR, env=workspace_env(repo), limits=limits),
                              backend="bwrap")
    try:
        root = config()["repos"][repo]["root"]
        res = await ws.exec(["cp", "-a", f"{root}/.", f"{WORKDIR}/"], timeout_s=120)
        if res.exit_code != 0:
            raise InvalidInput(f"copying {root} to {WORKDIR} failed (is it on the root file system?): "
                               f"{(res.stderr or res.reason or '')[-300:]}")
        # bwrap's /dev/shm is root's 755 folder; Docker's is a 1777 tmpfs (multiprocessing's semaphores need it)
        await ws.exec(["sh", "-c", f"rm -f {WORKDIR}/.complete && chmod 1777 /dev/shm"], timeout_s=30)
    except BaseException:
        await ws.close()
        raise
    return ws


@lru_cache(maxsize=4096)
def _task(path: str) -> tuple[SweTask, dict[str, str]]:
    """A task and its bugged files (path -> text), computed host-side once."""
    task = load_task(path)
    root = Path(config()["repos"][task.repo]["root"]) if task.repo in config()["repos"] else None
    if root is None:
        raise InvalidInput(f"{path}: its repository {task.repo!r} is not staged")
    texts = {p: (root / p).read_text() for p in patch_files(task.bug_patch)}
    return task, apply_patch(texts, task.bug_patch)


def _limits(task: SweTask):
    from slime_env.tools_sandbox.workspace import Limits

    return Limits(cpus=task.cpus, memory_mb=task.memory_mb, pids=512, network="none",
                  wall_time_s=task.agent_timeout_s + 300)


async def agent_workspace(task: Any) -> Any:
    """The agent's workspace of a Harbor-v0 SWE task (`metadata["harbor_task"]`): see the module docstring."""
    folder = (getattr(task, "metadata", None) or {}).get("harbor_task") if not isinstance(task, (str, Path)) else task
    if not folder:
        raise InvalidInput("agent_workspace: the task needs metadata['harbor_task'] (a SWE task folder)")
    swe, bugged = _task(str(folder))
    ws = await _open(swe.repo, _limits(swe))
    try:
        for path, text in sorted(bugged.items()):
            await ws.write_file(f"{WORKDIR}/{path}", text)
        cfg = config()
        gone = [f"{WORKDIR}/{p}" for p in swe.hidden_tests] + [str(Path(cfg["repos"][swe.repo]["root"]).parent),
                                                              *cfg["hide"]]
        res = await ws.exec(["rm", "-rf", "--", *gone], timeout_s=120)
        if res.exit_code != 0:
            raise InvalidInput(f"{swe.name}: removing the hidden tests failed: {(res.stderr or '')[-300:]}")
    except BaseException:
        await ws.close()
        raise
    return ws


async def clean_workspace(spec: Any) -> Any:
    """A fresh workspace with /repo = the clean repository of `spec.image` (`slime-env-swe/<name>:<tag>`), under
    `spec.limits`: what `swe_reward` runs the hidden tests in."""
    image = spec.image
    if not image.startswith("slime-env-swe/") or ":" not in image:
        raise InvalidInput(f"clean_workspace: {image!r} is not a SWE repository image (slime-env-swe/<name>:<tag>)")
    return await _open(image.split("/", 1)[1].split(":", 1)[0], spec.limits)


async def check(repo: str) -> str:
    """Start a clean workspace of `repo` and run `python -m pytest --version` in it; returns what it printed
    (InvalidInput saying what is missing when the stage or this Python is not visible inside)."""
    from slime_env.tools_sandbox.workspace import Limits, WorkspaceSpec

    tag = f"slime-env-swe/{repo}:local"
    ws = await clean_workspace(WorkspaceSpec(image=tag, limits=Limits(network="none")))
    try:
        res = await ws.exec(["python", "-c", "import sys, pytest; print(sys.version.split()[0], pytest.__version__)"],
                            timeout_s=120, user="nobody")
        if res.exit_code != 0:
            raise InvalidInput(f"python/pytest do not run in a local SWE workspace of {repo} (are the stage and "
                               f"{config()['python']} on the host's root file system?): {res.stderr[-500:]}")
        return res.stdout.strip()
    finally:
        await ws.close()


async def check_task(folder: str | Path) -> dict:
    """A task end to end on local workspaces: the unchanged checkout earns 0 and the reverting edits (the
    teacher's, `patches.reverting_edits`) earn 1 through `swe_reward`. Returns {ok, nop, oracle, why, reward_s}."""
    from slime_env.envs.swe.patches import reverting_edits
    from slime_env.envs.swe.reward import swe_reward

    task, _ = _task(str(folder))
    ws = await agent_workspace(str(folder))
    try:
        nop = await swe_reward(task, ws, start_workspace=clean_workspace)
        for path, old, new in reverting_edits(task.bug_patch):
            text = (await ws.read_file(f"{WORKDIR}/{path}")).decode()
            if text.count(old) != 1:
                raise InvalidInput(f"{task.name}: the reverting edit of {path} does not match exactly once")
            await ws.write_file(f"{WORKDIR}/{path}", text.replace(old, new))
        oracle = await swe_reward(task, ws, start_workspace=clean_workspace)
    finally:
        await ws.close()
    ok = nop.reward == 0.0 and oracle.reward == 1.0
    why = "" if ok else f"nop: {nop.status} ({nop.reason[:300]}); oracle: {oracle.status} ({oracle.reason[:300]})"
    return {"ok": ok, "nop": nop.reward, "oracle": oracle.reward, "why": why,
            "reward_s": round((nop.timings["total"] + oracle.timings["total"]) / 2, 3)}
