"""MathTool-v0: tool-integrated math — the model runs Python between thoughts, then answers.

Each turn the model either calls the Python tool or answers. Tool calls are hermes `<tool_call>` JSON
(`{"name": "python", "arguments": {"code": ...}}`, the default) or fenced ```python blocks
(`tool_format="fenced"`). The code runs in the sandbox (`slime_env.tools_sandbox.auto()` unless one is given);
its stdout and stderr, cut to `output_budget_tokens` (≈4 characters a token unless a `count_tokens`
function is given), come back as a masked observation — a `tool` message, or a user message with an
```output block in fenced mode. A run that times out or fails is reported to the model and the
episode continues. The episode ends when a turn has no tool call: that turn's final answer is
verified. Rewards: `MathReward`, plus `tool_bonus` for a correct answer that used the tool at least
once, minus `tool_call_penalty` per tool call. The env truncates after `max_tool_calls`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from slime_env import Action, Message, Task, ToolEnv
from slime_env.tool_env import ToolRecord
from slime_env.errors import InvalidInput
from slime_env.types import ParseError
from slime_env.envs.math.extract import FORMATS
from slime_env.envs.math.rewards import MathReward

SYSTEM_HERMES = ("Solve the problem. You may run Python by replying with\n"
                 '<tool_call>{"name": "python", "arguments": {"code": "print(2**10)"}}</tool_call>\n'
                 "and reading its output. When you are done, put the final answer in \\boxed{}.")
SYSTEM_FENCED = ("Solve the problem. You may run Python by writing a ```python code block; its output comes "
                 "back in an ```output block. When you are done, put the final answer in \\boxed{}.")


class MathToolEnv(ToolEnv):
    """Multi-turn math with a sandboxed Python tool (see the module docstring); a `ToolEnv` whose one
    tool is `slime_env.envs.tools.python_tool`."""

    describe_tools = False  # its system prompt shows the tool-call format itself

    def __init__(self, *, tool_format: str = "hermes", sandbox: Any = None, max_tool_calls: int = 4,
                 tool_timeout_s: float = 5.0, tool_memory_mb: int = 512, output_budget_tokens: int = 256,
                 count_tokens: Callable[[str], int] | None = None, tool_bonus: float = 0.0,
                 tool_call_penalty: float = 0.0, reward_mode: str = "binary", format_penalty: float = 0.0,
                 answer_formats: Sequence[str] = FORMATS, system_prompt: str | None = None,
                 reward: MathReward | None = None, tasks: Any = None):
        from slime_env.envs.tools import python_tool

        if tool_format not in ("hermes", "fenced"):
            raise ValueError(f"tool_format must be 'hermes' or 'fenced', got {tool_format!r}")
        self.tool_format = tool_format
        python = python_tool(lambda: self.sandbox, timeout_s=tool_timeout_s, memory_mb=tool_memory_mb,
                             output_budget_tokens=output_budget_tokens, count_tokens=count_tokens,
                             on_run=self._count_run)
        super().__init__([python], tasks=tasks, parser="hermes" if tool_format == "hermes" else "python_block",
                         system_prompt=system_prompt if system_prompt is not None else (
                             SYSTEM_HERMES if tool_format == "hermes" else SYSTEM_FENCED))
        self._sandbox = sandbox
        self.max_tool_calls, self.tool_timeout_s, self.tool_memory_mb = max_tool_calls, tool_timeout_s, tool_memory_mb
        self.output_budget_tokens, self.count_tokens = output_budget_tokens, count_tokens
        self.tool_bonus, self.tool_call_penalty = tool_bonus, tool_call_penalty
        self.reward = reward or MathReward(mode=reward_mode, format_penalty=format_penalty,
                                           formats=tuple(answer_formats))
        self._calls = 0
        self._ok_calls = 0

    @property
    def sandbox(self):
        if self._sandbox is None:
            from slime_env import tools_sandbox

            self._sandbox = tools_sandbox.auto()  # shared per process: one pool for every episode
        return self._sandbox

    def default_tasks(self) -> Sequence[Task]:
        from slime_env.envs.math.retry_env import default_math_tasks

        return default_math_tasks()  # offline: no dataset to download

    async def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None):
        messages, info = await super().reset(seed=seed, options=options)
        if self.task.label is None:
            raise InvalidInput("MathTool-v0 task has no 'label' (the gold answer)")
        self._calls = self._ok_calls = 0
        return messages, info

    def _count_run(self, result: Any) -> None:
        self._calls += 1
        self._ok_calls += result.status == "ok"

    def is_truncated(self) -> bool:
        return self._calls >= self.max_tool_calls

    async def finish(self, action: Action):
        reward, verdict = await self.reward(action.text, self.task.label)
        if verdict["correct"] and self._ok_calls and self.tool_bonus:
            reward += self.tool_bonus
        reward -= self.tool_call_penalty * self._calls
        return [], reward, True, False, {**self.step_info(), "verdict": verdict, "correct": verdict["correct"],
                                         "tool_calls": self._calls}

    def unknown_tool_message(self, name: str) -> str:
        return f"error: unknown tool {name!r}; the only tool is python(code)"

    def tool_message(self, record: ToolRecord) -> Message:
        if self.tool_format == "hermes":
            return super().tool_message(record)
        return Message("user", f"```output\n{record.output}\n```")

    def parse_error_message(self, error: ParseError) -> Message:
        if self.tool_format == "hermes":
            return super().parse_error_message(error)
        return Message("user", f"```output\nerror: {error.message}\n```")
