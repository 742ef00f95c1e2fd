"""OpenEnv environments as slime_env envs (extra `[openenv]`): `OpenEnvEnv(url=...)` or `OpenEnvEnv(environment=Cls)`.

OpenEnv (`pip install openenv`, import `openenv`) serves Gym-style environments over HTTP/WebSocket (`reset`, `step`,
`state`, typed pydantic actions and observations) and adds MCP tool actions (`ListToolsAction`, `CallToolAction`).
`OpenEnvEnv` runs one, either **remote** — its async `EnvClient` (a `GenericEnvClient` on `url`, or a client you
built) holding one WebSocket session per env instance — or **in process** — an `Environment` class or factory, whose
`reset_async`/`step_async` run on this loop (a sync-only env in a thread).

Mapping (each piece replaceable):
- **Tasks → reset.** `reset(seed=, options={"task": task})` resets the OpenEnv env with `seed` plus the task's
  `metadata["openenv_reset"]` (OpenEnv's reset kwargs, e.g. `{"split": "test", "index": 12}`). The prompt is the
  system prompt, then the task's prompt and the first observation as one user message.
- **Text actions.** A turn without tool calls becomes the env's action: `action="message"` puts the assistant text in
  that field (found by itself when the action schema has exactly one required string field), or
  `action=fn(slime_action) -> dict | Action`.
- **MCP tools.** An env whose actions include OpenEnv's MCP actions lists its tools at reset (`ListToolsAction`):
  their JSON schemas are `env.tools` (handed to the chat template) and each parsed tool call is one
  `CallToolAction` step, its result a `tool` message with the call's id. A turn without a tool call ends such an
  episode (the final answer), as in `ToolEnv`.
- **Observations → messages.** `observation=fn(obs_dict) -> str | list[Message]`; by default the observation's one
  text field, else its fields as JSON (without `done`, `reward`, `metadata`).
- **Rewards.** Each OpenEnv step's `reward` (None is 0.0) is added to the turn's reward; `done` terminates;
  `max_turns` truncates. `info["openenv"]` carries the last step's metadata.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, get_type_hints

from slime_env.env import Env, StepResult
from slime_env.errors import InvalidInput
from slime_env.integrations.versions import require
from slime_env.types import Action, Message, Task

SUPPORTED = ">=0.10,<0.11"
_OWN_FIELDS = ("done", "reward", "metadata")


def require_openenv() -> str:
    """The installed `openenv` version; `IntegrationVersionError` naming it and the supported range otherwise."""
    return require("openenv", SUPPORTED, extra="openenv", what="slime_env.integrations.openenv")


class OpenEnvEnv(Env):
    """An OpenEnv environment as a slime_env `Env` (see the module docstring).

    Exactly one of `url` (a running server: `http://host:port`, or an HF Space URL), `client` (an OpenEnv `EnvClient`,
    connected or not; closed with this env) or `environment` (an OpenEnv `Environment` class or a factory returning
    one, run in process; `action_cls` when its `step` has no annotation). `action`: the action field that takes the
    assistant text, or a function of the `Action`; `observation`: a function of the observation dict; `tools`:
    "auto" (MCP tools when the env serves them), True, or False; `parser`: the tool-call parser of the policy's family.
    `send_task`: pass the task to the env's reset as `task=` (a dict: prompt, label, metadata, id), for envs that build
    their prompt from it (ours, served by `slime-env serve-openenv`); the prompt is then the env's observation alone.
    `threads`: an in-process env's sync `reset`/`step` run in a worker thread (the default: a blocking env never
    stalls the loop); False calls them inline, for envs whose steps take microseconds (saves the thread hop, ~80 µs).
    `system_prompt`, `max_turns`, `tasks` (for resets without a task) as in `ToolEnv`.
    """

    def __init__(self, url: str | None = None, *, client: Any = None, environment: Any = None,
                 action: str | Callable[[Action], Any] | None = None, action_cls: type | None = None,
                 observation: Callable[[Mapping[str, Any]], str | Sequence[Message]] | None = None,
                 tools: bool | str = "auto", parser: str | None = "hermes", system_prompt: str | None = None,
                 max_turns: int | None = None, message_timeout_s: float = 60.0, send_task: bool = False,
                 threads: bool = True, tasks: Any = None):
        if sum(x is not None for x in (url, client, environment)) != 1:
            raise InvalidInput("OpenEnvEnv needs exactly one of url=, client= or environment=")
        if tools not in ("auto", True, False):
            raise InvalidInput(f"OpenEnvEnv tools must be 'auto', True or False, got {tools!r}")
        require_openenv()
        self.url, self._client, self._factory = url, client, environment
        self._own_client = client is None and url is not None
        self._environment: Any = None
        self.action, self.action_cls, self.observation = action, action_cls, observation
        self.use_tools, self.parser, self.system_prompt = tools, parser, system_prompt
        self.max_turns, self.message_timeout_s, self.send_task = max_turns, message_timeout_s, send_task
        self.threads = threads
        self.set_tasks(tasks)
        self.tools = None
        self._schema: dict[str, Any] | None = None
        self._mcp: bool | None = None
        self.turn = 0
        self.task: Task | None = None

    # --- episode ----------------------------------------------------------------------------------
    async def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None):
        self.task = self.task_from(options, seed)
        self.turn = 0
        await self._connect()
        kwargs = dict(self.task.metadata.get("openenv_reset") or {})
        if seed is not None:
            kwargs.setdefault("seed", seed)
        if self.send_task:
            kwargs["task"] = self.task.to_dict()
        result = await self._reset(kwargs)
        if self._tool_mode():
            listed = await self._step_payload({"type": "list_tools"})
            self.tools = [{"type": "function", "function": {
                "name": t["name"], "description": t.get("description") or "",
                "parameters": t.get("input_schema") or t.get("inputSchema") or {"type": "object", "properties": {}}}}
                for t in listed["observation"].get("tools") or ()]
        elif isinstance(result["observation"].get("tools"), list):
            self.tools = result["observation"]["tools"] or None  # a chat env that names its tools (ours, served)
            self.describe_tools = bool(result["observation"].get("describe_tools", True))
        shown = self._observe(result["observation"])
        messages = self.task.messages(system=self.system_prompt) if self.task.prompt and not self.send_task else (
            [Message("system", self.system_prompt)] if self.system_prompt is not None else [])
        if shown and shown[0].role == "system" and messages and messages[0].role == "system" and self.task.prompt == "":
            messages = []  # the env brings its own system prompt
        if len(shown) == 1 and shown[0].role == "user" and messages and messages[-1].role == "user":
            messages[-1] = Message("user", f"{messages[-1].content}\n\n{shown[0].content}".strip())
        else:
            messages += shown
        if not messages:
            raise InvalidInput("OpenEnvEnv.reset: the task has no prompt and the observation no text")
        return messages, {"openenv": result.get("metadata") or {}}

    async def step(self, action: Action) -> StepResult:
        if self.task is None:
            raise RuntimeError("OpenEnvEnv.step called before reset")
        self.turn += 1
        if self._tool_mode() and (action.tool_calls or action.parse_errors):
            obs, reward, done, meta = await self._call_tools(action)
        elif self._tool_mode():
            return [], 0.0, True, False, {"openenv": {}}  # no tool call: the final answer
        else:
            result = await self._step_payload(self._text_action(action))
            obs, reward, done, meta = (self._observe(result["observation"]), _reward(result.get("reward")),
                                       bool(result.get("done")), result.get("metadata") or {})
        truncated = not done and self.max_turns is not None and self.turn >= self.max_turns
        return obs, reward, done, truncated, {"openenv": meta}

    def default_tasks(self) -> Sequence[Task]:
        """OpenEnv envs make their own prompt at reset: a reset without a task gets an empty one."""
        return [Task(prompt="")]

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()
        env, self._environment = self._environment, None
        if env is not None:
            await asyncio.to_thread(env.close)

    # --- mapping ----------------------------------------------------------------------------------
    def _observe(self, obs: Mapping[str, Any]) -> list[Message]:
        if self.observation is not None:
            out = self.observation(obs)
            return [Message("user", out)] if isinstance(out, str) else [Message.coerce(m) for m in out]
        messages = obs.get("messages")
        if isinstance(messages, list) and all(isinstance(m, Mapping) and "role" in m for m in messages):
            return [Message.coerce(m, "observation.messages") for m in messages]  # a chat env (ours, served)
        fields = {k: v for k, v in obs.items() if k not in _OWN_FIELDS}
        texts = [v for v in fields.values() if isinstance(v, str)]
        if len(texts) == 1 and all(isinstance(v, str) or v in (None, 0, [], {}) for v in fields.values()):
            return [Message("user", texts[0])]
        return [Message("user", json.dumps(fields, ensure_ascii=False, sort_keys=True, default=str))]

    def _text_action(self, action: Action) -> Any:
        if callable(self.action):
            return self.action(action)
        field = self.action or self._text_field()
        return {field: action.text}

    def _text_field(self) -> str:
        schema = self._schema or {}
        props = schema.get("properties") or {}
        required = [k for k in schema.get("required") or props if (props.get(k) or {}).get("type") == "string"]
        if len(required) != 1:
            raise InvalidInput(f"OpenEnvEnv: cannot tell which action field takes the assistant text (string fields: "
                               f"{required or 'none'}); pass action='field' or action=fn")
        return required[0]

    def _tool_mode(self) -> bool:
        if self.use_tools != "auto":
            return bool(self.use_tools)
        if self._mcp is None:  # the action schema names OpenEnv's MCP actions, or the env is an MCPEnvironment
            self._mcp = '"call_tool"' in json.dumps(self._schema or {}) or hasattr(self._environment, "mcp_session")
        return self._mcp

    async def _call_tools(self, action: Action) -> tuple[list[Message], float, bool, dict[str, Any]]:
        out, reward, done, meta = [], 0.0, False, {}
        for i, call in enumerate(action.tool_calls):
            call_id = call.id or f"call_{self.turn}_{i}"
            if done:
                out.append(Message("tool", "error: the episode ended before this call", name=call.name,
                                   tool_call_id=call_id))
                continue
            result = await self._step_payload({"type": "call_tool", "tool_name": call.name,
                                               "arguments": dict(call.arguments)})
            reward += _reward(result.get("reward"))
            done = bool(result.get("done"))
            meta = result.get("metadata") or {}
            out.append(Message("tool", _tool_text(result["observation"]), name=call.name, tool_call_id=call_id))
        out += [Message("tool", f"error: {e.message}") for e in action.parse_errors]
        return out, reward, done, meta

    # --- transport --------------------------------------------------------------------------------
    async def _connect(self) -> None:
        if self._factory is not None:
            if self._environment is None:
                self._environment = await asyncio.to_thread(self._factory)
                if self.action_cls is None and not callable(self.action):
                    self.action_cls = _annotated_action(self._environment)
                self._schema = self.action_cls.model_json_schema() if self.action_cls is not None else {}
            return
        if self._client is None:
            from openenv.core import GenericEnvClient

            self._client = GenericEnvClient(base_url=self.url, message_timeout_s=self.message_timeout_s)
        if self._schema is None:
            await self._client.connect()
            self._schema = await _remote_action_schema(self._client)

    async def _sync(self, fn: Callable[[], Any]) -> Any:
        return await _run_sync(fn, self.threads)

    async def _reset(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        if self._environment is None:
            return _result(await self._client.reset(**kwargs))
        env = self._environment
        from openenv.core.env_server.interfaces import Environment

        if type(env).reset_async is not Environment.reset_async:
            obs = await env.reset_async(**_accepted(env.reset_async, kwargs))
        else:
            obs = await self._sync(lambda: env.reset(**_accepted(env.reset, kwargs)))
        return _serialized(obs)

    async def _step_payload(self, payload: Any) -> dict[str, Any]:
        if self._environment is None:
            return _result(await self._client.step(payload))
        env = self._environment
        from openenv.core.env_server.interfaces import Environment
        from openenv.core.env_server.serialization import deserialize_action
        from openenv.core.env_server.types import Action as OpenEnvAction

        if not isinstance(payload, OpenEnvAction):
            if self.action_cls is None and payload.get("type") not in ("list_tools", "call_tool"):
                raise InvalidInput(f"OpenEnvEnv: the action class of {type(env).__name__} is unknown; pass action_cls=")
            payload = deserialize_action(payload, self.action_cls or OpenEnvAction)
        if type(env).step_async is not Environment.step_async:
            obs = await env.step_async(payload)
        else:
            obs = await self._sync(lambda: env.step(payload))
        return _serialized(obs)


async def _run_sync(fn: Callable[[], Any], threads: bool) -> Any:
    return await asyncio.to_thread(fn) if threads else fn()


def _result(step_result: Any) -> dict[str, Any]:
    """An OpenEnv client's `StepResult` as the wire dict (observation, reward, done, metadata)."""
    obs = step_result.observation
    if hasattr(obs, "model_dump"):
        obs = obs.model_dump()
    return {"observation": dict(obs or {}), "reward": step_result.reward, "done": step_result.done,
            "metadata": step_result.metadata}


