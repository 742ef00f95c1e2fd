"""A harness description (`Harness`: its npm package, binary, API and how it is launched) and the agent program that
runs it in an episode's workspace against the gateway (`harness_agent`).

The binary runs *inside* the workspace (installed in its image: `install.harness_image`), so its shell tool calls run
there; its model calls go to the gateway session through `route`. Its config files are written into a home folder of
its own in the workspace (`HOME`), never the host's. A missing binary, a command the workspace cannot start or a
route that cannot be made is the host's (`InfraError`: the episode is `infra_error`); whatever the harness does with
the model's replies is the episode's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from slime_env.errors import InfraError, InvalidInput
from slime_env.tools_sandbox.workspace import Workspace

# The system prompt `HarnessEnv` gives every harness by default: their own (Codex ~3,800 tokens, Claude Code's larger,
# with their tool sets) leave a small model's 8k context little room; `system_prompt=None` keeps the harness's own
SHORT_PROMPT = ("You are a coding agent in a Linux machine. Use your shell tool to inspect files and run commands. "
                "Finish the task, then reply with a short summary.")
HOME = "/tmp/.slime-env-harness"  # the harness's HOME in the workspace: its config, logs, caches
LOG_TAIL = 4000


@dataclass(frozen=True, slots=True)
class Bounds:
    """What bounds one harness run: `max_turns` (model calls the harness's own loop may make, by its own setting),
    `max_output_tokens` (per call), `timeout_s` (the run's wall time: its process group is killed after it),
    `context_tokens` (the window the harness plans for: the engine's)."""

    max_turns: int = 8
    max_output_tokens: int = 512
    timeout_s: float = 600.0
    context_tokens: int = 8192

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_output_tokens", "context_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidInput(f"harness bounds: {name} must be a positive integer, got {value!r}")
        if not (isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise InvalidInput(f"harness bounds: timeout_s must be a positive number, got {self.timeout_s!r}")


@dataclass(frozen=True, slots=True)
class Launch:
    """One run of a harness: its argv, its environment and the files it reads (path in the workspace -> text)."""

    argv: list[str]
    env: dict[str, str]
    files: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RunContext:
    """What a harness's `launch` is given: the gateway's base URL as the workspace reaches it (`.../v1` for OpenAI
    APIs, the session root for Anthropic's), the session key, the task's prompt, the workdir, its home, the bounds,
    the model name it sends and the system prompt replacing its own (None: its own)."""

    base_url: str
    api_key: str
    prompt: str
    workdir: str
    home: str
    bounds: Bounds
    model: str = "policy"
    system_prompt: str | None = None


@dataclass(frozen=True, slots=True)
class Harness:
    """A coding-agent CLI as an episode's agent: `name`, the npm `package` at an exact `version`, its linux-x64
    `binary` (a path in the npm install), the `api` it speaks to the gateway (`anthropic`, `openai`), `launch(ctx) ->
    Launch`, and `features` (what works through the gateway: docs/agentic.md's table)."""

    name: str
    package: str
    version: str
    binary: str
    api: str
    launch: Callable[[RunContext], Launch]
    features: dict[str, str] = field(default_factory=dict)

    @property
    def path_in_image(self) -> str:
        return f"/opt/slime-env/{self.name}/{PurePosixPath(self.binary).name}"


def harness_agent(harness: Harness, bounds: Bounds | None = None, *, system_prompt: str | None = SHORT_PROMPT,
                  model: str = "policy") -> Callable[..., Any]:
    """An agent for `WorkspaceAgentEnv` (`api=harness.api`): writes the harness's config into the workspace, runs its
    binary there once, bounded by `bounds`; returns `{"harness", "exit_code", "status", "output"}` (its output's
    tail). A run past `bounds.timeout_s` raises TimeoutError (the episode is `truncated`, its work still verified)."""
    bounds = bounds or Bounds()

    async def agent(base_url: str, api_key: str, task: Any, ws: Workspace) -> dict[str, Any]:
        from slime_env.envs.harness.route import gateway_url_for

        check = await ws.exec(["test", "-x", harness.path_in_image], timeout_s=30)
        if check.status == "sandbox_error" or check.exit_code != 0:
            raise InfraError(f"the {harness.name} binary is not in the workspace image ({harness.path_in_image}): "
                             f"start the workspace from harness_image(); {check.reason or check.stderr.strip()}")
        made = await ws.exec(["mkdir", "-p", HOME], timeout_s=30)
        if made.exit_code != 0:
            raise InfraError(f"could not make the harness's home {HOME} in the workspace: {made.stderr.strip()}")
        url = await gateway_url_for(ws, base_url)
        launch = harness.launch(RunContext(url, api_key, task.prompt, ws.workdir, HOME, bounds, model, system_prompt))
        for path, text in launch.files.items():
            await ws.write_file(path, text, mode=0o600, user=ws.default_user)
        env = {"HOME": HOME, "PATH": "/usr/local/bin:/usr/bin:/bin", **launch.env}
        result = await ws.exec([harness.path_in_image, *launch.argv], env=env, timeout_s=bounds.timeout_s,
                               output_limit_bytes=16 << 20)
        if result.status == "sandbox_error":
            raise InfraError(f"the workspace could not start {harness.name}: {result.reason}")
        if result.exit_code == 127 and not result.stdout:
            raise InfraError(f"{harness.name} could not be started in the workspace: {result.stderr.strip()[-500:]}")
        if result.status == "timeout":
            raise TimeoutError(f"{harness.name} ran past its {bounds.timeout_s:g}s and was killed")
        return {"harness": f"{harness.name}@{harness.version}", "exit_code": result.exit_code,
                "status": result.status, "output": (result.stdout + result.stderr)[-LOG_TAIL:]}

    agent.harness = harness  # type: ignore[attr-defined]
    return agent
