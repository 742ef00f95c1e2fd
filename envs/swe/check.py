"""End-to-end check of one task folder: its agent image builds, the unchanged repository earns 0 and the oracle
(`solution/solve.sh`, run in the agent's workspace as Harbor's oracle agent would) earns 1 through `swe_reward`."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from slime_env.envs.swe.manifest import WORKDIR
from slime_env.envs.swe.reward import swe_reward
from slime_env.envs.swe.task import SweTask, load_task


def task_image_tag(task: SweTask) -> str:
    """A Docker tag for the agent's image of a task (Docker's repository names allow one separator at a time)."""
    return "slime-env-swe-task/" + (re.sub(r"[^a-z0-9]+", "-", task.name.lower()).strip("-")[:100] or "task")


async def build_task_image(task: SweTask) -> str:
    """Build the agent's image of a task folder (the repository's layers come from Docker's cache)."""
    from slime_env.envs.swe.manifest import ensure_image
    from slime_env.tools_sandbox.workspace.images import build_image_async

    await ensure_image(task.repo_dockerfile, task.image)  # the same layers, tagged for the reward
    tag = task_image_tag(task)
    await build_image_async(Path(task.path) / "environment", tag)
    return tag


async def start_agent_workspace(task: SweTask, image: str):
    from slime_env.tools_sandbox.workspace import Limits, WorkspaceSpec, open_workspace

    return await open_workspace(WorkspaceSpec(image=image, workdir=WORKDIR, limits=Limits(
        cpus=task.cpus, memory_mb=task.memory_mb, network="none")))


async def run_oracle(task: SweTask, ws) -> None:
    """Upload solution/ to /solution and run solve.sh, as Harbor's oracle agent does."""
    await ws.upload(Path(task.path) / "solution", "/solution")
    res = await ws.exec(["bash", "/solution/solve.sh"], cwd=WORKDIR, timeout_s=120)
    if res.exit_code != 0:
        raise RuntimeError(f"{task.name}: solve.sh failed: {res.stderr[-500:]}")


async def check_task(folder: str | Path, *, keep_image: bool = False) -> dict:
    task = load_task(folder)
    image = await build_task_image(task)
    try:
        ws = await start_agent_workspace(task, image)
        try:
            nop = await swe_reward(task, ws)
            await run_oracle(task, ws)
            oracle = await swe_reward(task, ws)
        finally:
            await ws.close()
    finally:
        if not keep_image:
            await asyncio.to_thread(_remove_image, image)
    ok = nop.reward == 0.0 and oracle.reward == 1.0
    why = "" if ok else f"nop: {nop.status} ({nop.reason}); oracle: {oracle.status} ({oracle.reason})"
    return {"ok": ok, "nop": nop.reward, "oracle": oracle.reward, "why": why,
            "reward_s": (nop.timings["total"] + oracle.timings["total"]) / 2}


def _remove_image(tag: str) -> None:
    from slime_env.tools_sandbox.workspace.docker import docker_client

    try:
        docker_client().images.remove(tag, force=True, noprune=False)
    except Exception:  # noqa: BLE001 - gone already
        pass