def _serialized(observation: Any) -> dict[str, Any]:
    from openenv.core.env_server.serialization import serialize_observation

    out = serialize_observation(observation)
    out["metadata"] = getattr(observation, "metadata", None) or out.get("metadata")
    return out


def _reward(value: Any) -> float:
    return 0.0 if value is None else float(value)


def _accepted(fn: Callable[..., Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if k in params}


def _annotated_action(env: Any) -> type | None:
    """The `Action` subclass an in-process env's `step` is annotated with (None: not annotated)."""
    from openenv.core.env_server.types import Action as OpenEnvAction

    for name in ("step", "_step_impl"):
        fn = getattr(type(env), name, None)
        try:
            hint = get_type_hints(fn).get("action") if fn is not None else None
        except Exception:  # noqa: BLE001 - an unresolvable annotation is no annotation
            hint = None
        if isinstance(hint, type) and issubclass(hint, OpenEnvAction) and hint is not OpenEnvAction:
            return hint
    return None


async def _remote_action_schema(client: Any) -> dict[str, Any]:
    """The server's action schema (`GET /schema`); {} when it does not publish one."""
    import aiohttp

    base = client.base_url
    http = base.replace("ws://", "http://", 1).replace("wss://", "https://", 1)
    try:
        async with aiohttp.ClientSession() as s, s.get(f"{http}/schema", timeout=aiohttp.ClientTimeout(10)) as r:
            return (await r.json()).get("action") or {} if r.status == 200 else {}
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return {}


def _tool_text(obs: Mapping[str, Any]) -> str:
    """A `CallToolObservation` as the text a model reads: the result's text blocks, else its JSON; errors as
    `error: ...`."""
    error = obs.get("error")
    if error:
        message = error.get("message") if isinstance(error, Mapping) else str(error)
        return f"error: {message}"
    result = obs.get("result")
    if isinstance(result, Mapping):
        if result.get("is_error") or result.get("isError"):
            prefix = "error: "
        else:
            prefix = ""
        blocks = [b.get("text") for b in result.get("content") or ()
                  if isinstance(b, Mapping) and b.get("type") == "text"]
        if blocks:
            return prefix + "\n".join(t for t in blocks if t is not None)
        if result.get("data") is not None:
            result = result["data"]
    if isinstance(result, str):
        return result
    return json.dumps(result, ensure_ascii=False, default=str)


__all__ = ["OpenEnvEnv", "SUPPORTED", "require_openenv"]
