"""`TerminalEnv` (`Terminal-v0`): generated terminal tasks (Harbor task folders) as episodes with a `bash` and a
`submit` tool, in bubblewrap workspaces by default, scored by each task's own verifier in a fresh workspace.

It is `Harbor-v0` with three things set for small models and hosts without Docker: two tools instead of four, and
a short system prompt that shows the call format itself (no tool schemas in the prompt: a 135M model copies a
format, it does not read a schema); the workspace backend is `bwrap` (the agent's workspace and the verifier's fresh
one alike); `image` may replace every task's `docker_image` (e.g. `/`, the host's root file system under
bubblewrap, where no Docker engine is there to export an image from).
"""

from __future__ import annotations

import functools
import time
from typing import Any

from slime_env import Message, Task
from slime_env.errors import InfraError
from slime_env.envs.harbor import environment, verifier
from slime_env.envs.harbor.env import HarborEnv, harbor_task
from slime_env.envs.workspace.env import starting_workspace
from slime_env.tools_sandbox.workspace import Workspace

# short on purpose: every token of it is in every sequence a CPU run trains on
SYSTEM_PROMPT = ("Use bash, one command per reply:\n"
                 '<tool_call>{"name": "bash", "arguments": {"command": "ls /app"}}</tool_call>\n'
                 "When the task is done, reply:\n"
                 '<tool_call>{"name": "submit", "arguments": {}}</tool_call>')
TOOLS = ("bash", "submit")


class TerminalEnv(HarborEnv):
    """Generated terminal tasks (module docstring). Tasks: `terminal_tasks(...)` rows (`metadata["harbor_task"]`);
    `backend`: `bwrap` (default) or `docker`; `image`: the root every workspace starts from instead of the task's
    `docker_image` (None: the task's). Verification is always in a fresh workspace (`isolated`). The rest is
    `Harbor-v0`'s."""

    describe_tools = False  # the system prompt shows the format

    def __init__(self, *, backend: str = "bwrap", image: str | None = None, max_turns: int | None = 4,
                 command_timeout_s: float = 10.0, system_prompt: str | None = SYSTEM_PROMPT,
                 max_output_chars: int = 1200, **kwargs: Any):
        super().__init__(mode="isolated", backend=backend, max_turns=max_turns, command_timeout_s=command_timeout_s,
                         system_prompt=system_prompt, max_output_chars=max_output_chars, **kwargs)
        self.root_image = image
        self._local = [t for t in self._local if t.name in TOOLS]
        self._set_tools(self._local)

    def _image(self, task: Task) -> str:
        return self.root_image or harbor_task(task).config.environment.docker_image or ""

    async def setup_state(self, task: Task):
        from slime_env.tools_sandbox.workspace.pool import shared_pool

        t = time.perf_counter()
        ht = harbor_task(task)
        spec = environment.workspace_spec(ht, self._image(task), network=ht.config.agent.network_mode)
        pool = self.pool or shared_pool(self.backend, warm=self.warm)
        async with starting_workspace():
            ws = await pool.acquire(spec)
        try:
            async with starting_workspace("the task's files"):  # nothing of the agent's is there yet
                await environment.prepare_logs(ws)
                if ht.environment_dir.is_dir():  # Harbor uploads a prebuilt image's environment/ into its workdir
                    await ws.upload(ht.environment_dir, ws.workdir)
        except BaseException:
            await pool.release(ws)
            raise
        state = {"workspace": ws, "pool": pool, "edits": {}, "submitted": False, "verify_s": 0.0,
                 "start_s": time.perf_counter() - t}
        state["state"] = state
        return state

    async def verify(self, task: Task, ws: Workspace) -> tuple[float, dict[str, Any]]:
        from slime_env.tools_sandbox.workspace.open import open_workspace

        result = await verifier.verify(harbor_task(task), ws, mode="isolated", image=self._image(task),
                                       open_workspace=functools.partial(open_workspace, backend=self.backend))
        if result.status == "infra_error":
            raise InfraError(f"the verifier ({result.mode}): {result.reason}")
        return result.reward(), {"harbor": {"status": result.status, "reason": result.reason,
                                            "rewards": result.rewards, "mode": result.mode,
                                            "dropped": list(result.dropped)}}

    def no_tool_message(self) -> Message:
        return Message("user", "Reply with one bash tool call, or with the submit tool call when the task is done.")

    def default_tasks(self):
        from slime_env.envs.terminal.tasks import terminal_tasks

        return [Task.coerce(t, "terminal task") for t in terminal_tasks(8, seed=0, split="test")]
