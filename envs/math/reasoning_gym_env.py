"""ReasoningGym-v0: any reasoning-gym generator as an env, rewarded by reasoning-gym's own `score_answer`.

`make("ReasoningGym-v0", dataset="basic_arithmetic", size=1000, seed=0, config={...})` draws tasks
from the generator when reset gets none; tasks written by `reasoning_gym_tasks` / `write_tasks_jsonl`
carry their dataset name and full entry in metadata (`rg_dataset`, `rg_entry`), so the rollout manager
can feed them from a JSONL file and scoring needs nothing else. The answer is the last
`<answer>...</answer>` (reasoning-gym's format; `answer_formats` changes it); the reward is
`score_answer(answer, entry)` in [0, 1], computed off the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from slime_env import Action, Env, Task
from slime_env.errors import InvalidInput
from slime_env.envs.math.extract import extract_answer


@functools.lru_cache(maxsize=64)
def _dataset(name: str, size: int, seed: int, config_json: str):
    import reasoning_gym

    return reasoning_gym.create_dataset(name, size=size, seed=seed, **json.loads(config_json))


def _scorer(name: str):
    """A dataset object of `name`, used only for its `score_answer(answer, entry)`."""
    return _dataset(name, 1, 0, "{}")


def reasoning_gym_tasks(dataset: str, size: int, seed: int = 0, config: Mapping[str, Any] | None = None) -> list[Task]:
    """`size` tasks of a reasoning-gym generator, each with its entry in metadata (JSON-safe)."""
    return [_task(dataset, size, seed, config, i) for i in range(size)]


def _task(dataset: str, size: int, seed: int, config: Mapping[str, Any] | None, i: int) -> Task:
    ds = _dataset(dataset, size, seed, json.dumps(dict(config or {}), sort_keys=True))
    entry = json.loads(json.dumps(ds[i]))  # tuples -> lists: what a JSONL round trip gives anyway
    return Task(prompt=entry["question"], label=entry["answer"], metadata={"rg_dataset": dataset, "rg_entry": entry},
                id=f"{dataset}-{seed}-{i}")


def write_tasks_jsonl(path: str | Path, dataset: str, size: int, seed: int = 0,
                      config: Mapping[str, Any] | None = None) -> Path:
    """Write `reasoning_gym_tasks(...)` to a JSONL file for `slime-env rollout` / the rollout manager."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for task in reasoning_gym_tasks(dataset, size, seed, config):
            f.write(json.dumps(task.to_dict()) + "\n")
    return path


class ReasoningGymEnv(Env):
    """One reasoning-gym problem per episode, single turn (see the module docstring)."""

    def __init__(self, *, dataset: str = "basic_arithmetic", size: int = 1000, seed: int = 0,
                 config: Mapping[str, Any] | None = None, system_prompt: str | None = None,
                 answer_formats: Sequence[str] = ("answer_tag",)):
        import reasoning_gym

        self.dataset, self.size, self.seed = dataset, size, seed
        self.config = dict(config or {})
        self.system_prompt = system_prompt if system_prompt is not None else \
            reasoning_gym.utils.SYSTEM_PROMPTS["default"]
        self.answer_formats = tuple(answer_formats)
        self._task: Task | None = None

    def sample_task(self, rng: random.Random) -> Task:
        return _task(self.dataset, self.size, self.seed, self.config, rng.randrange(self.size))  # that one only

    async def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None):
        self._task = self.task_from(options, seed)
        if "rg_entry" not in self._task.metadata and self._task.label is None:  # nothing to score an answer against
            raise InvalidInput("ReasoningGym-v0 task has no 'label' (the gold answer) and no metadata['rg_entry']")
        if "rg_entry" not in self._task.metadata:
            entry = {"question": self._task.prompt if isinstance(self._task.prompt, str) else "",
                     "answer": self._task.label, "metadata": {}}
            self._task = Task(self._task.prompt, self._task.label,
                              {**self._task.metadata, "rg_dataset": self.dataset, "rg_entry": entry}, self._task.id)
        return self._task.messages(system=self.system_prompt), {}

    async def step(self, action: Action):
        if self._task is None:
            raise RuntimeError("ReasoningGymEnv.step called before reset")
        answer = extract_answer(action.text, self.answer_formats)
        name = self._task.metadata.get("rg_dataset", self.dataset)
        entry = self._task.metadata["rg_entry"]
        score = await asyncio.to_thread(_score, name, answer, entry)
        return [], score, True, False, {"answer": answer, "score": score, "correct": score >= 1.0}


def _score(name: str, answer: str | None, entry: Mapping[str, Any]) -> float:
    try:
        return float(_scorer(name).score_answer(answer, dict(entry)))
    except Exception:  # noqa: BLE001 - a scorer bug on odd model output is a zero, not a failed episode
        return 0.0
