"""Plain data of workspaces: what one asks for (`WorkspaceSpec`, `Limits`) and what a file listing returns."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from slime_env.errors import InvalidInput
from slime_env.tools_sandbox.types import SandboxError

NetworkMode = Literal["none", "allowlist", "public"]
NETWORK_MODES: tuple[str, ...] = ("none", "allowlist", "public")


class WorkspaceError(SandboxError):
    """A workspace could not be created or stopped answering (no engine, unknown image, a build that failed,
    the workspace's wall time, memory or disk limit hit). Its message names the image, file or limit."""


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-workspace limits. `cpus` (CPU quota), `memory_mb` (hard: memory + swap), `pids` (processes and
    threads at once: a fork bomb stops there), `disk_mb` (what the workspace may write; None: no limit),
    `wall_time_s` (the workspace's whole life: it is killed after it), `network` (`none`, the default;
    `allowlist`: only `allowed_hosts`, over an HTTP(S) proxy; `public`)."""

    cpus: float = 1.0
    memory_mb: int = 2048
    pids: int = 512
    disk_mb: int | None = 4096
    wall_time_s: float = 3600.0
    network: NetworkMode = "none"
    allowed_hosts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not (math.isfinite(self.cpus) and 0 < self.cpus <= 1024):
            raise InvalidInput(f"limits.cpus must be in (0, 1024], got {self.cpus}")
        if not (16 <= self.memory_mb <= 1 << 22):
            raise InvalidInput(f"limits.memory_mb must be in [16, 4194304], got {self.memory_mb}")
        if not (8 <= self.pids <= 1 << 22):
            raise InvalidInput(f"limits.pids must be in [8, 4194304], got {self.pids}")
        if self.disk_mb is not None and not (1 <= self.disk_mb <= 1 << 30):
            raise InvalidInput(f"limits.disk_mb must be None or in [1, 2**30], got {self.disk_mb}")
        if not (math.isfinite(self.wall_time_s) and 0 < self.wall_time_s <= 7 * 86400):
            raise InvalidInput(f"limits.wall_time_s must be in (0, 604800], got {self.wall_time_s}")
        if self.network not in NETWORK_MODES:
            raise InvalidInput(f"limits.network must be one of {NETWORK_MODES}, got {self.network!r}")
        if self.allowed_hosts and self.network != "allowlist":
            raise InvalidInput("limits.allowed_hosts needs network='allowlist'")
        if self.network == "allowlist" and not self.allowed_hosts:
            raise InvalidInput("limits.network='allowlist' needs allowed_hosts")


@dataclass(frozen=True, slots=True)
class WorkspaceSpec:
    """What a workspace starts from: a local `image` (Docker tag or id; the bubblewrap backend exports it to a
    root filesystem), the default working directory of commands (`workdir`; None: the image's), extra
    environment variables (`env`, over the image's), the default `user` of commands (name or uid; None: the
    image's), and its `limits`."""

    image: str
    workdir: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    user: str | None = None
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        if not isinstance(self.image, str) or not self.image.strip():
            raise InvalidInput(f"workspace image must be a non-empty string, got {self.image!r}")
        if self.workdir is not None and not self.workdir.startswith("/"):
            raise InvalidInput(f"workspace workdir must be an absolute path, got {self.workdir!r}")
        for k, v in dict(self.env).items():
            if not isinstance(k, str) or not k or "=" in k or "\0" in k or not isinstance(v, str) or "\0" in v:
                raise InvalidInput(f"workspace env entry {k!r}={v!r} is not a NAME=value string pair")
        object.__setattr__(self, "env", dict(self.env))

    def with_limits(self, **changes) -> WorkspaceSpec:
        return replace(self, limits=replace(self.limits, **changes))

    def pool_key(self) -> tuple:
        """Workspaces of equal keys are interchangeable before use (what a warm pool keeps apart)."""
        return (self.image, self.workdir, tuple(sorted(self.env.items())), self.user, self.limits)


@dataclass(frozen=True, slots=True)
class FileInfo:
    """One entry of `Workspace.list_dir`: its name, kind (`file`, `dir`, `link`, `other`), size and mode."""

    name: str
    kind: Literal["file", "dir", "link", "other"]
    size: int
    mode: int
