"""`HarnessEnv` (`Harness-v0`): a coding-agent CLI (`harness: claude-code | codex | opencode | mini-swe-agent`) as
the agent of a Harbor task (SWE tasks included: they are Harbor folders), through the gateway, in the task's
container with the harness installed in a layer over its image; the reward from the task's own verifier, in a fresh
container of the task's image by default (`harbor_verify`), so nothing the harness left can touch it.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

from slime_env.errors import InvalidInput
from slime_env.types import Task
from slime_env.envs.harbor import environment, harbor_task, harbor_verify
from slime_env.envs.harness.base import SHORT_PROMPT, Bounds, Harness, harness_agent
from slime_env.envs.workspace.harness import WorkspaceAgentEnv
from slime_env.tools_sandbox.workspace import Workspace


def get_harness(name: str) -> Harness:
    """The harness called `name`; InvalidInput names the field and the known ones."""
    from slime_env.envs.harness import HARNESSES

    if name not in HARNESSES:
        raise InvalidInput(f"Harness-v0: harness must be one of {sorted(HARNESSES)} or 'mini-swe-agent', got "
                           f"{name!r}")
    return HARNESSES[name]


async def harness_workspace(task: Task, harness: Harness, *, backend: str = "docker") -> Workspace:
    """The Harbor task's workspace (its image with `harness` installed over it, its limits, user and log folders)
    with the gateway reachable from it (`route.start_workspace`)."""
    from slime_env.envs.harness.install import harness_image_async
    from slime_env.envs.harness.route import start_workspace

    ht = harbor_task(task)
    image = await harness_image_async(await environment.task_image(ht), harness)
    spec = environment.workspace_spec(ht, image, network=ht.config.agent.network_mode)
    if ht.config.agent.user is not None:
        spec = dataclasses.replace(spec, user=str(ht.config.agent.user))
    ws = await start_workspace(spec, backend=backend)
    try:
        await environment.prepare_logs(ws)
        if environment.uploads_environment_dir(ht, image):
            await ws.upload(ht.environment_dir, ws.workdir)
    except BaseException:
        await ws.close()
        raise
    return ws


class HarnessEnv(WorkspaceAgentEnv):
    """A harness on Harbor tasks (module docstring). `harness`: its name; `max_turns`, `max_output_tokens`,
    `timeout_s`, `context_tokens`: its `Bounds` (set through its own settings); `system_prompt`: replaces its own
    (default: a short one that fits an 8k context; None: the harness's own); `mode`: the verifier's
    (`harbor_verify`); `backend`: `docker` (a closed network but for the gateway) or `bwrap`; `deadline_s`: the
    episode's (default `timeout_s` + 300: the workspace start and the verifier). `mini-swe-agent` runs in this
    process with its commands in the workspace (`mini_swe`)."""

    def __init__(self, harness: str = "claude-code", *, max_turns: int = 8, max_output_tokens: int = 512,
                 timeout_s: float = 600.0, context_tokens: int = 8192, system_prompt: str | None = SHORT_PROMPT,
                 mode: str | None = None, backend: str = "docker", deadline_s: float | None = None, **kwargs: Any):
        bounds = Bounds(max_turns, max_output_tokens, timeout_s, context_tokens)
        verify = partial(harbor_verify, mode=mode)
        if harness == "mini-swe-agent":
            from slime_env.envs.harbor import harbor_workspace
            from slime_env.envs.workspace.mini_swe import mini_swe_agent

            agent, opener, api = mini_swe_agent(step_limit=max_turns, command_timeout_s=60), harbor_workspace, "openai"
            self.harness = None
        else:
            self.harness = get_harness(harness)
            agent = harness_agent(self.harness, bounds, system_prompt=system_prompt)
            opener, api = self._open, self.harness.api
        self.bounds = bounds
        super().__init__(agent, verify, workspace=opener, backend=backend, api=api,
                         deadline_s=deadline_s if deadline_s is not None else timeout_s + 300.0, **kwargs)

    async def _open(self, task: Task, *, pool: Any = None) -> Workspace:
        return await harness_workspace(task, self.harness, backend=self.backend)
