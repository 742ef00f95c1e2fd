"""`to_pettingzoo(env)`: any `MultiAgentEnv` as a PettingZoo AEC env (optional extra `[pettingzoo]`).

Observations and actions are text (`TextSpace`: any string). `observe(agent)` is what the agent was shown since it
last acted (its messages' contents, joined by blank lines); `step(text)` is its reply. Agents that move together
in the slime_env env (simultaneous moves) act one after another here and the env steps once all have chosen — the
AEC convention for Parallel games. Rewards are the env's, per step, accumulated PettingZoo's way; an agent the env
terminates or truncates then takes PettingZoo's `None` step; when no agent is left to act, the others are
terminated. The env's coroutines run on a private event loop in a helper thread (`BackgroundLoop`), so this works inside
a running loop too (Jupyter).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from pettingzoo.utils.env import AECEnv

from slime_env.background_loop import BackgroundLoop
from slime_env.gym_adapter import TextSpace
from slime_env.multi_agent import MultiAgentEnv
from slime_env.types import Action, Message, Task


class TextObservation(str):
    """An observation: a plain `str` that also states its dtype (unicode), as PettingZoo's checks ask every
    observation to (`observation_space(agent).dtype == observation.dtype`)."""

    dtype = np.dtype(str)


def to_pettingzoo(env: MultiAgentEnv, *, task: Task | Mapping[str, Any] | str = "play",
                  max_action_chars: int = 4096) -> AECEnv:
    """`env` as a PettingZoo AEC env (see the module docstring); `task` is passed to every `reset`."""
    if not isinstance(env, MultiAgentEnv):
        raise TypeError(f"to_pettingzoo takes a MultiAgentEnv, got {type(env).__name__}")
    return SlimeAEC(env, task=task, max_action_chars=max_action_chars)


class SlimeAEC(AECEnv):
    """The AEC view made by `to_pettingzoo`."""

    metadata = {"name": "slime_env", "render_modes": [], "is_parallelizable": False}

    def __init__(self, env: MultiAgentEnv, *, task: Task | Mapping[str, Any] | str, max_action_chars: int):
        super().__init__()
        self.env, self.task = env, Task.coerce(task)
        self.possible_agents = list(env.agents)
        self.agents: list[str] = []
        self._obs_space, self._act_space = TextSpace(), TextSpace(max_length=max_action_chars)
        self._loop = BackgroundLoop("slime_env-pettingzoo")
        self._shown: dict[str, str] = {}
        self._queue: list[str] = []
        self._chosen: dict[str, Action] = {}

    def observation_space(self, agent: str) -> TextSpace:
        return self._obs_space

    def action_space(self, agent: str) -> TextSpace:
        return self._act_space

    def reset(self, seed: int | None = None, options: dict | None = None) -> None:
        observations, _ = self._loop.run(self.env.reset(seed=seed, options={"task": self.task, **(options or {})}))
        self.agents = list(self.possible_agents)
        self._shown = {a: _text(observations.get(a, ())) for a in self.agents}
        self.rewards = dict.fromkeys(self.agents, 0.0)
        self._cumulative_rewards = dict.fromkeys(self.agents, 0.0)
        self.terminations = dict.fromkeys(self.agents, False)
        self.truncations = dict.fromkeys(self.agents, False)
        self.infos = {a: {} for a in self.agents}
        self._chosen = {}
        self._queue = [a for a in self.env.acting() if a in self.agents]
        if not self._queue:  # nothing to play
            self.terminations = dict.fromkeys(self.agents, True)
        self.agent_selection = self._queue[0] if self._queue else self.agents[0]
        self._skip_agent_selection = None

    def observe(self, agent: str) -> TextObservation:
        return TextObservation(self._shown.get(agent, ""))

    def step(self, action: str | None) -> None:
        agent = self.agent_selection
        if self.terminations[agent] or self.truncations[agent]:
            self._was_dead_step(action)
            return
        if not isinstance(action, str):
            raise TypeError(f"{agent}'s action must be text, got {type(action).__name__}")
        self._cumulative_rewards[agent] = 0.0
        self._clear_rewards()
        self._chosen[agent] = Action(text=action, agent_id=agent)
        self._shown[agent] = ""
        self._queue.remove(agent)
        if not self._queue:  # every agent acting now has chosen: the env steps
            observations, rewards, terminated, truncated, info = self._loop.run(self.env.step(self._chosen))
            self._chosen = {}
            for a, messages in observations.items():
                if a in self._shown:
                    self._shown[a] = "\n\n".join(t for t in (self._shown[a], _text(messages)) if t)
            for a in self.agents:
                self.rewards[a] = float(rewards.get(a, 0.0))
                self.terminations[a] = bool(terminated.get(a, False))
                self.truncations[a] = bool(truncated.get(a, False))
                self.infos[a] = dict(info)
            self._queue = [a for a in self.env.acting()
                           if a in self.agents and not (self.terminations[a] or self.truncations[a])]
            if not self._queue:  # the game is over for everyone still in it
                for a in self.agents:
                    if not self.truncations[a]:
                        self.terminations[a] = True
            self._accumulate_rewards()
        if self._queue:
            self.agent_selection = self._queue[0]
        self._deads_step_first()

    def render(self) -> None:
        return None

    def close(self) -> None:
        self._loop.close(self.env.close())


def _text(messages: Sequence[Message | Mapping[str, Any]]) -> str:
    return "\n\n".join(Message.coerce(m).content for m in messages)
