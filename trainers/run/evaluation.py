"""Evaluation as users run it: the held-out split (greedy, one episode per task: `eval/*`) and any number of named
eval sets (`eval: {every: N, sets: {name: {...}}}` in the run config: `eval/<name>/*`).

A set: `data` (a split spec, as `train_data`), `n_samples` per task (default 1), `temperature` (default 0.0: greedy;
sample at > 0), `top_p`, `env` / `env_kwargs` (default: the run's), `max_turns`, `max_new_tokens`. Its metrics, over
every sample of every task:
- `accuracy`: the mean correctness (info['correct'], else reward >= 1) — pass@1 estimated from all n samples;
- `pass@k` for k = 1, 2, 4, ... up to n (and n): the unbiased estimator 1 - C(n-c, k) / C(n, k) per task (Chen et
  al. 2021), averaged over tasks;
- `maj@n` when the env reports parsed answers (info['answer'], in any episode of the evaluation): the most frequent
  answer of a task's n samples is correct when a sample that gave it was (ties: the first seen; samples without an
  answer abstain; a task none answered counts as wrong);
- `reward_mean`, `response_tokens` (generated tokens per episode), `turns`, `tool_calls_per_episode`,
  `solved_with_tool` (of the solved episodes, the share that called a tool), `failed`, `infra_errors` (episodes lost to
  a cause outside the model; never counted correct).
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from slime_env import Task
from slime_env.errors import InvalidInput
from slime_env.trajectory import EXCLUDED_STATUSES, Trajectory
from slime_env.trainers.config_fields import check_int, check_scalars

if TYPE_CHECKING:
    from slime_env.policy import Policy
    from slime_env.renderers import TemplateRenderer

_SET_KEYS = ("data", "n_samples", "temperature", "top_p", "env", "env_kwargs", "max_turns", "max_new_tokens")


@dataclass
class EvalSet:
    """One named eval set (see the module docstring); None fields take the run's values."""

    name: str
    data: dict[str, Any]
    n_samples: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    env: str | None = None
    env_kwargs: dict[str, Any] | None = None
    max_turns: int | None = None
    max_new_tokens: int | None = None
    tasks: list[Task] = field(default_factory=list)


