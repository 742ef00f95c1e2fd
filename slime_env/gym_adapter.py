"""A synchronous `gymnasium.Env` over an async slime_env `Env`: text in, text out.

`gymnasium.make("slime_env/<id>")` (after `import slime_env`) returns `GymTextEnv`. The action is
the assistant's text; the observation is the text of the new messages, rendered by the chat
template when a `renderer` is given, else as `role: content` paragraphs. The async env runs on a
private event loop in a helper thread (`BackgroundLoop`), so the adapter also works inside a running loop (Jupyter).
"""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence
from typing import Any

import gymnasium

from slime_env.background_loop import BackgroundLoop
from slime_env.env import Env
from slime_env.errors import InvalidInput
from slime_env.parsers import get_parser
from slime_env.types import Action, Message

_PRINTABLE = string.printable


class TextSpace(gymnasium.spaces.Text):
    """Any Unicode string up to `max_length` (Gymnasium's Text only admits a fixed charset)."""

    def __init__(self, max_length: int = 1 << 20, seed: int | None = None):
        super().__init__(max_length=max_length, min_length=0, charset=_PRINTABLE, seed=seed)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length

    def __repr__(self) -> str:
        return f"TextSpace(max_length={self.max_length})"


class GymTextEnv(gymnasium.Env):
    """Gymnasium view of a slime_env env. `reset(options={"task": ...})`; without a task the env's
    `sample_task` is seeded by `seed`. `step(text)` returns (observation text, reward, terminated,
    truncated, info). `renderer` (optional) renders observations with the chat template and
    tokenizes actions so `Action.token_ids` is filled."""

    metadata = {"render_modes": []}

    def __init__(self, env: Env, *, renderer: Any = None, parser: Any = "env"):
        super().__init__()
        self.env = env
        self.renderer = renderer
        self._parse = get_parser(env.parser if parser == "env" else parser)
        self.observation_space = TextSpace()
        self.action_space = TextSpace(max_length=4096)
        self._loop = BackgroundLoop("slime_env-gym")
        self._turn = 0

    def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None):
        super().reset(seed=seed)
        if seed is None:  # Gymnasium semantics: an unseeded reset still draws from the env's RNG
            seed = int(self.np_random.integers(0, 2**31 - 1))
        task = self.env.task_from(options, seed)
        messages, info = self._loop.run(self.env.reset(seed=seed, options={"task": task}))
        self._turn = 0
        return self._text([Message.coerce(m) for m in messages], prompt=True), dict(info)

    def step(self, action: str):
        token_ids: tuple[int, ...] = ()
        if self.renderer is not None:
            token_ids = tuple(self.renderer.encode(action))
        parsed = self._parse(action) if self._parse is not None else None
        act = Action(text=action, token_ids=token_ids, tool_calls=parsed.tool_calls if parsed else (),
                     parse_errors=parsed.errors if parsed else (), turn=self._turn)
        obs, reward, terminated, truncated, info = self._loop.run(self.env.step(act))
        self._turn += 1
        return (self._text([Message.coerce(m) for m in obs]), float(reward), bool(terminated), bool(truncated),
                dict(info))

    def _text(self, messages: Sequence[Message], prompt: bool = False) -> str:
        if self.renderer is None:
            return "\n\n".join(f"{m.role}: {m.content}" for m in messages)
        if prompt:
            return self.renderer.render_text(messages, tools=self.env.tools)
        return self.renderer.decode(self.renderer.bridge((), messages))

    def close(self) -> None:
        self._loop.close(self.env.close())


def make_gym_env(env_id: str, renderer: Any = None, parser: Any = "env", **kwargs: Any) -> GymTextEnv:
    """Gymnasium entry point for `slime_env/<env_id>`; kwargs go to the slime_env env. Ids whose env Gymnasium's
    single-agent step API cannot drive (multi-agent envs, agent programs) are refused with the reason."""
    from slime_env.registry import make

    why = gym_refusal(env_id)
    if why is not None:
        raise InvalidInput(why)
    env = make(env_id, **kwargs)
    if not isinstance(env, Env):  # a factory that built something else
        raise InvalidInput(f"{env_id} built a {type(env).__name__}, not a slime_env.Env: Gymnasium's step API cannot "
                           f"drive it; use slime_env.make({env_id!r})")
    return GymTextEnv(env, renderer=renderer, parser=parser)


def gym_refusal(env_id: str) -> str | None:
    """Why `gymnasium.make("slime_env/<env_id>")` cannot give a `gymnasium.Env` for this id (None: it can)."""
    from slime_env.agent_env import AgentEnv
    from slime_env.loading import load_object
    from slime_env.registry import spec

    s = spec(env_id)
    if s.multi_agent:
        return (f"{env_id} is a multi-agent env (slime_env.MultiAgentEnv): Gymnasium's single-agent API cannot drive "
                f"it; use slime_env.make({env_id!r}) with run_multi_agent_episode")
    try:
        target = load_object(s.entry_point) if isinstance(s.entry_point, str) else s.entry_point
    except InvalidInput:
        return None  # `make` names the problem
    if isinstance(target, type) and issubclass(target, AgentEnv):
        return (f"{env_id} runs an agent program (slime_env.AgentEnv) that makes its own model calls through the "
                "gateway: Gymnasium's step API cannot drive it (there are no actions for step() to take); run it with "
                f"slime_env.make({env_id!r}, agent=..., reward=...) in the rollout manager (`slime-env train`) or "
                "AgentEnv.run(gateway, task) — see docs/gateway.md")
    if isinstance(target, type) and not issubclass(target, Env):
        return f"{env_id} is a {target.__name__}, not a slime_env.Env: Gymnasium's step API cannot drive it"
    return None
