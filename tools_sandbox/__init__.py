"""tools_sandbox: sandboxed execution of untrusted model output.

One async interface, `await sandbox.run(code, language="python", stdin=, files=, timeout_s=,
memory_mb=) -> ExecResult`, over four backends:
- `DockerSandbox`: a warm pool of locked-down containers (the strongest; needs a Docker engine and
  the image from `slime-env sandbox build-image`);
- `BwrapSandbox`: one bubblewrap sandbox per run (namespaces, rlimits, cgroups as root);
- `ProcessSandbox`: a plain subprocess with rlimits — NOT isolation, for trusted code only;
- `RemoteSandbox`: a `slime-env serve-sandbox` or SandboxFusion server.
`auto()` picks the strongest available; `cleanup()` removes containers left by crashed processes.
Per-episode workspaces — a whole machine an agent works in for an episode — are `tools_sandbox.workspace`.
Imports `slime_env` only; `slime_env` never imports this package.
"""

from slime_env.tools_sandbox.auto import auto
from slime_env.tools_sandbox.base import Sandbox
from slime_env.tools_sandbox.languages import Language, get_language, language_names, register_language
from slime_env.tools_sandbox.types import EXEC_STATUSES, ExecRequest, ExecResult, SandboxError

__all__ = ["EXEC_STATUSES", "ExecRequest", "ExecResult", "Language", "Sandbox", "SandboxError", "auto",
           "cleanup", "get_language", "language_names", "register_language", "BwrapSandbox", "DockerSandbox",
           "ProcessSandbox", "RemoteSandbox"]


def cleanup(*, all_owners: bool = False) -> int:
    """Remove sandbox containers whose owner process is gone (all of them with `all_owners`)."""
    from slime_env.tools_sandbox.docker_pool import cleanup as _cleanup

    return _cleanup(all_owners=all_owners)


def __getattr__(name: str):
    # Backends load on first use: the docker SDK and aiohttp stay out of processes that never need them.
    if name == "BwrapSandbox":
        from slime_env.tools_sandbox.bwrap import BwrapSandbox

        return BwrapSandbox
    if name == "DockerSandbox":
        from slime_env.tools_sandbox.docker_pool import DockerSandbox

        return DockerSandbox
    if name == "ProcessSandbox":
        from slime_env.tools_sandbox.process import ProcessSandbox

        return ProcessSandbox
    if name == "RemoteSandbox":
        from slime_env.tools_sandbox.remote import RemoteSandbox

        return RemoteSandbox
    raise AttributeError(name)
