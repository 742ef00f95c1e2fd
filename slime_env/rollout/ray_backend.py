"""Ray scale-out: env instances live in a pool of Ray actors; generation stays in the caller's loop.

```python
import ray
ray.init()                      # local; on a cluster: ray.init(address="auto") on a node of it
pool = RayEnvPool("Calculator-v0", num_actors=8, actor_options={"num_cpus": 1})
manager = RolloutManager(tasks, env_id="Calculator-v0", env_factory=pool.factory, ...)
```

Each actor is an async Ray actor holding many env sessions (up to `max_sessions_per_actor`), spread
over the cluster (`scheduling_strategy="SPREAD"` unless `actor_options` says otherwise). `RayEnv` is
the `Env` proxy; its calls are awaited Ray object refs, so thousands of episodes share one event
loop in the driver. Needs the `[ray]` extra.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Mapping
from typing import Any

from slime_env.env import Env
from slime_env.errors import InvalidInput
from slime_env.registry import spec
from slime_env.rollout.wire import (
    action_to_dict,
    env_created,
    reset_answer,
    run_reset,
    run_step,
    step_answer,
    task_payload,
)
from slime_env.types import Action, Task


def _ray():
    try:
        import ray
    except ImportError:
        raise InvalidInput("the Ray backend needs Ray: pip install 'slime_env[ray]'") from None
    return ray


class _EnvHost:
    """Actor body: env sessions of one env id (plain methods; wrapped by `ray.remote` at pool start)."""

    def __init__(self, env_spec: Any, env_kwargs: dict[str, Any]):
        import slime_env  # noqa: F401 - registers entry-point envs inside the worker process
        self.env_spec, self.env_kwargs = env_spec, env_kwargs
        self.envs: dict[str, Env] = {}
        self.created = 0

    async def create(self, env_kwargs: dict[str, Any]) -> dict[str, Any]:
        env = self.env_spec.make(**{**self.env_kwargs, **env_kwargs})
        sid = uuid.uuid4().hex
        self.envs[sid] = env
        self.created += 1
        return env_created(sid, env)

    async def reset(self, sid: str, seed: int | None, task: dict[str, Any] | None) -> dict[str, Any]:
        return await run_reset(self.envs[sid], seed, task)

    async def step(self, sid: str, action: dict[str, Any]) -> dict[str, Any]:
        return await run_step(self.envs[sid], action)

    async def close(self, sid: str) -> None:
        env = self.envs.pop(sid, None)
        if env is not None:
            await env.close()

    async def stats(self) -> dict[str, int]:
        return {"open": len(self.envs), "created": self.created}


class RayEnvPool:
    """`num_actors` Ray actors hosting env `env_id`; `factory(task, env_id)` hands out `RayEnv`s round-robin."""

    def __init__(self, env_id: str, *, env_kwargs: Mapping[str, Any] | None = None, num_actors: int = 2,
                 actor_options: Mapping[str, Any] | None = None, max_sessions_per_actor: int = 1000):
        ray = _ray()
        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False)
        options = {"num_cpus": 0, "scheduling_strategy": "SPREAD", **dict(actor_options or {})}
        actor_cls = ray.remote(max_concurrency=max_sessions_per_actor)(_EnvHost)
        self.env_id = env_id
        # The spec travels to the workers (Ray pickles a class defined in a script by value), so envs
        # registered in the driver work there without being installed as a package.
        env_spec = spec(env_id)
        self.actors = [actor_cls.options(**options).remote(env_spec, dict(env_kwargs or {}))
                       for _ in range(num_actors)]
        self._next = itertools.cycle(range(num_actors))

    def factory(self, task: Task | None = None, env_id: str | None = None) -> RayEnv:
        if env_id is not None and env_id != self.env_id:
            raise InvalidInput(f"this Ray pool hosts {self.env_id!r}, not {env_id!r}")
        return RayEnv(self.actors[next(self._next)])

    async def stats(self) -> list[dict[str, int]]:
        """Per actor: env sessions open now and created so far."""
        return [await a.stats.remote() for a in self.actors]

    def shutdown(self) -> None:
        ray = _ray()
        for actor in self.actors:
            ray.kill(actor)


class RayEnv(Env):
    """An `Env` whose instance lives in a Ray actor of a `RayEnvPool`."""

    def __init__(self, actor: Any, env_kwargs: Mapping[str, Any] | None = None):
        self.actor, self.env_kwargs = actor, dict(env_kwargs or {})
        self.session_id: str | None = None
        self.parser = None  # type: ignore[assignment]
        self.tools = None

    async def reset(self, *, seed=None, options=None):
        if self.session_id is None:
            created = await self.actor.create.remote(self.env_kwargs)
            self.session_id, self.parser, self.tools = created["session_id"], created["parser"], created["tools"]
            self.stop = tuple(created.get("stop") or ())
            self.describe_tools = bool(created.get("describe_tools", True))
        out = await self.actor.reset.remote(self.session_id, seed, task_payload(options))
        self.tools = out.get("tools", self.tools)
        return reset_answer(out, "ray")

    async def step(self, action: Action):
        return step_answer(await self.actor.step.remote(self.session_id, action_to_dict(action)), "ray")

    async def close(self) -> None:
        if self.session_id is not None:
            sid, self.session_id = self.session_id, None
            await self.actor.close.remote(sid)
