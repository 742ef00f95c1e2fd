"""A harness's binary on this host and in a workspace image, both built once and cached.

`install_dir(harness)`: `npm install` of the harness's pinned package into `~/.cache/slime_env/harnesses/NAME-VERSION`
(npm picks the linux-x64 build among the package's optional dependencies; a file lock lets concurrent processes share
one install). `harness_image(base, harness)`: a local image layer, `FROM base` plus that binary at
`/opt/slime-env/NAME/`, tagged by the harness, its version and the base image's id, so it is built once per task image
and reused. The bubblewrap backend exports its root from the same image. Nothing here runs during an episode's turns:
a missing `npm`, a registry that cannot be reached or a failed build is the host's (`InfraError`), never the model's.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from slime_env.errors import InfraError

if TYPE_CHECKING:
    from slime_env.envs.harness.base import Harness

IMAGE_PREFIX = "slime-env-harness"
INSTALL_TIMEOUT_S = 600.0
# what the last install or build took here (seconds), for tests and logs: {"npm:NAME": s, "image:TAG": s}
TIMINGS: dict[str, float] = {}


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "slime_env" / "harnesses"


def install_dir(harness: Harness) -> Path:
    """The folder holding `harness`'s npm install (installed now if it is not cached). InfraError if npm fails."""
    target = cache_root() / f"{harness.name}-{harness.version}"
    if (target / ".installed").is_file():
        return target
    npm = shutil.which("npm")
    if npm is None:
        raise InfraError(f"installing the {harness.name} harness needs npm on this host (node 20+; .ci/host-deps "
                         "installs it)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be installing the same harness
        if (target / ".installed").is_file():
            return target
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            env = {**os.environ, "npm_config_update_notifier": "false", "npm_config_fund": "false",
                   "npm_config_audit": "false"}
            try:
                proc = subprocess.run([npm, "install", "--prefix", tmp, "--no-save", "--loglevel=error",
                                       f"{harness.package}@{harness.version}"], capture_output=True, text=True,
                                      timeout=INSTALL_TIMEOUT_S, env=env)
            except subprocess.TimeoutExpired:
                raise InfraError(f"npm install {harness.package}@{harness.version} took over {INSTALL_TIMEOUT_S}s")
            if proc.returncode != 0:
                raise InfraError(f"npm install {harness.package}@{harness.version} failed: "
                                 f"{(proc.stderr or proc.stdout).strip()[-800:]}")
            if not (Path(tmp) / harness.binary).is_file():
                raise InfraError(f"npm install {harness.package}@{harness.version} has no {harness.binary} (not a "
                                 "linux-x64 host?)")
            Path(tmp, ".installed").write_text(f"{harness.package}@{harness.version}\n")
            if target.exists():
                shutil.rmtree(target)
            os.rename(tmp, target)
            os.makedirs(tmp)  # TemporaryDirectory removes what it made
        TIMINGS[f"npm:{harness.name}"] = time.perf_counter() - t0
    return target


def harness_image_tag(base_id: str, harness: Harness) -> str:
    return f"{IMAGE_PREFIX}/{harness.name}:{harness.version}-{hashlib.sha256(base_id.encode()).hexdigest()[:12]}"


def harness_image(base: str, harness: Harness) -> str:
    """The tag of `base` with `harness`'s binary at `harness.path_in_image` (built now if missing)."""
    from slime_env.tools_sandbox.workspace.base_images import image_exists
    from slime_env.tools_sandbox.workspace.docker import docker_client
    from slime_env.tools_sandbox.workspace.images import build_image
    from slime_env.tools_sandbox.workspace.types import WorkspaceError

    client = docker_client()
    try:
        base_id = client.images.get(base).id
    except Exception as e:  # noqa: BLE001 - the task's image is built before this; its absence is the host's
        raise InfraError(f"the {harness.name} harness image: its base {base!r} is not on this host: {e}") from None
    tag = harness_image_tag(base_id, harness)
    if image_exists(client, tag):
        return tag
    folder = install_dir(harness)
    dockerfile = f"Dockerfile.{harness.name}"
    (folder / dockerfile).write_text(f"FROM {base_id}\nCOPY {harness.binary} {harness.path_in_image}\n")
    # only the binary goes to the daemon, not the whole npm tree (other platforms' builds are not in it anyway)
    (folder / ".dockerignore").write_text(f"*\n!{harness.binary}\n")
    t0 = time.perf_counter()
    try:
        build_image(folder, tag, dockerfile=dockerfile, timeout_s=INSTALL_TIMEOUT_S,
                    labels={"slime_env.harness": f"{harness.name}@{harness.version}"})
    except WorkspaceError as e:
        raise InfraError(f"building the {harness.name} harness image on {base!r}: {e}") from None
    TIMINGS[f"image:{tag}"] = time.perf_counter() - t0
    return tag


async def harness_image_async(base: str, harness: Harness) -> str:
    """`harness_image` off the event loop."""
    return await asyncio.to_thread(harness_image, base, harness)
