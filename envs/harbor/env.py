"""`HarborEnv` (`Harbor-v0`): Harbor task folders as RL episodes, with `WorkspaceEnv`'s tools.

A task is `{"prompt": <instruction.md>, "metadata": {"harbor_task": <folder>}}` (`harbor_tasks(path)` makes them from
a dataset). The episode's workspace is the task's container (its image built once, its limits and network from
task.toml, Harbor's log folders made); the agent works in it as `[agent].user`; when it submits (or runs out of
turns) the task's verifier scores it, in a fresh workspace by default (`mode=None`: the task's own `separate`
verifier if it asks for one, else `isolated`: only the agent's workdir or the task's artifact paths are carried
over, so nothing the agent did to the system can touch the verdict). `mode="shared"` (Harbor's default: the
agent's own container, hardened, but open to a root agent's forgeries) runs only when named, with a warning.
The reward is `reward.txt`'s number, or `reward.json`'s `reward` (else its mean); all named rewards, the
verifier's status and the paths the copy dropped go to `info`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
import warnings
from collections.abc import Awaitable, Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

from slime_env import InvalidInput, Task
from slime_env.errors import InfraError
from slime_env.loading import load_object
from slime_env.envs.harbor import environment, verifier
from slime_env.envs.harbor.task import HarborTask, load_dataset, load_task
from slime_env.envs.workspace.env import WorkspaceEnv, starting_workspace
from slime_env.tools_sandbox.workspace import Workspace

SYSTEM_PROMPT = ("You are an autonomous agent working in a Linux machine of your own. Use the tools to inspect and "
                 "change files and to run commands. When the task is done, call `submit`; your work is then checked "
                 "by tests you do not see.")
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "harbor_tasks"


@lru_cache(maxsize=4096)
def _load(path: str) -> HarborTask:
    return load_task(path)


def harbor_task(task: Task) -> HarborTask:
    """The Harbor task folder an episode's task names (`metadata["harbor_task"]`)."""
    path = (task.metadata or {}).get("harbor_task")
    if not path:
        raise InvalidInput("a Harbor episode's task needs metadata['harbor_task'] (the task folder); make tasks "
                           "with slime_env.envs.harbor.harbor_tasks(path)")
    return _load(str(path))


