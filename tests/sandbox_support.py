"""Helpers for the sandbox tests: which backends must run here, and how to build each one.

Docker and bubblewrap are real here (no stand-ins). When `CI` is set they must be available: a
missing one fails the test instead of skipping it (`.ci/run` installs both and starts dockerd).
"""

from __future__ import annotations

import os

import pytest
from slime_env.tools_sandbox.types import SandboxError

IMAGE = "slime-env-sandbox:py3"
_image_checked: dict[str, str | None] = {}


def unavailable(reason: str):
    if os.environ.get("CI"):
        pytest.fail(f"CI must provide this sandbox backend: {reason}")
    pytest.skip(reason)


def ensure_image() -> None:
    """Build the sandbox image once per session if it is missing (mmdebstrap here: no registry)."""
    if "error" not in _image_checked:
        try:
            from slime_env.tools_sandbox.docker_pool import docker_client
            from slime_env.tools_sandbox.image import build_image

            client = docker_client()
            try:
                client.images.get(IMAGE)
            except Exception:  # noqa: BLE001 - ImageNotFound
                build_image(IMAGE, log=lambda _: None, client=client)
            _image_checked["error"] = None
        except SandboxError as e:
            _image_checked["error"] = str(e)
    if _image_checked["error"]:
        unavailable(_image_checked["error"])


def make_sandbox(backend: str, **kw):
    """A fresh sandbox of `backend` ("docker", "bwrap", "bwrap_fork" — bubblewrap's fork-server mode — or
    "process"), or skip/fail when it cannot run here."""
    try:
        if backend == "docker":
            ensure_image()
            from slime_env.tools_sandbox.docker_pool import DockerSandbox

            return DockerSandbox(IMAGE, **{"pool_size": 2, **kw})
        if backend in ("bwrap", "bwrap_fork"):
            from slime_env.tools_sandbox.auto import probe_bwrap
            from slime_env.tools_sandbox.bwrap import BwrapSandbox

            probe_bwrap()
            return BwrapSandbox(fork_server=backend == "bwrap_fork", **kw)
        from slime_env.tools_sandbox.process import ProcessSandbox

        return ProcessSandbox(**kw)
    except SandboxError as e:
        unavailable(f"{backend}: {e}")


BACKENDS = ("docker", "bwrap", "bwrap_fork", "process")
ISOLATING = ("docker", "bwrap", "bwrap_fork")


def per_backend_fixtures(**options):
    """Module fixtures: `sandboxes` (closed when the module ends) and `sb`, parametrized over BACKENDS, one
    sandbox per backend made with `options` (`pool_size` goes to docker only). Assign both at module level."""

    @pytest.fixture(scope="module")
    def sandboxes(runner):
        made = {}
        yield made
        for sandbox in made.values():
            runner.run(sandbox.close())

    @pytest.fixture(params=BACKENDS)
    def sb(request, sandboxes):
        backend = request.param
        if backend not in sandboxes:
            kw = {k: v for k, v in options.items() if k != "pool_size" or backend == "docker"}
            sandboxes[backend] = make_sandbox(backend, **kw)
        return sandboxes[backend]

    return sandboxes, sb
