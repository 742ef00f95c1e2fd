"""`check_tasks`: does every task score 1 with its own solution, and not 1 without one?

For each task: its image is built (or reused), then two fresh workspaces run — `nop` (no agent at all) and
`oracle` (solution/solve.sh as the agent) — and each is verified, by default in a fresh container (`verify`'s
default: the task's own separate verifier, else isolated). A task passes when the oracle scores 1 (every reward it
reports is 1) and nop does not. Tasks run `concurrency` at a time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from slime_env.envs.harbor.environment import OpenWorkspace, open_task_workspace, task_image
from slime_env.envs.harbor.task import HarborTask
from slime_env.envs.harbor.verifier import VerifierResult, run_oracle, verify
from slime_env.errors import InvalidInput
from slime_env.tools_sandbox.workspace import WorkspaceError


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One task's check: the verifier's result with the oracle and without any agent (`nop`), or the `error`
    that stopped it (a build that failed, a broken task)."""

    task: str
    oracle: VerifierResult | None = None
    nop: VerifierResult | None = None
    error: str = ""
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.error and scores_one(self.oracle) and (self.nop is None or not scores_one(self.nop))

    def problem(self) -> str:
        """Why the task fails its check ("" when it passes)."""
        if self.error:
            return self.error
        if not scores_one(self.oracle):
            return f"the oracle does not score 1: {_describe(self.oracle)}"
        if self.nop is not None and scores_one(self.nop):
            return "the task scores 1 without a solution (nop)"
        return ""


def scores_one(result: VerifierResult | None) -> bool:
    return bool(result is not None and result.rewards and all(float(v) == 1.0 for v in result.rewards.values()))


def _describe(result: VerifierResult | None) -> str:
    if result is None:
        return "not run"
    text = f"{result.status}, rewards {result.rewards}" + (f" ({result.reason})" if result.reason else "")
    tail = result.stdout_tail.strip().splitlines()[-8:]
    return text + ("\n    " + "\n    ".join(tail) if tail else "")


async def check_task(task: HarborTask, *, mode: str | None = None, nop: bool = True,
                     open_workspace: OpenWorkspace | None = None, log: Callable[[str], None] | None = None
                     ) -> CheckResult:
    t0 = time.monotonic()
    try:
        image = await task_image(task, log=None)
        results = {}
        for agent in (("nop", "oracle") if nop else ("oracle",)):
            ws = await open_task_workspace(task, image=image, open_workspace=open_workspace)
            try:
                if agent == "oracle":
                    await run_oracle(task, ws)
                results[agent] = await verify(task, ws, mode=mode, image=image, open_workspace=open_workspace)
            finally:
                await ws.close()
        return CheckResult(task.name, results["oracle"], results.get("nop"), duration_s=time.monotonic() - t0)
    except (InvalidInput, WorkspaceError, OSError) as e:
        return CheckResult(task.name, error=f"{type(e).__name__}: {e}", duration_s=time.monotonic() - t0)


async def check_tasks(tasks: Sequence[HarborTask], *, concurrency: int = 2, mode: str | None = None, nop: bool = True,
                      open_workspace: OpenWorkspace | None = None,
                      on_result: Callable[[CheckResult], None] | None = None) -> list[CheckResult]:
    """`check_task` over `tasks`, `concurrency` at a time; results in the tasks' order."""
    if concurrency < 1:
        raise InvalidInput(f"check: concurrency must be at least 1, got {concurrency}")
    gate = asyncio.Semaphore(concurrency)

    async def one(task: HarborTask) -> CheckResult:
        async with gate:
            result = await check_task(task, mode=mode, nop=nop, open_workspace=open_workspace)
        if on_result is not None:
            on_result(result)
        return result

    return list(await asyncio.gather(*(one(t) for t in tasks)))
