"""Any slime_env env as a verifiers environment (extra `[verifiers]`): `write_verifiers_package("Calculator-v0", dir)`.

verifiers finds an environment by its taskset id: an installed module whose `__all__` exports a `vf.Taskset` (and,
optionally, a `vf.Env` and a `vf.Harness`). `write_verifiers_package` writes such a package for one of our env ids
(`slime-env export-verifiers ENV_ID --out DIR`); `pip install DIR/<name>` (or putting `DIR` on the path) makes
`vf-eval <name>`, prime-rl and verifiers' `run_eval` run it. The package holds no logic of its own — it binds the env
id to the classes here:
- `SlimeTaskset`: the env's tasks (a JSONL/Parquet `tasks` file, else the env's own `default_tasks()`, else
  `num_tasks` seeded draws of its `sample_task`), at most `num_tasks` of them; each `SlimeTask` carries our task as
  data.
- `SlimeVerifiersEnv`: the episode. Its `run()` resets our env, opens the agent's interaction with the reset's messages
  (and the env's tool schemas), and steps our env on each reply (`interaction.turn(observation)`) until it terminates
  or truncates; the summed reward is recorded on the trace as `slime_env` (weight 1), the env's last info in
  `trace.info["slime_env"]`.
- `SlimeHarness`: the model-calling program, in process (verifiers' harness contract allows that: every call goes
  through its interception endpoint): one chat completion per segment, with the env's tools. Our envs decide what
  happens between turns, so one segment is one model call.
Model calls go where verifiers sends them (its client config: `base_url`), e.g. our gateway, which records them as
exact ledgers.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slime_env.integrations.verifiers import require_verifiers

require_verifiers()

import verifiers.v1 as vf  # noqa: E402
from pydantic import Field  # noqa: E402

from slime_env.errors import InvalidInput  # noqa: E402
from slime_env.types import Action, Message, Task, ToolCall  # noqa: E402


class SlimeTasksetConfig(vf.TasksetConfig):
    env_id: str = ""
    """The slime_env env id (registered, or `pkg.mod:factory`)."""
    env_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for `slime_env.make(env_id, ...)`."""
    tasks: str | None = None
    """A JSONL / Parquet file of tasks (`slime_env.load_tasks`); None: the env's own `default_tasks()`."""
    num_tasks: int | None = Field(None, ge=1)
    """At most this many tasks (None: all; an env that draws its tasks gives 16 by default)."""
    seed: int = 0
    """Seed of the draws (task i is `sample_task(Random(seed + i))`)."""


class SlimeTaskData(vf.TaskData):
    slime_task: dict[str, Any]
    """Our task (`Task.to_dict()`): prompt, label, metadata, id."""
    tools: list[dict[str, Any]] | None = None
    """The env's tool schemas for this episode (set by the env at its reset; the harness sends them)."""


class SlimeTask(vf.Task[SlimeTaskData]):
    """One of our tasks; its reward comes from the env's steps (recorded by `SlimeVerifiersEnv.run`)."""


class SlimeTaskset(vf.Taskset[SlimeTask, SlimeTasksetConfig]):
    """The tasks of `config.env_id` (see the module docstring)."""

    def load(self) -> list[SlimeTask]:
        if not self.config.env_id:
            raise InvalidInput("SlimeTaskset needs env_id (the slime_env env to run)")
        if self.config.tasks:
            from slime_env.rollout import load_tasks

            tasks = load_tasks(self.config.tasks)
        else:
            import random

            from slime_env import make

            env = make(self.config.env_id, **self.config.env_kwargs)
            tasks = list(env.default_tasks() or ())
            if not tasks:  # an env that draws its tasks (sample_task): num_tasks seeded draws
                n = self.config.num_tasks or 16
                draws = [env.sample_task(random.Random(self.config.seed + i)) for i in range(n)]
                tasks = [t for t in draws if t is not None]
            if not tasks:
                raise InvalidInput(f"{self.config.env_id} has no task source of its own: "
                                   "give SlimeTaskset a tasks file")
        tasks = tasks[: self.config.num_tasks] if self.config.num_tasks else tasks
        return [SlimeTask(SlimeTaskData(idx=i, id=t.id, name=t.id, slime_task=t.to_dict()), self.config.task)
                for i, t in enumerate(tasks)]


class SlimeEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(runtime=vf.SubprocessConfig())
    """The one seat: the policy playing our env. Its harness runs in process, so its runtime is the local one (the
    default, a remote sandbox, would need a tunnel for nothing)."""


class SlimeVerifiersEnv(vf.Env[SlimeEnvConfig]):
    """Runs one episode of our env through the agent's interaction (see the module docstring)."""

    async def run(self, task: SlimeTask, agents: Any) -> None:
        from slime_env import make

        config = self.taskset.config
        env = make(config.env_id, **config.env_kwargs)
        total, info, steps = 0.0, {}, 0
        try:
            messages, _ = await env.reset(options={"task": Task.coerce(task.data.slime_task, "slime_task")})
            system = "\n\n".join(m.content for m in messages if m.role == "system") or None
            opening = task.with_data(prompt=[_vf(m) for m in messages if m.role != "system"], system_prompt=system,
                                     tools=[dict(t) for t in env.tools] if env.tools else None)
            async with agents.agent.interaction(opening) as interaction:
                segment = await interaction.turn()
                while not segment.terminated:
                    obs, reward, terminated, truncated, info = await env.step(_action(segment, steps))
                    steps += 1
                    total += float(reward)
                    if terminated or truncated:
                        break
                    segment = await interaction.turn([_vf(m) for m in obs])
                trace = interaction.trace
        finally:
            await env.close()
        trace.record_reward("slime_env", total, 1.0)
        trace.info["slime_env"] = json.loads(json.dumps({"env_id": config.env_id, "steps": steps, "info": info},
                                                        default=repr))