def eval_sets(raw: object, where: str = "eval") -> tuple[list[EvalSet], int | None]:
    """The sets of an `eval:` section and its `every` (None: the run's `eval_every`); InvalidInput naming the field."""
    if not raw:
        return [], None
    if not isinstance(raw, Mapping) or set(raw) - {"sets", "every"} or not isinstance(raw.get("sets"), Mapping):
        raise InvalidInput(f"{where}: expected {{sets: {{name: {{data: ..., n_samples: ...}}}}, every: N}}; got "
                           f"{sorted(raw) if isinstance(raw, Mapping) else raw!r}")
    every = raw.get("every")
    if every is not None:
        check_int(every, f"{where}.every", minimum=1)
    out = []
    for name, spec in raw["sets"].items():
        at = f"{where}.sets.{name}"
        if not isinstance(spec, Mapping) or "data" not in spec:
            raise InvalidInput(f"{at}: needs 'data' (a split spec, as train_data)")
        unknown = sorted(set(spec) - set(_SET_KEYS))
        if unknown:
            raise InvalidInput(f"{at}: unknown key(s) {unknown}; known: {sorted(_SET_KEYS)}")
        s = EvalSet(name=str(name), **check_scalars(EvalSet, spec, at))
        if s.n_samples < 1 or s.temperature < 0 or not 0 < s.top_p <= 1:
            raise InvalidInput(f"{at}: n_samples >= 1, temperature >= 0 and 0 < top_p <= 1 are required")
        if s.n_samples > 1 and s.temperature == 0:
            raise InvalidInput(f"{at}: {s.n_samples} samples at temperature 0 are one greedy answer repeated; "
                               "give a temperature > 0")
        out.append(s)
    return out, every


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of a task with `c` correct among `n` samples: 1 - C(n-c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def correct(t: Trajectory) -> bool:
    """An episode is correct when its env says so (info['correct']), else when its reward is at least 1."""
    return t.status not in EXCLUDED_STATUSES and bool(t.info.get("correct", t.reward >= 1.0))


def tool_calls(t: Trajectory) -> int:
    """The tool calls an episode made (its env's `tool_stats`: a ToolEnv's calls, valid or not)."""
    stats = (t.info or {}).get("tool_stats")
    return int(sum(s.get("calls", 0) for s in stats.values() if isinstance(s, dict))) if isinstance(stats, dict) else 0


async def play(tasks: Sequence[Task], policy: Policy, renderer: TemplateRenderer, *, env_id: str,
               env_kwargs: Mapping[str, Any], n_samples: int, sampling: Mapping[str, Any], max_turns: int,
               max_new_tokens: int, max_concurrency: int) -> list[list[Trajectory]]:
    """`n_samples` episodes of every task (an `AgentEnv` runs its agent program against a gateway with `sampling`);
    per task, its trajectories."""
    from slime_env import AgentEnv, make, run_episode
    from slime_env.agent_env import GatewayPool

    sem = asyncio.Semaphore(max_concurrency)
    gateways = GatewayPool(policy, renderer, max_new_tokens=max_new_tokens, overrides=dict(sampling))

    async def one(task: Task):
        async with sem:
            env = make(env_id, **env_kwargs)
            try:
                if isinstance(env, AgentEnv):  # the agent program; its main trajectory
                    return (await env.run(await gateways.get(env), task))[0]
                return await run_episode(env, policy, task, renderer=renderer, max_turns=max_turns,
                                         max_new_tokens=max_new_tokens, sampling_params=dict(sampling))
            finally:
                await env.close()

    try:
        flat = await asyncio.gather(*(one(t) for t in tasks for _ in range(n_samples)))
    finally:
        await gateways.close()
    return [list(flat[i * n_samples:(i + 1) * n_samples]) for i in range(len(tasks))]


def set_metrics(groups: Sequence[Sequence[Trajectory]], prefix: str) -> dict[str, float]:
    """The metrics of the module docstring over `groups` (one list of episodes per task), keys under `prefix`."""
    trajs = [t for g in groups for t in g]
    n = len(trajs)
    ok = [correct(t) for t in trajs]
    calls = [tool_calls(t) for t in trajs]
    solved = [c for c, good in zip(calls, ok) if good]
    out = {f"{prefix}accuracy": sum(ok) / n, f"{prefix}reward_mean": sum(t.reward for t in trajs) / n,
           f"{prefix}failed": float(sum(t.status == "failed" for t in trajs)),
           f"{prefix}infra_errors": float(sum(t.status == "infra_error" for t in trajs)),
           f"{prefix}response_tokens": sum(sum(t.loss_mask) for t in trajs) / n,
           f"{prefix}turns": sum(t.num_turns for t in trajs) / n,
           f"{prefix}tool_calls_per_episode": sum(calls) / n,
           # of the solved episodes, how many used a tool: learning the tool, not memorising answers
           f"{prefix}solved_with_tool": sum(c > 0 for c in solved) / len(solved) if solved else 0.0}
    k_max = min(len(g) for g in groups)
    if k_max > 1:
        ks = sorted({k for k in (2 ** i for i in range(k_max.bit_length())) if k <= k_max} | {k_max})
        for k in ks:
            out[f"{prefix}pass@{k}"] = sum(pass_at_k(len(g), sum(map(correct, g)), k) for g in groups) / len(groups)
        if any("answer" in t.info for t in trajs):
            out[f"{prefix}maj@{k_max}"] = sum(_majority_correct(g) for g in groups) / len(groups)
    return out


def _majority_correct(group: Sequence[Trajectory]) -> bool:
    # a sample without an answer (truncated, failed) abstains
    answers = [(str(t.info["answer"]).strip(), correct(t)) for t in group if "answer" in t.info]
    if not answers:
        return False
    top = Counter(a for a, _ in answers).most_common(1)[0][0]  # Counter keeps first-seen order among ties
    return any(good for a, good in answers if a == top)


# `cfg` below: the run's `TrainConfig` (untyped here: `config` imports this module for `eval_sets`).
async def evaluate(tasks: list[Task], policy: Policy, renderer: TemplateRenderer, cfg: Any) -> dict[str, float]:
    """Greedy episodes on the held-out tasks (`eval/*`, see the module docstring). A multi-agent env is played with
    `eval_env_kwargs`: accuracy is then the win rate (reward > 0) of its agents, with draw and illegal-move rates."""
    from slime_env import spec

    if spec(cfg.env).multi_agent:
        return await _evaluate_games(tasks, policy, renderer, cfg)
    groups = await play(tasks, policy, renderer, env_id=cfg.env, env_kwargs=cfg.env_kwargs, n_samples=1,
                        sampling={"temperature": 0.0}, max_turns=cfg.max_turns,
                        max_new_tokens=cfg.eval_max_new_tokens or cfg.max_new_tokens,
                        max_concurrency=cfg.max_concurrency)
    return set_metrics(groups, "eval/")


async def evaluate_set(s: EvalSet, policy: Policy, renderer: TemplateRenderer, cfg: Any) -> dict[str, float]:
    """One named set's `eval/<name>/*` metrics (its tasks loaded into `s.tasks` beforehand)."""
    sampling = {"temperature": s.temperature, **({"top_p": s.top_p} if s.top_p < 1 else {})}
    groups = await play(s.tasks, policy, renderer, env_id=s.env or cfg.env,
                        env_kwargs=cfg.env_kwargs if s.env_kwargs is None else s.env_kwargs, n_samples=s.n_samples,
                        sampling=sampling, max_turns=s.max_turns or cfg.max_turns,
                        max_new_tokens=s.max_new_tokens or cfg.eval_max_new_tokens or cfg.max_new_tokens,
                        max_concurrency=max(cfg.max_concurrency, s.n_samples))
    return set_metrics(groups, f"eval/{s.name}/")


async def _evaluate_games(tasks: list[Task], policy: Policy, renderer: TemplateRenderer,
                          cfg: Any) -> dict[str, float]:
    from slime_env import make, run_multi_agent_episode

    sem = asyncio.Semaphore(cfg.max_concurrency)
    kwargs = {**cfg.env_kwargs, **(cfg.eval_env_kwargs or {})}

    async def one(i: int, task: Task):
        async with sem:
            env = make(cfg.env, **kwargs)
            try:
                return await run_multi_agent_episode(
                    env, policy, task, renderer=renderer, max_turns=cfg.max_turns, seed=10_000 + i,
                    max_new_tokens=cfg.eval_max_new_tokens or cfg.max_new_tokens, sampling_params={"temperature": 0.0})
            finally:
                await env.close()

    games = await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks)))
    trajs = [t for game in games for a, t in game.items() if cfg.train_agents is None or a in cfg.train_agents]
    n = max(len(trajs), 1)
    return {"eval/accuracy": sum(t.reward > 0 for t in trajs) / n,
            "eval/draw_rate": sum(t.reward == 0 for t in trajs) / n,
            "eval/illegal_rate": sum(bool(t.info.get("illegal")) and t.info.get("loser") == t.agent_id
                                     for t in trajs) / n,
            "eval/reward_mean": sum(t.reward for t in trajs) / n,
            "eval/failed": sum(t.status == "failed" for t in trajs),
            "eval/infra_errors": sum(t.status == "infra_error" for t in trajs)}


@dataclass
class Evals:
    """The run's evaluations: the held-out split (`eval/*`, every `cfg.eval_every` steps) and the named sets
    (`eval/<name>/*`, every `every` steps, default `eval_every`); all of them at step 0 and at the last step.
    `seconds`: the time spent evaluating so far."""

    cfg: Any
    tasks: list[Task]
    sets: list[EvalSet]
    every: int | None = None
    seconds: float = 0.0

    def __bool__(self) -> bool:
        return bool(self.tasks or self.sets)

    async def run(self, policy: Policy, renderer: TemplateRenderer, step: int, final: bool = False) -> dict[str, float]:
        import time

        t0, out = time.perf_counter(), {}
        due = final or step == 0
        if self.tasks and (due or step % max(self.cfg.eval_every, 1) == 0):
            out.update(await evaluate(self.tasks, policy, renderer, self.cfg))
        for s in self.sets:
            if due or step % (self.every or max(self.cfg.eval_every, 1)) == 0:
                out.update(await evaluate_set(s, policy, renderer, self.cfg))
        self.seconds += time.perf_counter() - t0
        return out
