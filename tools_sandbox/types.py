"""Plain data types of the sandbox: what a run asks for (`ExecRequest`) and what it gets (`ExecResult`)."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from slime_env.errors import InvalidInput, SlimeEnvError

ExecStatus = Literal["ok", "error", "timeout", "memory", "output_limit", "sandbox_error"]
EXEC_STATUSES: tuple[str, ...] = ("ok", "error", "timeout", "memory", "output_limit", "sandbox_error")


class SandboxError(SlimeEnvError):
    """The sandbox itself could not be set up (missing bubblewrap, no Docker engine, no image, ...)."""


@dataclass(frozen=True, slots=True)
class ExecResult:
    """The outcome of one sandboxed run.

    `status`: `ok` (exit code 0), `error` (non-zero exit or killed by a signal), `timeout` (wall-clock or
    CPU-time limit, or the deadline passed while queued), `memory` (the memory limit was hit),
    `output_limit` (stdout + stderr exceeded the limit; the process was killed and the output cut),
    `sandbox_error` (the sandbox failed, not the code). `exit_code` is the process's (negative: the
    signal that killed it; None if it never ran or was killed by us). `truncated` is True when the output
    was cut. `reason` says why for every status but `ok` and `error`.
    """

    status: str
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    duration_s: float = 0.0
    truncated: bool = False
    reason: str = ""
    backend: str = ""

    def __post_init__(self) -> None:
        if self.status not in EXEC_STATUSES:
            raise InvalidInput(f"ExecResult.status {self.status!r} is not one of {EXEC_STATUSES}")

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "exit_code": self.exit_code, "stdout": self.stdout, "stderr": self.stderr,
                "duration_s": self.duration_s, "truncated": self.truncated, "reason": self.reason,
                "backend": self.backend}


@dataclass(frozen=True, slots=True)
class ExecRequest:
    """One run: `code` in `language` (see `slime_env.tools_sandbox.languages`), its `stdin`, extra `files`
    (relative path -> bytes or str) in the work dir, and limits. Validated on construction."""

    code: str
    language: str = "python"
    stdin: str = ""
    files: Mapping[str, bytes] = field(default_factory=dict)
    timeout_s: float = 10.0
    memory_mb: int = 512
    output_limit_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if not isinstance(self.code, str):
            raise InvalidInput(f"code must be a str, got {type(self.code).__name__}")
        if not isinstance(self.stdin, str):
            raise InvalidInput(f"stdin must be a str, got {type(self.stdin).__name__}")
        if not (0 < self.timeout_s <= 3600):
            raise InvalidInput(f"timeout_s must be in (0, 3600], got {self.timeout_s}")
        if not (16 <= self.memory_mb <= 1 << 20):
            raise InvalidInput(f"memory_mb must be in [16, 1048576], got {self.memory_mb}")
        if not (1024 <= self.output_limit_bytes <= 1 << 30):
            raise InvalidInput(f"output_limit_bytes must be in [1024, 2**30], got {self.output_limit_bytes}")
        files = {}
        for path, data in dict(self.files).items():
            files[check_relative_path(path)] = data.encode() if isinstance(data, str) else bytes(data)
        object.__setattr__(self, "files", files)


def check_relative_path(path: str) -> str:
    """A file name for the work dir: relative, no `..`, no NUL. Anything else is refused by name."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise InvalidInput(f"files: invalid file name {path!r}")
    parts = path.split("/")
    if path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise InvalidInput(f"files: {path!r} must be a relative path inside the work dir (no '..', no leading '/')")
    return path


def decode_files(files: Mapping[str, str] | None, where: str = "files") -> dict[str, bytes]:
    """SandboxFusion's `files` (path -> base64) as bytes, naming a bad entry."""
    out = {}
    for path, b64 in (files or {}).items():
        try:
            out[path] = base64.b64decode(b64, validate=True)
        except (ValueError, TypeError):
            raise InvalidInput(f"{where}[{path!r}] is not valid base64") from None
    return out
