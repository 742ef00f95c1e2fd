"""`Env`: the async, Gymnasium-shaped environment every slime_env task implements."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from slime_env.errors import InvalidInput
from slime_env.task_files import coerce_tasks
from slime_env.types import Action, Message, Task

Observation = list[Message]
StepResult = tuple[Observation, float, bool, bool, dict[str, Any]]


class Env:
    """An async environment for one episode of one LLM agent.

    `reset(seed=, options={"task": task})` starts an episode and returns the conversation the policy
    starts from (usually the system/user prompt built from the task) and an info dict.
    `step(action)` receives the assistant turn as generated (`Action`: text, token ids, parsed tool
    calls, parse errors) and returns `(observation, reward, terminated, truncated, info)`:
    `observation` is the list of messages to append (role tool/user/system; a single assistant
    message is spliced into the ongoing assistant turn); `terminated` means the task reached an end
    state (solved, failed, answered), `truncated` that it was cut short by a limit outside the MDP
    (a step budget of the env's own). The framework tokenizes; envs never do.
    `close()` releases resources; it may be called more than once.

    Class attributes: `parser` names the tool-call parser for this env's actions (see
    `slime_env.parsers`), `tools` are JSON tool schemas handed to the chat template, `stop` are
    strings that end a generation early (e.g. `</search>`: the env acts on the action as soon as it
    is complete); the runner adds them to the sampling params' `stop`. `sampling_params`, read once
    `reset` returns (set it there, from the task), overrides the run's sampling params for this episode;
    its `max_new_tokens` lowers the per-turn generation budget (e.g. a length plan:
    `{"max_new_tokens": n, "ignore_eos": True}`).
    """

    parser: ClassVar[str | None] = None
    tools: Sequence[Mapping[str, Any]] | None = None
    stop: Sequence[str] = ()
    sampling_params: Mapping[str, Any] | None = None

    async def reset(self, *, seed: int | None = None,
                    options: Mapping[str, Any] | None = None) -> tuple[Observation, dict[str, Any]]:
        raise NotImplementedError

    async def step(self, action: Action) -> StepResult:
        raise NotImplementedError

    async def close(self) -> None:
        return None

    def sample_task(self, rng: random.Random) -> Task | None:
        """A task drawn from `rng` when reset gets none (Gymnasium tooling, demos): from the tasks given to
        `set_tasks`, else from `default_tasks()`. None: tasks are required."""
        pool = getattr(self, "_task_pool", None) or self.default_tasks()
        return rng.choice(pool) if pool else None

    def default_tasks(self) -> Sequence[Task] | None:
        """An offline task source for resets without a task (override; None: there is none)."""
        return None

    def set_tasks(self, tasks: str | Path | Sequence[Any] | None) -> None:
        """Tasks for resets without one: a JSONL / Parquet path (`load_tasks`) or a list of tasks / dicts."""
        if tasks is None:
            self._task_pool = None
            return
        self._task_pool = coerce_tasks(tasks, f"{type(self).__name__}(tasks=...)")

    def task_from(self, options: Mapping[str, Any] | None, seed: int | None = None) -> Task:
        """The task of `reset(options=...)`, or one from `sample_task` seeded by `seed`; a clear error otherwise."""
        if options and options.get("task") is not None:
            return Task.coerce(options["task"], "options['task']")
        task = self.sample_task(random.Random(seed))
        if task is None:
            raise InvalidInput(f"{type(self).__name__}.reset needs options={{'task': ...}}")
        return task

    async def __aenter__(self) -> Env:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def unwrapped(self) -> Env:
        return self


class Wrapper(Env):
    """Wraps an env to change one aspect of it; everything not overridden is delegated."""

    def __init__(self, env: Env):
        self.env = env

    @property
    def parser(self) -> str | None:  # type: ignore[override]
        return self.env.parser

    @property
    def tools(self) -> Sequence[Mapping[str, Any]] | None:  # type: ignore[override]
        return self.env.tools

    @property
    def stop(self) -> Sequence[str]:  # type: ignore[override]
        return self.env.stop

    @property
    def sampling_params(self) -> Mapping[str, Any] | None:  # type: ignore[override]
        own = self.__dict__.get("_sampling_params")  # a wrapper may plan its episodes itself (set in its reset)
        return own if own is not None else self.env.sampling_params

    @sampling_params.setter
    def sampling_params(self, value: Mapping[str, Any] | None) -> None:
        self.__dict__["_sampling_params"] = value

    async def reset(self, *, seed=None, options=None):
        return await self.env.reset(seed=seed, options=options)

    async def step(self, action: Action) -> StepResult:
        return await self.env.step(action)

    async def close(self) -> None:
        await self.env.close()

    def sample_task(self, rng: random.Random) -> Task | None:
        return self.env.sample_task(rng)

    @property
    def unwrapped(self) -> Env:
        return self.env.unwrapped

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name == "env":
            raise AttributeError(name)
        return getattr(self.env, name)
