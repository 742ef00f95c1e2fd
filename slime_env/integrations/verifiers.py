"""verifiers environments as slime_env envs (extra `[verifiers]`): `VerifiersEnv("reverse_text")`.

verifiers (PrimeIntellect; `import verifiers.v1 as vf`, the 0.4 series) splits an environment into a **taskset** (a
module exporting a `vf.Taskset`: its tasks, each a `vf.Task` with `@vf.reward(weight=)` / `@vf.metric` / `@vf.stop`
methods and `vf.Toolset`s of `@vf.tool` methods), a **harness** (the program that calls the model) and, for
multi-turn games, an `vf.Env` whose `run(task, agents)` drives the agent turn by turn (`interaction.turn(message)`).
`VerifiersEnv` runs one here, with our runner as the harness — the policy's tokens are the ledger's:
- **Tasks.** `verifiers_tasks(env, limit)` lists the taskset's tasks as ours (prompt: the task's system prompt and
  prompt; `metadata["verifiers"]`: its index and key); a reset picks the verifiers task by that index.
- **Rewards.** At the end the task's own `score(trace)` runs over a `vf.Trace` of the conversation: every
  `@vf.reward` with its weight, every `@vf.metric`, judges that need no runtime; rewards the env's
  `run()` recorded count too. The episode's reward is the trace's weighted sum (`vf.Trace.reward`); `info["verifiers"]`
  holds each reward with its weight, the metrics and the stop condition.
- **Stops.** `@vf.stop(trace)` hooks run before each policy turn, as verifiers runs them before each model call; one
  that fires ends the episode (`terminated`). `max_turns` truncates, and the truncated trace is scored too (verifiers
  scores a trace its turn limit stopped).
- **Tools.** The task's and taskset's `vf.Toolset`s are our tools: `@vf.tool` methods run in process (schemas from
  their signatures, names prefixed as verifiers names them: `facts_lookup`), a toolset with a `url` through our MCP
  client. They run as `ToolEnv` tools (validation, timeouts, errors as observations).
- **Multi-turn envs.** An env module's `vf.Env` with its own `run()` runs as a program beside the episode: each
  `interaction.turn(message)` is one observation to the policy and returns its reply as the `Segment`.
- **Parser.** Tool calls are read from the policy's text by our parser of its family (`parser=`, hermes by default);
  the verifiers trace carries them as OpenAI tool calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from slime_env.errors import InvalidInput
from slime_env.integrations.versions import require
from slime_env.tool_env import ToolEnv
from slime_env.tools import Tool, tool
from slime_env.types import Action, Message, Task

SUPPORTED = ">=0.4,<0.5"


def require_verifiers() -> str:
    """The installed `verifiers` version; `IntegrationVersionError` naming it and the supported range otherwise."""
    return require("verifiers", SUPPORTED, extra="verifiers", what="slime_env.integrations.verifiers")


def load_verifiers_env(taskset: Any, **config: Any) -> Any:
    """A `vf.Env` for `taskset`: a taskset id (an installed module exporting a `vf.Taskset`, e.g. "reverse_text", or
    one shipped with verifiers, e.g. "openenv") with its config fields as keywords (`env_id=` picks a `vf.Env` by
    id), or a `vf.Env` as it is."""
    require_verifiers()
    import verifiers.v1 as vf

    if isinstance(taskset, vf.Env):
        return taskset
    if not isinstance(taskset, str):
        raise InvalidInput(f"VerifiersEnv: taskset must be a taskset id or a vf.Env, got {type(taskset).__name__}")
    key = (taskset, json.dumps(config, sort_keys=True, default=repr))
    if key not in _LOADED:  # one load per taskset and config: episodes' envs share it (a taskset may load a dataset)
        env_id = config.pop("env_id", "")
        _LOADED[key] = vf.load_environment(vf.resolve_env_config({"id": env_id, "taskset": {"id": taskset, **config}}))
    return _LOADED[key]


_LOADED: dict[tuple[str, str], Any] = {}


def verifiers_tasks(env: Any, limit: int | None = None) -> list[Task]:
    """The tasks of a verifiers env (or taskset id) as ours: at most `limit` (required for infinite tasksets)."""
    vf_env = env.vf_env if isinstance(env, VerifiersEnv) else load_verifiers_env(env)
    taskset = vf_env.taskset
    if limit is None and not taskset.bounded:
        raise InvalidInput(f"{type(taskset).__name__} is infinite: pass limit=")
    view = taskset if limit is None else taskset.take(limit)
    return [_our_task(t) for t in view]


class VerifiersEnv(ToolEnv):
    """A verifiers environment as a slime_env env (see the module docstring).

    `taskset`: a taskset id or a `vf.Env`; `config`: the taskset's config fields (and `env_id=`). `parser`: the
    tool-call parser of the policy's family; `max_turns`, `tool_timeout_s` as in `ToolEnv`; `default_limit`: how
    many of the taskset's tasks a reset without a task draws from.
    """

    def __init__(self, taskset: Any, *, parser: str | None = "hermes", max_turns: int | None = None,
                 tool_timeout_s: float = 30.0, default_limit: int = 64, **config: Any):
        super().__init__((), system_prompt=None, parser=parser, max_turns=max_turns, tool_timeout_s=tool_timeout_s)
        self.vf_env = load_verifiers_env(taskset, **config)
        from verifiers.v1 import SingleAgentEnv

        self.program = type(self.vf_env) is not SingleAgentEnv  # the env drives the turns with its own run()
        self.default_limit = default_limit
        self._cache: dict[int, Any] = {}
        self._iter: Any = None
        self.vf_task: Any = None
        self.trace: Any = None
        self._episode: _Program | None = None
        self._stops: list[Any] = []

    def default_tasks(self) -> Sequence[Task]:
        return verifiers_tasks(self, self.default_limit)

    # --- episode ----------------------------------------------------------------------------------
    async def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None):
        await self._end_program()
        task = self.task_from(options, seed)
        about = task.metadata.get("verifiers") if isinstance(task.metadata, Mapping) else None
        if not isinstance(about, Mapping) or "idx" not in about:
            raise InvalidInput("VerifiersEnv.reset needs a task from verifiers_tasks(...) (metadata['verifiers'])")
        self.vf_task = self._task_at(int(about["idx"]))
        if about.get("key") not in (None, self.vf_task.key):
            raise InvalidInput(f"task {task.id!r}: the taskset's task at index {about['idx']} is not the one this task "
                               "was listed from (its key differs): list the tasks again with verifiers_tasks(...)")
        self.trace = _new_trace(self.vf_task)
        messages, info = await super().reset(seed=seed, options=options)
        self._set_tools(await self._episode_tools())
        from verifiers.v1.session import hook_boundary
        from verifiers.v1.trace import Trace

        self._stops = [fn for fn in self.vf_task.hooks("stop") if hook_boundary(fn, allow_trace=True) is Trace]
        if self.program:
            self._episode = _Program(self)
            opening = await self._episode.start()
            # a prompt-less task is opened by the program's first turn(message); a prompted one speaks first
            messages = [m for m in messages if m.role != "user" or m.content] + (opening or [])
            self.history = list(messages)
        for m in messages:
            _append(self.trace, m, sampled=False)
        return messages, info

    async def step(self, action: Action):
        if self.vf_task is None:
            raise RuntimeError("VerifiersEnv.step called before reset")
        _append(self.trace, Message("assistant", action.text), sampled=True, action=action)
        if self.program and not (action.tool_calls or action.parse_errors):
            # the segment's final reply goes to the program's `turn()`; its next turn is the observation
            self.turn += 1
            self.history.append(Message("assistant", action.text))
            obs = await self._episode.reply(action)
            if obs is None:
                return await self._score(action)
            self.history.extend(obs)
            self._observed(obs)
            if self.is_truncated():
                return await self._truncate(obs, 0.0, action)
            return obs, 0.0, False, False, self.step_info()
        obs, reward, terminated, truncated, info = await super().step(action)
        if terminated:
            return obs, reward, terminated, truncated, info
        self._observed(obs)
        if not self.program and await self.stop_fired():  # a program's turn() runs the stops itself
            _, score, _, _, info = await self._score(action)
            return obs, reward + score, True, False, info
        if truncated:
            return await self._truncate(obs, reward, action)
        return obs, reward, False, False, info

    async def _truncate(self, obs: list[Message], reward: float, action: Action):
        """`max_turns` reached: verifiers scores a trace its turn limit stopped, and so does this (a program's
        pending `turn()` returns terminated first, so its `run()` records what it records at the end)."""
        self.trace.stop("max_turns")
        _, score, _, _, info = await self._score(action)
        return obs, reward + score, False, True, info

    def _observed(self, obs: list[Message]) -> list[Message]:
        for m in obs:
            _append(self.trace, m, sampled=False)
        return obs

    async def close(self) -> None:
        await self._end_program()
        await super().close()

    # --- ToolEnv hooks ----------------------------------------------------------------------------
    async def finish(self, action: Action):
        return await self._score(action)

    async def _score(self, action: Action):
        """The task's rewards and metrics over the trace; a program's `run()` recorded its own already."""
        if self._episode is not None:
            await self._episode.finish()
        await self.vf_task.score(self.trace)
        info = self.step_info()
        info["verifiers"] = {"rewards": {k: None if r is None else {"score": r.score, "weight": r.weight}
                                         for k, r in self.trace.rewards.items()},
                             "metrics": dict(self.trace.metrics), "stop_condition": self.trace.stop_condition}
        return [], float(self.trace.reward), True, False, info

    async def stop_fired(self) -> str | None:
        """Run the `@vf.stop` hooks as verifiers does before a model call; the name of the one that fired."""
        from verifiers.v1.session import call_hook
        from verifiers.v1.trace import Trace

        if self.trace.stop_condition is not None:
            return self.trace.stop_condition
        for fn in self._stops:
            if await call_hook(fn, {Trace: self.trace}):
                self.trace.stop(fn.__name__)
                return fn.__name__
        return None

    # --- tasks and tools --------------------------------------------------------------------------
    def _task_at(self, idx: int) -> Any:
        if idx in self._cache:
            return self._cache[idx]
        if self._iter is None or (self._cache and idx < max(self._cache)):
            self._iter, self._cache = iter(self.vf_env.taskset), {}
        for t in self._iter:
            self._cache[t.data.idx] = t
            if t.data.idx == idx:
                return t
        raise InvalidInput(f"{type(self.vf_env.taskset).__name__} has no task at index {idx}")

    async def _episode_tools(self) -> list[Tool]:
        toolsets = [*type(self.vf_task).toolsets(self.vf_task.config),
                    *type(self.vf_env.taskset).toolsets(self.vf_env.taskset.config)]
        tools: list[Tool] = []
        for ts in toolsets:
            url = getattr(ts.config, "url", None)
            prefix = f"{ts.server_name}_" if ts.server_name else ""
            if url:
                from slime_env.integrations.mcp import MCPServer

                server = MCPServer(url=url, prefix=prefix, per_episode=True)
                listed, release = await server.episode_tools()
                self._releases.append(release)
                tools += listed
                continue
            from verifiers.v1.state import State
            from verifiers.v1.utils.decorators import discover_decorated

            if ts._state_cls is not State:
                raise InvalidInput(f"VerifiersEnv: toolset {type(ts).__name__} keeps a {ts._state_cls.__name__} state "
                                   "(synced through verifiers' state channel), which in-process tools do not have; "
                                   "serve it and give its config a url")
            await ts.setup()
            await ts.setup_task(self.vf_task)
            for fn in discover_decorated(ts, "tool"):
                name = getattr(fn, "tool_name", None) or fn.__name__
                tools.append(tool(ts._with_state(fn), name=prefix + name,
                                  description=(fn.__doc__ or "").strip()))
        return tools

    async def _end_program(self) -> None:
        episode, self._episode = self._episode, None
        if episode is not None:
            await episode.cancel()


class _Program:
    """A `vf.Env.run(task, agents)` running beside the episode: its `interaction.turn(message)` calls are the
    episode's observations, the policy's replies their `Segment`s (inverted control through two queues)."""

    def __init__(self, env: VerifiersEnv):
        self.env = env
        self.asks: asyncio.Queue = asyncio.Queue()  # ("ask", [Message]) | ("done", None) | ("error", exc)
        self.replies: asyncio.Queue = asyncio.Queue()
        self.task: asyncio.Task | None = None
        self.seat: str | None = None
        self.over = False

    async def start(self) -> list[Message] | None:
        """Start `run()`; the messages of its first turn (None: it asked with none, the task's prompt opens)."""
        self.task = asyncio.create_task(self._run())
        kind, value = await self.asks.get()
        if kind == "error":
            raise value
        if kind == "done":
            raise InvalidInput(f"{type(self.env.vf_env).__name__}.run() ended before its first turn")
        return value or None

    async def reply(self, action: Action) -> list[Message] | None:
        """Hand `run()` the policy's reply; the next turn's messages, or None when the exchange ended."""
        await self.replies.put(action)
        kind, value = await self.asks.get()
        if kind == "error":
            raise value
        return None if kind == "done" else value

    async def finish(self) -> None:
        if self.task is not None and not self.task.done():
            self.over = True
            await self.replies.put(None)
            await self.task

    async def cancel(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            with contextlib.suppress(BaseException):
                await self.task

    async def _run(self) -> None:
        vf_env, vf_task, trace = self.env.vf_env, self.env.vf_task, self.env.trace
        try:
            await vf_env.run(vf_task, _Agents(self))
            from verifiers.v1.episode import EnvInfo, Episode
            from verifiers.v1.trace import TraceTask

            episode = Episode(env=EnvInfo(id=vf_env.config.env_id), traces=[trace],
                              task=TraceTask(type=type(vf_task).__name__, data=vf_task.data, key=vf_task.key,
                                             hash=vf_task.hash))
            await vf_env.finalize(vf_task, episode)
        except Exception as e:  # noqa: BLE001 - the program's failure is the episode's
            await self.asks.put(("error", e))
            return
        await self.asks.put(("done", None))

    # what `run()` sees
    async def turn(self, message: Any = None) -> Any:
        from verifiers.v1.agent import Segment
        from verifiers.v1.types import AssistantMessage

        new = _from_vf_messages([] if message is None else [{"role": "user", "content": message}]
                                if isinstance(message, str) else message)
        if self.over or await self.env.stop_fired():
            return Segment(messages=[], terminated=True)
        await self.asks.put(("ask", new))
        action = await self.replies.get()
        if action is None:
            return Segment(messages=[], terminated=True)
        return Segment(messages=[AssistantMessage(content=action.text)])


class _Interaction:
    def __init__(self, program: _Program):
        self.program = program

    @property
    def trace(self) -> Any:
        return self.program.env.trace

    async def turn(self, message: Any = None) -> Any:
        return await self.program.turn(message)

    async def steer(self, *args: Any, **kwargs: Any) -> dict:
        raise NotImplementedError("VerifiersEnv: steering a running turn has no equivalent in a stepped episode")


class _Seat:
    def __init__(self, program: _Program):
        self.program = program
        self.trainable = True

    @contextlib.asynccontextmanager
    async def interaction(self, task: Any):
        yield _Interaction(self.program)

    async def run(self, task: Any, **kwargs: Any) -> Any:
        """A whole single-segment run: the policy answers (tools run by the episode in between)."""
        async with self.interaction(task) as it:
            await it.turn()
        return self.program.env.trace


class _Agents:
    """The `agents` a `vf.Env.run()` gets: one seat (the policy's ledger is one agent's)."""

    def __init__(self, program: _Program):
        self._program = program

    def __getattr__(self, name: str) -> _Seat:
        if name.startswith("_"):
            raise AttributeError(name)
        if self._program.seat not in (None, name):
            raise InvalidInput(f"VerifiersEnv runs one agent per episode; {type(self._program.env.vf_env).__name__}."
                               f"run() uses seats {self._program.seat!r} and {name!r}")
        self._program.seat = name
        return _Seat(self._program)


# --- conversions ----------------------------------------------------------------------------------
def _our_task(vf_task: Any) -> Task:
    data = vf_task.data
    prompt: list[Message] = []
    if data.system_prompt:
        prompt.append(Message("system", data.system_prompt))
    if isinstance(data.prompt, str):
        prompt.append(Message("user", data.prompt))
    elif data.prompt:
        prompt += _from_vf_messages(data.prompt)
    extra = data.model_dump(mode="json", exclude_none=True)
    return Task(prompt=tuple(prompt) or "", label=extra.get("answer"), id=data.id or f"{data.idx}",
                metadata={"verifiers": {"idx": data.idx, "key": vf_task.key, "name": data.name}})


def _from_vf_messages(messages: Sequence[Any]) -> list[Message]:
    from verifiers.v1.types import content_text

    out = []
    for m in messages:
        if isinstance(m, Mapping):
            out.append(Message.coerce(m))
            continue
        text = content_text(m.content) if m.content is not None else ""
        out.append(Message(m.role, text, name=getattr(m, "name", None), tool_call_id=getattr(m, "tool_call_id", None)))
    return out


def _vf_message(m: Message, action: Action | None = None) -> Any:
    from verifiers.v1 import types as vt

    if m.role == "assistant":
        calls = [vt.ToolCall(id=c.id or f"call_{action.turn}_{i}", name=c.name,
                             arguments=json.dumps(c.arguments, ensure_ascii=False))
                 for i, c in enumerate(action.tool_calls)] if action is not None and action.tool_calls else None
        return vt.AssistantMessage(content=m.content, tool_calls=calls)
    if m.role == "tool":
        return vt.ToolMessage(tool_call_id=m.tool_call_id or "", content=m.content, name=m.name)
    if m.role == "system":
        return vt.SystemMessage(content=m.content)
    return vt.UserMessage(content=m.content)


def _new_trace(vf_task: Any) -> Any:
    from verifiers.v1 import AgentConfig
    from verifiers.v1.state import state_cls
    from verifiers.v1.trace import AgentInfo, Trace, TraceTask

    return Trace(task=TraceTask(type=type(vf_task).__name__, data=vf_task.data, key=vf_task.key, hash=vf_task.hash),
                 agent=AgentInfo(config=AgentConfig()), state=state_cls(type(vf_task))())


def _append(trace: Any, m: Message, *, sampled: bool, action: Action | None = None) -> None:
    from verifiers.v1.graph import MessageNode

    parent = len(trace.nodes) - 1 if trace.nodes else None
    trace.nodes.append(MessageNode(parent=parent, message=_vf_message(m, action), sampled=sampled))


__all__ = ["SUPPORTED", "VerifiersEnv", "load_verifiers_env", "require_verifiers", "verifiers_tasks"]
