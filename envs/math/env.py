"""Math-v0: one prompt, one answer, a verified reward.

Task: `{"prompt": "What is 1/2 + 1/4?", "label": "3/4"}` (text or chat prompt; the label in any form
math-verify reads: `3/4`, `\\frac{3}{4}`, `0.75`, `\\boxed{3/4}`, `#### 0.75`). The model answers in
one turn; the last `\\boxed{}` (or `<answer>`, `Answer:`, `####`, as configured) is extracted and
verified; `info` carries the verdict. Reward: `MathReward` (1/0 or ±1, optional format penalty,
optional `</think>` requirement as in DeepScaleR).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from slime_env import Action, Env, Task
from slime_env.errors import InvalidInput
from slime_env.envs.math.extract import FORMATS
from slime_env.envs.math.rewards import MathReward

SYSTEM_PROMPT = "Solve the problem step by step. Put the final answer in \\boxed{}."


class MathEnv(Env):
    """Single-turn math with a math-verify reward (see the module docstring)."""

    def __init__(self, *, system_prompt: str | None = SYSTEM_PROMPT, reward_mode: str = "binary",
                 format_penalty: float = 0.0, require_think_close: bool = False,
                 answer_formats: Sequence[str] = FORMATS, reward: MathReward | None = None,
                 tasks: Any = None):
        self.set_tasks(tasks)  # resets without a task draw from these, else from default_tasks()
        self.system_prompt = system_prompt
        self.reward = reward or MathReward(mode=reward_mode, format_penalty=format_penalty,
                                           require_think_close=require_think_close, formats=tuple(answer_formats))
        self._task: Task | None = None

    def default_tasks(self) -> Sequence[Task]:
        from slime_env.envs.math.retry_env import default_math_tasks

        return default_math_tasks()  # offline: no dataset to download

    async def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None):
        self._task = self.task_from(options, seed)
        if self._task.label is None:
            raise InvalidInput("Math-v0 task has no 'label' (the gold answer)")
        return self._task.messages(system=self.system_prompt), {}

    async def step(self, action: Action):
        if self._task is None:
            raise RuntimeError("MathEnv.step called before reset")
        reward, verdict = await self.reward(action.text, self._task.label)
        return [], reward, True, False, {"verdict": verdict, "correct": verdict["correct"]}
