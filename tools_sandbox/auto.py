"""`auto()`: the strongest sandbox this machine offers (docker -> bwrap -> process), and says which."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

from slime_env.tools_sandbox.base import Sandbox
from slime_env.tools_sandbox.local_exec import as_user
from slime_env.tools_sandbox.types import SandboxError

from slime_env.errors import InvalidInput

log = logging.getLogger("slime_env.tools_sandbox")
BACKENDS = ("docker", "bwrap", "process")
_SHARED: dict[tuple, Sandbox] = {}


def auto(prefer: Sequence[str] | str | None = None, *, shared: bool = True,
         options: Mapping[str, Mapping[str, Any]] | None = None, **common: Any) -> Sandbox:
    """The first backend of `prefer` that works here (default docker, bwrap, process).

    `prefer` may also be one backend name or a URL (`http://host:port`, a `RemoteSandbox`); the
    environment variable `SLIME_ENV_SANDBOX` overrides the default the same way. `common` kwargs
    (max_concurrency, timeout_s, memory_mb, output_limit_bytes) go to every backend; `options[name]`
    to one (e.g. `options={"docker": {"pool_size": 8}}`). With `shared=True` one instance per
    configuration is reused in this process, so envs made per episode share one pool. The chosen
    sandbox's `auto_notes` say why stronger backends were skipped; the choice is logged.
    """
    prefer = prefer or os.environ.get("SLIME_ENV_SANDBOX") or BACKENDS
    order = [prefer] if isinstance(prefer, str) else list(prefer)
    if not order:
        raise InvalidInput("auto(prefer=...) needs at least one backend")
    options = {k: dict(v) for k, v in (options or {}).items()}
    key = (tuple(order), _freeze(options), _freeze(common))
    if shared and key in _SHARED:
        return _SHARED[key]
    notes: list[str] = []
    for name in order:
        try:
            sandbox = make_sandbox(name, {**common, **options.get(name, {})})
        except SandboxError as e:
            notes.append(f"{name}: {e}")
            continue
        sandbox.auto_notes = notes  # type: ignore[attr-defined]
        log.info("sandbox: %s%s", sandbox.describe(), f" (skipped: {'; '.join(notes)})" if notes else "")
        if shared:
            _SHARED[key] = sandbox
        return sandbox
    raise SandboxError("no sandbox backend works here: " + "; ".join(notes))


def make_sandbox(name: str, kwargs: dict[str, Any]) -> Sandbox:
    """The sandbox backend `name` (docker, bwrap, process or an http(s) server's URL) built with `kwargs`;
    `SandboxError` where it cannot run here."""
    if name.startswith(("http://", "https://")):
        from slime_env.tools_sandbox.remote import RemoteSandbox

        return RemoteSandbox(name, **kwargs)
    if name == "docker":
        from slime_env.tools_sandbox.docker_pool import DockerSandbox

        return DockerSandbox(**kwargs)
    if name == "bwrap":
        from slime_env.tools_sandbox.bwrap import BwrapSandbox

        probe_bwrap()
        # The fork server: the same isolation between runs, a few ms a run (options={"bwrap": {"fork_server":
        # False}} starts one bubblewrap sandbox per run instead).
        return BwrapSandbox(**{"fork_server": True, **kwargs})
    if name == "process":
        from slime_env.tools_sandbox.process import ProcessSandbox

        return ProcessSandbox(**kwargs)
    raise InvalidInput(f"unknown sandbox backend {name!r}: use one of {BACKENDS} or an http:// URL")


def probe_bwrap() -> None:
    """SandboxError unless bubblewrap can create its namespaces here (user namespaces may be disabled)."""
    if shutil.which("bwrap") is None:
        raise SandboxError("bubblewrap is not installed (apt-get install -y bubblewrap)")
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "--", "/bin/true"]
    proc = subprocess.run(as_user(argv, 65534 if os.geteuid() == 0 else None), capture_output=True, text=True,
                          timeout=30)
    if proc.returncode != 0:
        raise SandboxError(f"bubblewrap cannot create a sandbox here: {proc.stderr.strip()[:300]}")


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value