class SlimeHarnessConfig(vf.HarnessConfig):
    max_tokens: int | None = None
    """`max_tokens` of each chat completion (None: the server's default)."""


class SlimeHarness(vf.Harness[SlimeHarnessConfig]):
    """One chat completion per segment, in process, through verifiers' interception endpoint."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: Any, trace: Any, runtime: Any, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: Any, **kwargs: Any) -> Any:
        from openai import AsyncOpenAI
        from verifiers.v1.dialects.chat import message_to_wire
        from verifiers.v1.runtimes import ProgramResult

        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [message_to_wire(m) for m in prompt or ()]
        request: dict[str, Any] = {"model": ctx.model, "messages": messages}
        tools = getattr(data, "tools", None)
        if tools:
            request["tools"] = tools
        if self.config.max_tokens:
            request["max_tokens"] = self.config.max_tokens
        import httpx

        # one TLS context for every call (building one loads the CA bundle: ~40 ms); the client itself per call
        http = httpx.AsyncClient(verify=_tls_context(), timeout=httpx.Timeout(None, connect=30.0))
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0, http_client=http) as client:
            await client.chat.completions.create(**request)
        return ProgramResult(exit_code=0, stdout="", stderr="")


@functools.cache
def _tls_context() -> Any:
    import httpx

    return httpx.create_ssl_context()


def _vf(m: Message) -> Any:
    from verifiers.v1 import types as vt

    if m.role == "tool":
        return vt.ToolMessage(tool_call_id=m.tool_call_id or "", content=m.content, name=m.name)
    if m.role == "assistant":
        return vt.AssistantMessage(content=m.content)
    if m.role == "system":
        return vt.SystemMessage(content=m.content)
    return vt.UserMessage(content=m.content)


def _action(segment: Any, turn: int) -> Action:
    """The segment's last reply as our `Action`: its text, and its tool calls as the endpoint parsed them."""
    from verifiers.v1.types import AssistantMessage

    reply = next((m for m in reversed(segment.messages) if isinstance(m, AssistantMessage)), None)
    if reply is None:
        return Action(text="", turn=turn)
    calls = []
    for c in reply.tool_calls or ():
        try:
            arguments = json.loads(c.arguments) if c.arguments else {}
        except ValueError:
            arguments = {}
        calls.append(ToolCall(c.name, arguments if isinstance(arguments, dict) else {}, id=c.id))
    return Action(text=reply.content or "", tool_calls=tuple(calls), turn=turn)


def write_verifiers_package(env_id: str, directory: str | Path, *, name: str | None = None,
                            env_kwargs: Mapping[str, Any] | None = None) -> Path:
    """Write a verifiers environment package for `env_id` into `directory/<name>` (name: the id in snake case, e.g.
    `calculator_v0`), with a `pyproject.toml` beside it; returns the package folder. Its taskset id is `name`."""
    from slime_env.registry import spec

    spec(env_id)  # an unknown id fails here, with the registry's message
    name = name or re.sub(r"[^0-9a-zA-Z]+", "_", env_id.split(":")[-1]).strip("_").lower()
    if not name.isidentifier():
        raise InvalidInput(f"verifiers package name {name!r} is not a Python identifier; pass name=")
    title = "".join(part.title() for part in name.split("_"))
    root = Path(directory)
    package = root / name
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(f'''"""{env_id} (slime_env) as a verifiers environment: `vf-eval {name}`.

Written by slime_env.integrations.verifiers_export.write_verifiers_package; the classes live there.
"""

import verifiers.v1 as vf

from slime_env.integrations.verifiers_export import (
    SlimeEnvConfig,
    SlimeHarness,
    SlimeTask,
    SlimeTaskset,
    SlimeTasksetConfig,
    SlimeVerifiersEnv,
)


class {title}Config(SlimeTasksetConfig):
    env_id: str = {env_id!r}
    env_kwargs: dict = {dict(env_kwargs or {})!r}


class {title}Taskset(SlimeTaskset, vf.Taskset[SlimeTask, {title}Config]):
    pass


class {title}Env(SlimeVerifiersEnv, vf.Env[SlimeEnvConfig]):
    pass


class {title}Harness(SlimeHarness):
    pass


__all__ = ["{title}Env", "{title}Harness", "{title}Taskset"]
''')
    (root / "pyproject.toml").write_text(f'''[project]
name = "{name.replace("_", "-")}"
version = "0.1.0"
description = "{env_id} (slime_env) as a verifiers environment"
requires-python = ">=3.11"
dependencies = ["slime_env[verifiers]"]

[build-system]
requires = ["setuptools>=69"]
build-backend = "setuptools.build_meta"

[tool.setuptools]
packages = ["{name}"]
''')
    return package


__all__ = ["SlimeEnvConfig", "SlimeHarness", "SlimeHarnessConfig", "SlimeTask", "SlimeTaskData", "SlimeTaskset",
           "SlimeTasksetConfig", "SlimeVerifiersEnv", "write_verifiers_package"]