def harbor_tasks(path: str | Path = EXAMPLES, *, split: str | None = None, test_fraction: float = 0.25,
                 limit: int | None = None, skip_invalid: bool = False) -> list[dict[str, Any]]:
    """Tasks of a Harbor dataset (a folder of task folders, or a list file) for `train_data` / `eval_data`
    (`{generator: "slime_env.envs.harbor:harbor_tasks", path: DIR, split: train}`). `split`: a fixed split by a
    hash of each task's name (`test_fraction` of them are `test`); None: all. `limit`: the first that many."""
    if split not in (None, "train", "test"):
        raise InvalidInput(f"harbor_tasks: split must be 'train', 'test' or None, got {split!r}")
    out = []
    for t in load_dataset(path, skip_invalid=skip_invalid):
        digest = int(hashlib.sha256(t.name.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
        if split is not None and (digest < test_fraction) != (split == "test"):
            continue
        out.append({"prompt": t.instruction, "metadata": {"harbor_task": str(t.path), "name": t.name}})
    return out[:limit] if limit is not None else out


async def harbor_workspace(task: Task, *, pool=None, backend: str = "docker") -> Workspace:
    """A started workspace for a Harbor episode (from `pool`, default the process's shared one): the task's image
    (built if need be), its limits, its agent-phase network and user, Harbor's log folders."""
    from slime_env.tools_sandbox.workspace.pool import shared_pool

    ht = harbor_task(task)
    image = await environment.task_image(ht)
    spec = environment.workspace_spec(ht, image, network=ht.config.agent.network_mode)
    if ht.config.agent.user is not None:
        spec = dataclasses.replace(spec, user=str(ht.config.agent.user))
    pool = pool or shared_pool(backend)
    ws = await pool.acquire(spec)
    try:
        await environment.prepare_logs(ws)
        if environment.uploads_environment_dir(ht, image):
            await ws.upload(ht.environment_dir, ws.workdir)
    except BaseException:
        await pool.release(ws)
        raise
    return ws


async def harbor_verify(task: Task, ws: Workspace, *, mode: str | None = None,
                        reward_workspace: Callable[[Any], Awaitable[Workspace]] | None = None
                        ) -> tuple[float, dict[str, Any]]:
    """Score a Harbor episode's workspace with its task's verifier (`mode`: None, a fresh container, by default;
    see `verifier.resolve_mode`); returns (reward, info); `info["harbor"]["dropped"]` lists what the copy into
    the verifier's workspace left out (unsafe members, links it could not restore). A SWE task (`[metadata.swe]`
    in task.toml, made by `slime-env swe build`) is scored by `swe_reward` in every mode: its hidden tests on a
    clean copy with the agent's edits, behind the guard, in a workspace from `reward_workspace(spec)` if given (else
    the repository's Docker image). A failure of the verifier's own machinery (`verifier.verify`'s `infra_error`)
    raises InfraError: the episode is `infra_error`, not a 0."""
    ht = harbor_task(task)
    if isinstance((ht.config.metadata or {}).get("swe"), dict):
        from slime_env.envs.swe import load_task as load_swe_task
        from slime_env.envs.swe import swe_reward

        out = await swe_reward(load_swe_task(ht.path), ws, start_workspace=reward_workspace)
        if out.status == "infra_error":
            raise InfraError(f"the SWE verifier: {out.reason}")
        return out.reward, {"swe": {"status": out.status, "reason": out.reason, "tests": dict(out.tests),
                                    "changed_files": list(out.changed_files), "timings": dict(out.timings)}}
    result = await verifier.verify(ht, ws, mode=mode)
    if result.status == "infra_error":  # the verifier's machinery, before any of the agent's work was in it
        raise InfraError(f"the verifier ({result.mode}): {result.reason}")
    return result.reward(), {"harbor": {"status": result.status, "reason": result.reason, "rewards": result.rewards,
                                        "mode": result.mode, "dropped": list(result.dropped)}}


class _Closing:
    """Where an episode's workspace from a `workspace` factory goes back: closed."""

    @staticmethod
    async def release(ws: Workspace) -> None:
        await ws.close()


class HarborEnv(WorkspaceEnv):
    """Harbor task folders as episodes (module docstring). `dataset`: tasks for resets without one (default: the
    shipped examples); `mode`: the verifier's (None, the default: a fresh container, `separate` for tasks that ask
    for it, else `isolated`; `isolated`; `separate`; `shared` only when named, with a warning).
    `workspace`: `async (task) -> Workspace` (or its "module:function") making the episode's started workspace
    instead of the task's image on `pool` (closed when the episode ends); `reward_workspace`: `async (spec) ->
    Workspace` (or its path), the fresh workspace a SWE task's hidden tests run in (`swe_reward`'s
    `start_workspace`). Together they run SWE tasks without Docker (`slime_env.envs.swe.local`).
    The rest is `WorkspaceEnv`'s."""

    def __init__(self, *, dataset: str | Path | None = None, mode: str | None = None, backend: str = "docker",
                 pool: Any = None, system_prompt: str | None = SYSTEM_PROMPT, max_turns: int | None = 30,
                 command_timeout_s: float = 120.0,
                 workspace: str | Callable[[Task], Awaitable[Workspace]] | None = None,
                 reward_workspace: str | Callable[[Any], Awaitable[Workspace]] | None = None, **kwargs: Any):
        if mode not in (None, *verifier.MODES):
            raise InvalidInput(f"Harbor-v0: mode must be one of {verifier.MODES} or None, got {mode!r}")
        if mode == "shared":
            warnings.warn(f"Harbor-v0: {verifier.SHARED_WARNING}", UserWarning, stacklevel=2)
        self.dataset, self.mode = dataset, mode
        self.workspace_factory = load_object(workspace) if isinstance(workspace, str) else workspace
        self.reward_workspace = load_object(reward_workspace) if isinstance(reward_workspace, str) else reward_workspace
        super().__init__(backend=backend, pool=pool, system_prompt=system_prompt, max_turns=max_turns,
                         command_timeout_s=command_timeout_s, **kwargs)

    async def setup_state(self, task: Task):
        from slime_env.tools_sandbox.workspace.pool import shared_pool

        t = time.perf_counter()
        ht = harbor_task(task)
        if not isinstance((ht.config.metadata or {}).get("swe"), dict):
            verifier.resolve_mode(ht, self.mode)  # a mode the task cannot run in is refused before its container
        async with starting_workspace():
            if self.workspace_factory is not None:
                pool, ws = _Closing(), await self.workspace_factory(task)
            else:
                pool = self.pool or shared_pool(self.backend, warm=self.warm)
                ws = await harbor_workspace(task, pool=pool)
        state = {"workspace": ws, "pool": pool, "edits": {}, "submitted": False, "verify_s": 0.0,
                 "start_s": time.perf_counter() - t}
        state["state"] = state
        return state

    async def verify(self, task: Task, ws: Workspace) -> tuple[float, dict[str, Any]]:
        return await harbor_verify(task, ws, mode=self.mode, reward_workspace=self.reward_workspace)

    def default_tasks(self):
        source = self.dataset or EXAMPLES
        return [Task.coerce(t, "harbor task") for t in harbor_tasks(source)] if Path(source).exists() else None
