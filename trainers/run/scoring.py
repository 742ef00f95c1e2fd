"""What scores a batch after its rollouts, before the trainer sees it: a reward model and on-policy distillation's
teacher (`reward:` and `teacher:` of the run config)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slime_env.rollout import Group
    from slime_env.trainers.run.reward_models import RewardModel
    from slime_env.trainers.run.teacher import Teacher


@dataclass
class Scorers:
    """A reward model (its score combined with the env's reward) and a teacher (its log-probs of every sampled
    token), either or both. Each group's trajectories are replaced in place, so samples.jsonl and the trainer see the
    same rewards. Called with the batch's groups; returns `reward/*` and `time/*` metrics."""

    rm: RewardModel | None = None
    reward: Mapping[str, Any] = field(default_factory=dict)
    teacher: Teacher | None = None

    async def __call__(self, groups: list[Group]) -> dict[str, float]:
        from slime_env.trainers.run.reward_models import apply_rewards
        from slime_env.trainers.run.teacher import annotate

        out: dict[str, float] = {}
        if self.rm is not None:
            t0 = time.perf_counter()
            for g, new in zip(groups, await asyncio.gather(*(apply_rewards(
                    self.rm, g.trajectories, weight=float(self.reward.get("weight", 1.0)),
                    env_weight=float(self.reward.get("env_weight", 1.0))) for g in groups))):
                g.trajectories = new
            scored = [t for g in groups for t in g.trajectories if "rm_score" in t.info]
            out.update({"time/reward_s": time.perf_counter() - t0, "reward/scored": float(len(scored)),
                        "reward/rm_score_mean": sum(t.info["rm_score"] for t in scored) / max(len(scored), 1),
                        "reward/env_reward_mean": sum(t.metadata["env_reward"] for t in scored) / max(len(scored), 1)})
        if self.teacher is not None:
            t0 = time.perf_counter()
            for g, new in zip(groups, await asyncio.gather(*(annotate(self.teacher, g.trajectories) for g in groups))):
                g.trajectories = new
            out["time/teacher_s"] = time.perf_counter() - t0
        return out
