"""An OpenEnv MCP environment for the tests: guess a number with OpenEnv's MCP tool actions (`MCPEnvironment` and
FastMCP, as OpenEnv's own MCP envs are written). Served by `uvicorn openenv_support:app` (tests/ as app dir)."""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Observation, State


class GuessObservation(Observation):
    prompt: str = ""


class GuessEnvironment(MCPEnvironment):
    """The secret is 7 (or `seed % 10` when seeded); `guess(number)` answers higher / lower / correct; a correct guess
    ends the episode with reward 1, every other guess costs 0.1. `hint()` says whether the secret is even."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        mcp = FastMCP("guess")
        self.secret, self.solved = 7, False
        self._state = State(episode_id=str(uuid4()), step_count=0)

        @mcp.tool
        def guess(number: int) -> str:
            """Guess the secret number (0-9)."""
            if number == self.secret:
                self.solved = True
                return "correct"
            return "higher" if number < self.secret else "lower"

        @mcp.tool
        def hint() -> str:
            """Whether the secret number is even."""
            return "even" if self.secret % 2 == 0 else "odd"

        super().__init__(mcp)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        self.secret = 7 if seed is None else seed % 10
        self.solved = False
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return GuessObservation(prompt="Guess my number between 0 and 9 with the guess tool.", reward=0.0)

    async def step_async(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        obs = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        if isinstance(action, CallToolAction):
            self._state.step_count += 1
            obs.done = self.solved
            obs.reward = 1.0 if self.solved else -0.1
        return obs

    def _step_impl(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=0.0, metadata={"error": "use the guess tool"})

    @property
    def state(self) -> State:
        return self._state


app = create_app(GuessEnvironment, CallToolAction, CallToolObservation, env_name="guess", max_concurrent_envs=8)
