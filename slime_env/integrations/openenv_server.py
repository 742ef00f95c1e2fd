"""Any slime_env env as an OpenEnv server: `slime-env serve-openenv ENV_ID` (extra `[openenv]`).

`openenv_app(env_id)` builds OpenEnv's own FastAPI app (`openenv.core.create_app`) over `SlimeEnvironment`, an OpenEnv
`Environment` that holds one of our envs per session. What OpenEnv clients (`GenericEnvClient`, TRL, SkyRL, torchforge)
see:
- **Action** `SlimeAction`: `text` (the assistant turn), optional `tool_calls` (`[{"name", "arguments", "id"}]`;
  when absent the env's own parser reads them from `text`, as in our runner).
- **Observation** `SlimeObservation`: `messages` (the chat messages to append: the prompt after `reset`, the
  observation after `step`), `tools` (the env's tool schemas, after `reset`), `parser`, `describe_tools`,
  `truncated`, `info`, and
  OpenEnv's `done` (terminated or truncated) and `reward`.
- **Reset** kwargs: `seed`, `task` (a prompt string or `{"prompt", "label", "metadata", "id"}`; none: the env's own
  task source), `episode_id`.
The WebSocket endpoint (`/ws`) keeps one env per session, as OpenEnv's stateful clients expect; the stateless HTTP
`/reset` and `/step` build a fresh env per call (OpenEnv's own semantics: use the WebSocket for episodes), so `POST
/step` has no episode to step and is refused (409, saying so). A step after the episode ended (`done`) is refused too,
until the next reset: a client that keeps calling cannot collect the final reward again. Bad input (a task that is not
a prompt or a `{"prompt", ...}` object, a task the env refuses, a tool call without a name) is a 400 naming it; over
the WebSocket these come back as OpenEnv's error message with the same text.
`/schema`, `/metadata`, `/health` and `/mcp` are OpenEnv's; `openenv validate URL` passes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

from slime_env.integrations.openenv import require_openenv

require_openenv()

from openenv.core.env_server.interfaces import Environment  # noqa: E402
from openenv.core.env_server.types import Action as OpenEnvAction  # noqa: E402
from openenv.core.env_server.types import EnvironmentMetadata, State  # noqa: E402
from openenv.core.env_server.types import Observation as OpenEnvObservation  # noqa: E402
from pydantic import Field  # noqa: E402

from slime_env.errors import InvalidInput, SlimeEnvError  # noqa: E402
from slime_env.parsers import get_parser  # noqa: E402
from slime_env.registry import make, spec  # noqa: E402
from slime_env.types import Action, Task, ToolCall  # noqa: E402


class StepRefused(SlimeEnvError):
    """A step the session has no episode for: before any reset (every stateless `POST /step`) or after the episode
    ended. The HTTP routes answer it 409."""


class SlimeAction(OpenEnvAction):
    """One assistant turn: its text and, optionally, the tool calls already parsed from it."""

    text: str = Field(..., description="The assistant turn as generated")
    tool_calls: list[dict[str, Any]] | None = Field(
        default=None, description="Parsed tool calls [{name, arguments, id}]; absent: parsed from text")


class SlimeObservation(OpenEnvObservation):
    """Chat messages to append to the conversation, and what the env reports beside them."""

    messages: list[dict[str, Any]] = Field(default_factory=list, description="Chat messages (role, content, ...)")
    tools: list[dict[str, Any]] | None = Field(default=None, description="Tool schemas for the chat template")
    parser: str | None = Field(default=None, description="The env's tool-call parser (slime_env.parsers)")
    describe_tools: bool = Field(default=True, description="Whether a template without a tool section gets the tools "
                                                          "written into the system message (False: the env's prompt "
                                                          "describes them)")
    truncated: bool = Field(default=False, description="Cut by a limit of the env (done is also true)")
    info: dict[str, Any] = Field(default_factory=dict, description="The env's info dict (JSON-able part)")


class SlimeState(State):
    """OpenEnv's state (episode id, step count) plus the env id and the cumulative reward."""

    env_id: str = ""
    total_reward: float = 0.0


