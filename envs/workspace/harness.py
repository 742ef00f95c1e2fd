"""`WorkspaceAgentEnv`: a black-box agent harness (mini-swe-agent, your own loop) working in a per-episode workspace,
its model calls through the agent gateway (exact ledgers and branches, as `AgentEnv`).

The program is `agent(base_url, api_key, task, workspace)`: it talks to the gateway session at `base_url` however it
likes and runs its commands in `workspace` (`Workspace.exec`). After it returns (or crashes, or runs out of time),
`verify(task, workspace)` scores the episode — the harness's own claims ("submitted", "tests pass") count for
nothing. A workspace that does not start, a harness that raises `InfraError` (its binary missing) and a verifier that
raises it (its own container did not start) make the episode `infra_error`, never a 0 (`AgentEnv`). The workspace is
released after verification, whatever happened. The episode's container record
(`metadata["workspace"]`: the verifier's info on every branch; the start, exec and verify seconds on the main
trajectory only, so they are counted once).
"""

from __future__ import annotations

import contextvars
import inspect
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from slime_env.agent_env import AgentEnv, empty_trajectory
from slime_env.errors import InfraError, InvalidInput
from slime_env.loading import load_object
from slime_env.trajectory import Trajectory
from slime_env.types import Task, coerce_reward
from slime_env.envs.workspace.env import kill_before_verify
from slime_env.tools_sandbox.types import SandboxError
from slime_env.tools_sandbox.workspace import Workspace, WorkspaceSpec

_EPISODE: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("slime_env_workspace_episode")


class WorkspaceAgentEnv(AgentEnv):
    """An agent program in a workspace (module docstring). `agent`: `(base_url, api_key, task, workspace) -> result`
    (async, or plain: run in a thread; or an import path); `verify`: `(task, workspace) -> reward` or `(reward, info)`
    (async or plain); the workspace: `workspace(task, pool=)` (async; e.g. `slime_env.envs.harbor.harbor_workspace`),
    else `task.metadata["workspace"]` over `spec`; `backend` / `pool` as for `WorkspaceEnv`. The rest is `AgentEnv`'s
    (`parser`, `deadline_s`, `strict`). An agent cut by its deadline is still verified (its work so far counts, as in
    Harbor); a crashed one scores 0."""

    scored_statuses = ("completed", "truncated")

    def __init__(self, agent: Callable[..., Any] | str, verify: Callable[..., Any] | str, *,
                 spec: WorkspaceSpec | None = None, workspace: Callable[..., Any] | str | None = None,
                 backend: str = "docker", pool: Any = None, **kwargs: Any):
        super().__init__(agent, self._verified_reward, **kwargs)
        self.verify = load_object(verify) if isinstance(verify, str) else verify
        self.open = load_object(workspace) if isinstance(workspace, str) else workspace
        if not callable(self.verify):
            raise InvalidInput(f"WorkspaceAgentEnv verify must be callable, got {type(self.verify).__name__}")
        self.spec, self.backend, self.pool = spec, backend, pool

    def workspace_spec(self, task: Task) -> WorkspaceSpec:
        given = dict((task.metadata or {}).get("workspace") or {})
        if not given and self.spec is None:
            raise InvalidInput("WorkspaceAgentEnv: the task names no workspace (metadata['workspace']) and there is "
                               "no spec")
        base = self.spec or WorkspaceSpec(image=given["image"])
        return replace(base, **{k: v for k, v in given.items() if k in ("image", "workdir", "env", "user")})

    async def run(self, gateway: Any, task: Task, *, metadata: dict[str, Any] | None = None,
                  deadline_s: float | None = None) -> list[Trajectory]:
        from slime_env.tools_sandbox.workspace.pool import shared_pool

        pool = self.pool or shared_pool(self.backend)
        t0 = time.perf_counter()
        try:
            if self.open is not None:  # a task family's own start (e.g. Harbor: its image, log folders)
                ws = await self.open(task, pool=pool)
            else:
                ws = await pool.acquire(self.workspace_spec(task))
        except InvalidInput as e:  # the task's own error (no workspace named, a broken task folder)
            return [empty_trajectory(task, "failed", f"the workspace did not start: {e}", metadata)]
        except (SandboxError, OSError, TimeoutError, InfraError) as e:  # before the agent ran: the host's
            return [empty_trajectory(task, "infra_error", f"the workspace did not start: {type(e).__name__}: {e}",
                                     metadata)]
        episode = {"workspace": ws, "start_s": time.perf_counter() - t0, "info": {}}
        token = _EPISODE.set(episode)
        try:
            trajectories = await super().run(gateway, task, metadata=metadata, deadline_s=deadline_s)
        finally:
            _EPISODE.reset(token)
            await pool.release(ws)
        record = {"start_s": episode["start_s"], "exec_s": getattr(ws, "exec_s", 0.0),
                  "verify_s": episode.get("verify_s", 0.0),
                  "killed_before_verify": episode.get("killed_before_verify", 0), **episode["info"]}
        # the container's time belongs to the episode, not to each branch: its seconds go on the main trajectory
        # alone (on every branch, `time_split` summed them once per branch); the verifier's record is every branch's
        main, *sides = trajectories
        verdict = {k: v for k, v in record.items() if k not in ("start_s", "exec_s", "verify_s")}
        return [replace(main, metadata={**main.metadata, "workspace": record}),
                *(replace(t, metadata={**t.metadata, "workspace": verdict}) for t in sides)]

    async def _call(self, url: str, key: str, task: Task) -> Any:
        ws = _EPISODE.get()["workspace"]
        if inspect.iscoroutinefunction(self.agent):
            return await self.agent(url, key, task, ws)
        import asyncio

        result = await asyncio.to_thread(self.agent, url, key, task, ws)
        return await result if inspect.isawaitable(result) else result

    async def _verified_reward(self, task: Task, result: Any, trajectories: list[Trajectory]) -> float:
        episode = _EPISODE.get()
        t0 = time.perf_counter()
        ws: Workspace = episode["workspace"]
        # Nothing the harness or the agent started may run beside the verifier (a `setsid` loop rewriting its tests)
        episode["killed_before_verify"] = await kill_before_verify(ws)
        value = self.verify(task, ws)
        if inspect.isawaitable(value):
            value = await value
        episode["verify_s"] = time.perf_counter() - t0
        if isinstance(value, tuple):
            value, info = value
            episode["info"] = dict(info or {})
        return coerce_reward(value, "WorkspaceAgentEnv verify")
