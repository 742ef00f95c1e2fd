"""Per-batch rollout metrics, as a flat dict a trainer can log."""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from slime_env.trajectory import STATUSES


def batch_metrics(accepted: list[Any], dropped: list[Any], wall_s: float, *, carried: int = 0,
                  queued: int = 0) -> dict[str, float]:
    """Throughput, turns, rewards per env, status counts and where the time went.

    `time/*_s` are summed over episodes (engine = waiting for generations, env = reset/step,
    framework = everything else inside episodes); `time/*_frac` are their shares of episode time.
    """
    groups = [*accepted, *dropped]
    trajs = [t for g in groups for t in g.trajectories]
    wall_s = max(wall_s, 1e-9)
    generated = sum(sum(1 for m in t.loss_mask if m) for t in trajs)
    m: dict[str, float] = {
        "rollout/wall_s": wall_s, "rollout/episodes": len(trajs), "rollout/episodes_per_s": len(trajs) / wall_s,
        "rollout/generated_tokens": generated, "rollout/tokens_per_s": generated / wall_s,
        "rollout/turns_mean": statistics.fmean([t.num_turns for t in trajs]) if trajs else 0.0,
        "rollout/groups_accepted": len(accepted), "rollout/groups_dropped": len(dropped),
        "rollout/groups_suspended": carried, "rollout/groups_queued": queued,
    }
    for status in STATUSES:
        m[f"rollout/status/{status}"] = sum(t.status == status for t in trajs)
    by_env: dict[str, list[float]] = defaultdict(list)
    for g in groups:
        by_env[g.env_id].extend(t.reward for t in g.trajectories)
    for env_id, rewards in by_env.items():
        m[f"rollout/reward_mean/{env_id}"] = statistics.fmean(rewards)
        m[f"rollout/reward_std/{env_id}"] = statistics.pstdev(rewards)
    total = sum(t.timings.get("total_s", 0.0) for t in trajs) or 1e-9
    for part in ("generate", "env", "framework"):
        spent = sum(t.timings.get(f"{part}_s", 0.0) for t in trajs)
        m[f"rollout/time/{part}_s"] = spent
        m[f"rollout/time/{part}_frac"] = spent / total
    return m
