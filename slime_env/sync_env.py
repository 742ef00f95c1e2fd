"""`from_sync`: run a synchronous Gymnasium-style text env without blocking the event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from slime_env.env import Env, StepResult
from slime_env.errors import InvalidInput
from slime_env.types import Action, Message, Task, coerce_messages

_DEFAULT_WORKERS = 32
_shared: ThreadPoolExecutor | None = None
_shared_lock = threading.Lock()


def _shared_executor() -> ThreadPoolExecutor:
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = ThreadPoolExecutor(max_workers=_DEFAULT_WORKERS, thread_name_prefix="slime_env-sync")
        return _shared


class SyncEnv(Env):
    """Async view of a synchronous env whose `reset(seed=, options=)` returns (text or messages, info)
    and whose `step(text)` returns (text or messages, reward, terminated, truncated, info).

    Text observations become one message of `obs_role` ("user" by default). Every call runs in a
    bounded thread pool (shared, 32 threads, unless `executor` is given), so a slow sync env
    occupies a worker thread, never the event loop.
    """

    def __init__(self, env: Any, *, parser: str | None = None, obs_role: str = "user",
                 executor: ThreadPoolExecutor | None = None, pass_task: bool = True):
        for method in ("reset", "step"):
            if not callable(getattr(env, method, None)):
                raise InvalidInput(f"from_sync: {type(env).__name__} has no {method}() method")
        self.sync_env = env
        self.parser = parser  # type: ignore[misc]
        self.obs_role = obs_role
        self._executor = executor
        self._pass_task = pass_task

    async def _call(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor or _shared_executor(), lambda: fn(*args, **kwargs))

    def _messages(self, obs: Any, where: str) -> list[Message]:
        if isinstance(obs, str):
            return [Message(self.obs_role, obs)]
        if obs is None:
            return []
        return coerce_messages(obs, where)

    async def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None):
        opts: dict[str, Any] = dict(options or {})
        if "task" in opts and not self._pass_task:
            opts.pop("task")
        elif isinstance(opts.get("task"), Task):
            opts["task"] = opts["task"].to_dict()  # sync envs get plain data
        result = await self._call(self.sync_env.reset, seed=seed, options=opts)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise InvalidInput(f"{type(self.sync_env).__name__}.reset must return (observation, info)")
        obs, info = result
        return self._messages(obs, f"{type(self.sync_env).__name__}.reset"), dict(info or {})

    async def step(self, action: Action) -> StepResult:
        result = await self._call(self.sync_env.step, action.text)
        if not (isinstance(result, tuple) and len(result) == 5):
            raise InvalidInput(f"{type(self.sync_env).__name__}.step must return "
                               "(observation, reward, terminated, truncated, info)")
        obs, reward, terminated, truncated, info = result
        return (self._messages(obs, f"{type(self.sync_env).__name__}.step"), float(reward), bool(terminated),
                bool(truncated), dict(info or {}))

    async def close(self) -> None:
        close = getattr(self.sync_env, "close", None)
        if callable(close):
            await self._call(close)


def from_sync(env: Any, **kwargs: Any) -> SyncEnv:
    """Wrap a synchronous text env (see `SyncEnv`) so `run_episode` can drive it."""
    return SyncEnv(env, **kwargs)


__all__: Sequence[str] = ["SyncEnv", "from_sync"]
