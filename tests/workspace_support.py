"""Helpers for the workspace tests: the image they start from and which backends must run here.

Real Docker and real bubblewrap (no stand-ins). The image is `python:3.11-slim` as this host has it — built from
Debian's archive by `base_images` when no registry is reachable. With `CI` set a missing piece fails the test.
"""

from __future__ import annotations

import os
import shutil

import pytest

IMAGE = "python:3.11-slim"
_checked: dict[str, str | None] = {}


def unavailable(reason: str):
    if os.environ.get("CI"):
        pytest.fail(f"CI must provide this: {reason}")
    pytest.skip(reason)


def workspace_image() -> str:
    """`IMAGE` on this host (built once per session if missing), or skip / fail."""
    if "image" not in _checked:
        try:
            from slime_env.tools_sandbox.workspace.base_images import ensure_base_image
            from slime_env.tools_sandbox.workspace.docker import docker_client

            ensure_base_image(IMAGE, client=docker_client(), log=lambda _: None)
            _checked["image"] = None
        except Exception as e:  # noqa: BLE001 - WorkspaceError: no engine, no mmdebstrap, no mirror
            _checked["image"] = f"{type(e).__name__}: {e}"
    if _checked["image"]:
        unavailable(_checked["image"])
    return IMAGE


def require_backend(backend: str) -> None:
    """Skip (fail in CI) when `backend` cannot run workspaces here."""
    workspace_image()  # the bubblewrap backend exports its root from the same image
    if backend == "bwrap":
        if os.geteuid() != 0:
            unavailable("the bubblewrap workspace backend needs root")
        if shutil.which("bwrap") is None:
            unavailable("bubblewrap is not installed")


def our_containers(run: str, status: str | None = None) -> list[str]:
    """Ids of the workspace containers labelled with run id `run` (in `status`, e.g. "running"; None: any state).
    Sparse: one list call, no per-container inspect that a container removed meanwhile would fail with 404."""
    from slime_env.tools_sandbox.workspace.docker import LABEL, RUN_LABEL, docker_client

    filters = {"label": [LABEL, f"{RUN_LABEL}={run}"], **({"status": status} if status else {})}
    return [c.id for c in docker_client().containers.list(all=True, filters=filters, sparse=True)]
