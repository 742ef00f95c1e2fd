"""Workspace images from Dockerfiles, built on this host: `build_image(context, tag)`.

Public bases a Dockerfile names (`FROM python:3.11-slim`) that the host lacks are made first from the package
archives (`base_images`), so unchanged task folders build without a registry. A failing build is a
`WorkspaceError` with the failing step and the tail of its log, never a hang (`timeout_s` bounds it).
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Callable
from pathlib import Path

from slime_env.tools_sandbox.workspace.types import WorkspaceError

IMAGE_LABEL = "slime_env.workspace.image"
_FROM = re.compile(r"^\s*FROM\s+(?:--platform=\S+\s+)?(\S+)", re.I | re.M)
_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


def base_images(dockerfile: str) -> list[str]:
    """The images a Dockerfile builds FROM (build stages named by an earlier `AS` excluded)."""
    stages = {m.lower() for m in re.findall(r"^\s*FROM\s+.*?\s+AS\s+(\S+)", dockerfile, re.I | re.M)}
    return [name for name in _FROM.findall(dockerfile) if name.lower() not in stages and name.lower() != "scratch"]


def build_image(context: str | Path, tag: str, *, dockerfile: str = "Dockerfile", timeout_s: float = 1800.0,
                client=None, log: Callable[[str], None] | None = None, labels: dict[str, str] | None = None) -> str:
    """Build `context`/`dockerfile` as `tag` (cached layers reused); returns the image id. Concurrent builds of one
    tag in this process wait for each other. WorkspaceError names the Dockerfile and the step that failed."""
    from slime_env.tools_sandbox.workspace.base_images import ensure_base_image, image_exists, recipe_for
    from slime_env.tools_sandbox.workspace.docker import docker_client

    context = Path(context)
    path = context / dockerfile
    if not path.is_file():
        raise WorkspaceError(f"{path}: no such Dockerfile")
    client = client or docker_client(timeout_s=timeout_s)
    with _lock(tag):
        for base in base_images(path.read_text()):
            if "$" in base or image_exists(client, base):
                continue
            try:
                recipe_for(base)
            except WorkspaceError as e:
                raise WorkspaceError(f"{path}: FROM {base}: the host has no such image and {e}") from None
            ensure_base_image(base, client=client, log=log or (lambda _: None))
        lines: list[str] = []
        try:
            stream = client.api.build(path=str(context), dockerfile=dockerfile, tag=tag, rm=True, forcerm=True,
                                      decode=True, timeout=int(timeout_s), labels={IMAGE_LABEL: "1", **(labels or {})})
            for chunk in stream:
                if "stream" in chunk:
                    text = chunk["stream"].rstrip()
                    if text:
                        lines.append(text)
                        if log:
                            log(text)
                if "error" in chunk:
                    tail = "\n".join(lines[-15:])
                    raise WorkspaceError(f"{path}: docker build failed: {chunk['error'].strip()}\n{tail}")
        except WorkspaceError:
            raise
        except Exception as e:  # noqa: BLE001 - timeouts and API errors
            raise WorkspaceError(f"{path}: docker build failed ({type(e).__name__}: {e})") from None
        try:
            return client.images.get(tag).id
        except Exception:  # noqa: BLE001
            raise WorkspaceError(f"{path}: docker build finished without an image {tag!r}") from None


async def build_image_async(context: str | Path, tag: str, **kw) -> str:
    """`build_image` off the event loop."""
    return await asyncio.to_thread(build_image, context, tag, **kw)


def _lock(tag: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(tag, threading.Lock())
