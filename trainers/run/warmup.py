"""SFT warm-up (`warmup:` in the run config; `slime-env sft`): supervised steps before RL, so a model that cannot
yet use a tool's format learns it first (the cold start of ReTool and most agentic RL recipes).

Data, one of:
- `data: {path: FILE}` — conversations (`{"messages": [...], "tools": [...]}` JSONL/Parquet), rendered with the
  model's chat template, loss on the assistant turns only (`slime_env.conversations`);
- `data: {rollouts: {policy: ..., ...}}` — trajectories of the run's env played by a teacher through our own
  rollout manager, kept only when they succeed (rejection sampling: status completed, reward >= `min_reward`).
  `policy` is `"module:function"` (a scripted teacher: `fn(context_text) -> reply`, see
  `slime_env.envs.calculator.teacher_reply`), `"engine"` (the run's own engine: rejection-sampling fine-tuning on the
  model's own successes) or `{url: ...}` (a stronger model behind an SGLang-compatible server sharing the
  student's tokenizer: its tokens are what the student is trained on). `tasks` (a split spec like `train_data`; default:
  the run's `train_data`), `n_samples` per task, `temperature`, `max_tasks`.

Then `steps` optimizer steps of `batch_size` trajectories (reshuffled each pass) at learning rate `lr`, each
`trainer.sft_step` (not counted as an RL step). Metrics go to `sft_metrics.jsonl`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slime_env.errors import InvalidInput
from slime_env.trainers.config_fields import check_scalars

if TYPE_CHECKING:
    from slime_env.policy import Policy
    from slime_env.renderers import TemplateRenderer
    from slime_env.trajectory import Trajectory
    from slime_env.trainers.run.roles import Engines, TrainerGroup
    from slime_env.types import Task


@dataclass(frozen=True)
class WarmupConfig:
    """The `warmup:` section (see the module docstring)."""

    steps: int = 0
    lr: float = 1e-5
    batch_size: int = 32
    data: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, raw: object, where: str = "warmup") -> WarmupConfig:
        if not raw:
            return cls()
        if not isinstance(raw, dict):
            raise InvalidInput(f"{where}: expected a mapping")
        unknown = sorted(set(raw) - {"steps", "lr", "batch_size", "data"})
        if unknown:
            raise InvalidInput(f"{where}: unknown field(s) {unknown}; known: ['batch_size', 'data', 'lr', 'steps']")
        wc = cls(**check_scalars(cls, raw, where))
        if wc.steps < 1 or wc.batch_size < 1 or not wc.lr > 0:
            raise InvalidInput(f"{where}: steps ({wc.steps}) and batch_size ({wc.batch_size}) must be >= 1, lr > 0")
        data = wc.data
        if not isinstance(data, dict) or len(set(data) & {"path", "rollouts"}) != 1:
            raise InvalidInput(f"{where}.data: give 'path' (conversations) or 'rollouts' (a teacher playing the env)")
        if "rollouts" in data:
            ro = data["rollouts"]
            known = {"policy", "tasks", "n_samples", "temperature", "min_reward", "max_tasks"}
            if not isinstance(ro, dict) or "policy" not in ro or set(ro) - known:
                raise InvalidInput(f"{where}.data.rollouts: needs 'policy' ('module:function', 'engine' or {{url}}) "
                                   f"and takes {sorted(known - {'policy'})}; got "
                                   f"{sorted(ro) if isinstance(ro, dict) else ro}")
            policy = ro["policy"]
            if not (isinstance(policy, str) or (isinstance(policy, dict) and set(policy) == {"url"})):
                raise InvalidInput(f"{where}.data.rollouts.policy: 'module:function', 'engine' or {{url: ...}}, "
                                   f"got {policy!r}")
        return wc


# `cfg` below: the run's `TrainConfig` (untyped here: `config` imports this module for `WarmupConfig`).
async def warmup_trajectories(wc: WarmupConfig, cfg: Any, policy: Policy, renderer: TemplateRenderer,
                              train_tasks: list[Task], log: Callable[[str], None] = print,
                              ) -> tuple[list[Trajectory], dict[str, float]]:
    """The SFT trajectories of `wc.data` and what making them measured (`warmup/*`); a teacher plays `train_tasks`
    (the run's train split, or the tasks of `rollouts.tasks`, loaded by the caller)."""
    data = wc.data
    if "path" in data:
        from slime_env.conversations import conversation_trajectory, load_conversations

        trajs = [conversation_trajectory(c, renderer) for c in load_conversations(data["path"])]
        return trajs, {"warmup/examples": float(len(trajs))}
    from slime_env import RolloutManager, ScriptedPolicy
    from slime_env.rollout import EpisodeOptions, GroupOptions
    from slime_env.loading import load_object

    ro = data["rollouts"]
    tasks = list(train_tasks)[:int(ro["max_tasks"])] if "max_tasks" in ro else list(train_tasks)
    owned = None
    if ro["policy"] == "engine":
        teacher = policy
    elif isinstance(ro["policy"], dict):
        from slime_env.clients.sglang import SGLangPolicy

        teacher = owned = SGLangPolicy(ro["policy"]["url"])
    else:
        teacher = ScriptedPolicy(renderer.tokenizer, load_object(ro["policy"]))
    n = int(ro.get("n_samples", 1))
    manager = RolloutManager(tasks, env_id=cfg.env, env_kwargs=cfg.env_kwargs, policy=teacher, renderer=renderer,
                             sampling_params={"temperature": float(ro.get("temperature", cfg.temperature))},
                             seed=cfg.seed, episode=EpisodeOptions(max_turns=cfg.max_turns,
                                                                   max_new_tokens=cfg.max_new_tokens),
                             groups=GroupOptions(n_samples_per_prompt=n, max_concurrency=max(cfg.max_concurrency, n)))
    try:
        played = [t for g in (await manager.generate_batch(len(tasks))).groups for t in g.trajectories]
    finally:
        await manager.close()
        if owned is not None:
            await owned.close()
    floor = float(ro.get("min_reward", 1.0))
    kept = [t for t in played if t.status == "completed" and t.reward >= floor]
    log(f"warm-up data: {len(kept)} of {len(played)} teacher episodes succeeded (reward >= {floor}) and are kept")
    if not kept:
        statuses = sorted({t.status for t in played})
        raise InvalidInput(f"warmup.data.rollouts: none of {len(played)} teacher episodes completed with reward >= "
                           f"{floor} (statuses: {statuses}): nothing to fine-tune on")
    return kept, {"warmup/episodes": float(len(played)), "warmup/examples": float(len(kept)),
                  "warmup/acceptance": len(kept) / max(len(played), 1)}


async def run_warmup(wc: WarmupConfig, trainer: TrainerGroup, trajectories: list[Trajectory], run: Path, seed: int,
                     log: Callable[[str], None] = print) -> list[dict[str, float]]:
    """`wc.steps` SFT steps over `trajectories` (shuffled passes); rows appended to `run/sft_metrics.jsonl`."""
    rng = random.Random(seed)
    order: list[Trajectory] = []
    rows = []
    path = run / "sft_metrics.jsonl"
    path.unlink(missing_ok=True)
    for step in range(1, wc.steps + 1):
        batch = []
        while len(batch) < min(wc.batch_size, len(trajectories)):
            if not order:
                order = list(trajectories)
                rng.shuffle(order)
            batch.append(order.pop())
        metrics = await trainer.sft_step(batch, wc.lr)
        row = {"sft_step": step, **metrics}
        rows.append(row)
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if step == 1 or step == wc.steps or step % 10 == 0:
            log(f"sft step {step}/{wc.steps}: loss {metrics.get('sft/loss', float('nan')):.4f}, "
                f"grad {metrics.get('sft/grad_norm', 0):.3f}")
    return rows


async def warm_up(wc: WarmupConfig, cfg: Any, run: Path, engines: Engines, trainer: TrainerGroup,
                  train_tasks: list[Task], log: Callable[[str], None]) -> dict[str, float]:
    """The whole warm-up of a run: its data, its SFT steps, its weights pushed to the engines (still weight version 0:
    RL steps count from there); returns its `warmup/*` metrics."""
    import math
    import time

    from slime_env import get_renderer
    from slime_env.trainers.run.data import load_split

    t0 = time.perf_counter()
    ro = wc.data.get("rollouts") or {}
    tasks = load_split(ro["tasks"], "warmup.data.rollouts.tasks") if "tasks" in ro else train_tasks
    renderer = get_renderer(getattr(engines, "processor", None) or engines.tokenizer)  # a VLM's processor, if any
    trajs, stats = await warmup_trajectories(wc, cfg, engines.policy, renderer, tasks, log)
    rows = await run_warmup(wc, trainer, trajs, run, cfg.seed, log)
    await trainer.sync("0")
    engines.synced()
    return {**stats, "warmup/steps": float(len(rows)), "warmup/loss_first": rows[0].get("sft/loss", math.nan),
            "warmup/loss_last": rows[-1].get("sft/loss", math.nan), "warmup/s": time.perf_counter() - t0}