class SlimeEnvironment(Environment):
    """One slime_env env (`make(env_id, **env_kwargs)`) behind OpenEnv's `Environment` interface; async all through."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, env_id: str, env_kwargs: Mapping[str, Any] | None = None):
        super().__init__()
        self.env_id = env_id
        self.env = make(env_id, **dict(env_kwargs or {}))
        self._state = SlimeState(env_id=env_id)
        self._turn = 0
        self._episode = "none"  # "none" (never reset), "running", "over"

    async def reset_async(self, seed: int | None = None, episode_id: str | None = None,
                          task: Any = None, **kwargs: Any) -> SlimeObservation:
        import uuid

        options = {"task": Task.coerce(task, "reset task")} if task is not None else None
        messages, info = await self.env.reset(seed=seed, options=options)
        self._state = SlimeState(episode_id=episode_id or uuid.uuid4().hex, step_count=0, env_id=self.env_id)
        self._turn = 0
        self._episode = "running"
        tools = [dict(t) for t in self.env.tools] if self.env.tools else None
        return SlimeObservation(messages=[m.to_dict() for m in messages], tools=tools, parser=_parser_name(self.env),
                                describe_tools=bool(getattr(self.env, "describe_tools", True)), info=_plain(info),
                                reward=0.0, done=False)

    async def step_async(self, action: SlimeAction, timeout_s: float | None = None,
                         **kwargs: Any) -> SlimeObservation:
        if action.tool_calls is None:
            parsed = get_parser(self.env.parser)(action.text) if self.env.parser else None
            calls, errors = (parsed.tool_calls, parsed.errors) if parsed else ((), ())
        else:
            calls, errors = _tool_calls(action.tool_calls), ()
        if self._episode == "none":
            raise StepRefused("step before reset: this session has no episode. The stateless HTTP POST /step builds a "
                              "fresh env for each call (OpenEnv's semantics), so it can never step one; play episodes "
                              "over the WebSocket /ws (GenericEnvClient: reset, then step)")
        if self._episode == "over":
            raise StepRefused(f"step after the episode ended (done after {self._state.step_count} steps, total_reward "
                              f"{self._state.total_reward}): reset to start another")
        self._turn += 1
        ours = Action(text=action.text, tool_calls=calls, parse_errors=errors, turn=self._turn)
        step = self.env.step(ours)
        obs, reward, terminated, truncated, info = await (asyncio.wait_for(step, timeout_s) if timeout_s else step)
        if terminated or truncated:
            self._episode = "over"
        self._state.step_count += 1
        self._state.total_reward += float(reward)
        return SlimeObservation(messages=[m.to_dict() for m in obs], reward=float(reward),
                                done=bool(terminated or truncated), truncated=bool(truncated) and not terminated,
                                info=_plain(info))

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> SlimeObservation:
        raise RuntimeError("SlimeEnvironment is async: OpenEnv's server calls reset_async")

    def step(self, action: SlimeAction, timeout_s: float | None = None, **kwargs: Any) -> SlimeObservation:
        raise RuntimeError("SlimeEnvironment is async: OpenEnv's server calls step_async")

    @property
    def state(self) -> SlimeState:
        return self._state

    def get_metadata(self) -> EnvironmentMetadata:
        from slime_env.registry import describe

        return EnvironmentMetadata(name=self.env_id, description=describe(spec(self.env_id)) or self.env_id,
                                   version="slime_env")

    def close(self) -> None:
        # OpenEnv closes from the server's event loop (WebSocket end, HTTP call end) or from a worker thread.
        env = self.env
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            asyncio.run(env.close())
        else:
            loop.create_task(env.close())


def openenv_app(env_id: str, *, env_kwargs: Mapping[str, Any] | None = None, max_sessions: int = 64,
                session_timeout_s: float | None = 600.0) -> Any:
    """OpenEnv's FastAPI app serving `env_id` (see the module docstring). `max_sessions` bounds the WebSocket
    sessions (each its own env); idle sessions are closed after `session_timeout_s` (None: never)."""
    from openenv.core.env_server.http_server import create_fastapi_app
    from openenv.core.env_server.types import ConcurrencyConfig

    from fastapi.responses import JSONResponse

    spec(env_id)  # fail now, with the registry's message, if the id is unknown
    kwargs = dict(env_kwargs or {})

    def factory() -> SlimeEnvironment:
        return SlimeEnvironment(env_id, kwargs)

    factory.__name__ = env_id
    config = ConcurrencyConfig(max_concurrent_envs=max_sessions, session_timeout=session_timeout_s)
    app = create_fastapi_app(factory, SlimeAction, SlimeObservation, concurrency_config=config,
                             env_name=env_id, state_cls=SlimeState)

    # OpenEnv's HTTP routes let an env's exception through as a bare 500; ours say what was wrong (FastAPI's
    # `{"detail": ...}` body, as OpenEnv's own 422s)
    async def refused(_request: Any, e: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(e)}, status_code=409 if isinstance(e, StepRefused) else 400)

    app.add_exception_handler(InvalidInput, refused)
    app.add_exception_handler(StepRefused, refused)
    return app


def serve_openenv(env_id: str, *, host: str = "127.0.0.1", port: int = 8000,
                  env_kwargs: Mapping[str, Any] | None = None, max_sessions: int = 64,
                  session_timeout_s: float | None = 600.0) -> None:
    """Serve `env_id` with uvicorn until interrupted (`slime-env serve-openenv`); prints `listening on URL` once bound
    (`port=0` picks a free port)."""
    import socket

    import uvicorn

    app = openenv_app(env_id, env_kwargs=env_kwargs, max_sessions=max_sessions, session_timeout_s=session_timeout_s)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)  # connections wait in the backlog until the server accepts them
    print(f"listening on http://{host}:{sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(app, log_level="warning", ws_max_size=100 * 1024 * 1024)
    uvicorn.Server(config).run(sockets=[sock])


def _tool_calls(raw: list[dict[str, Any]]) -> tuple[ToolCall, ...]:
    """`SlimeAction.tool_calls` as our calls; InvalidInput naming the call and its field."""
    calls = []
    for i, c in enumerate(raw):
        name, arguments = c.get("name"), c.get("arguments")
        if not isinstance(name, str) or not name:
            raise InvalidInput(f"SlimeAction.tool_calls[{i}].name: each call needs the tool's name (a non-empty "
                               f"string), got {c!r}")
        if arguments is not None and not isinstance(arguments, Mapping):
            raise InvalidInput(f"SlimeAction.tool_calls[{i}].arguments must be an object, got {arguments!r}")
        calls.append(ToolCall(name, dict(arguments or {}), id=c.get("id")))
    return tuple(calls)


def _parser_name(env: Any) -> str | None:
    parser = getattr(env, "parser", None)
    return parser if isinstance(parser, str) else None


def _plain(info: Mapping[str, Any] | None) -> dict[str, Any]:
    try:
        return json.loads(json.dumps(dict(info or {})))
    except (TypeError, ValueError):
        return {"repr": repr(info)}


__all__ = ["SlimeAction", "SlimeEnvironment", "SlimeObservation", "SlimeState", "StepRefused", "openenv_app",
           "serve_openenv"]
