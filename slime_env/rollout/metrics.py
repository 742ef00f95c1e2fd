"""Per-batch rollout metrics, as a flat dict a trainer can log."""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from slime_env.trajectory import STATUSES


def batch_metrics(accepted: list[Any], dropped: list[Any], wall_s: float, *, carried: int = 0,
                  queued: int = 0) -> dict[str, float]:
    """Throughput, turns, rewards per env, status counts, tool use and where the time went.

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
    m.update(tool_metrics(trajs))
    m.update(time_split(trajs))
    return m


def time_split(trajs: list[Any]) -> dict[str, float]:
    """Where the episodes' time went, summed over episodes: `rollout/time/{generate,env,framework}_{s,frac}`, and
    where envs run in workspaces (`timings["container_{start,exec,verify}_s"]`, or a harness's
    `metadata["workspace"]`: seconds starting, in commands, scoring), `rollout/time/container_{s,frac}` (within the env
    time, except that commands an agent runs at once are each counted whole)."""
    m: dict[str, float] = {}
    total = sum(t.timings.get("total_s", 0.0) for t in trajs) or 1e-9
    for part in ("generate", "env", "framework"):
        spent = sum(t.timings.get(f"{part}_s", 0.0) for t in trajs)
        m[f"rollout/time/{part}_s"] = spent
        m[f"rollout/time/{part}_frac"] = spent / total
    spaces = [w for t in trajs for w in ((t.metadata or {}).get("workspace"),) if isinstance(w, dict) and "exec_s" in w]
    parts = ("container_start_s", "container_exec_s", "container_verify_s")
    timed = [t.timings for t in trajs if any(k in t.timings for k in parts)]
    if spaces or timed:
        spent = sum(float(w.get(k) or 0.0) for w in spaces for k in ("start_s", "exec_s", "verify_s"))
        spent += sum(float(t.get(k) or 0.0) for t in timed for k in parts)
        m["rollout/time/container_s"] = spent
        m["rollout/time/container_frac"] = spent / total
    return m


def tool_metrics(trajs: list[Any]) -> dict[str, float]:
    """`rollout/tools/<name>/{calls,errors,timeouts,invalid,latency_mean_s}` summed over episodes, from the
    `tool_stats` that `ToolEnv` (or any env) reports in its last step's info."""
    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for t in trajs:
        stats = (t.info or {}).get("tool_stats")
        if not isinstance(stats, dict):
            continue
        for name, s in stats.items():
            if isinstance(s, dict):
                for key in ("calls", "errors", "timeouts", "invalid", "latency_s"):
                    value = s.get(key, 0)
                    if isinstance(value, (int, float)):
                        totals[name][key] += value
    out = {}
    for name, s in totals.items():
        for key in ("calls", "errors", "timeouts", "invalid"):
            out[f"rollout/tools/{name}/{key}"] = s[key]
        out[f"rollout/tools/{name}/latency_mean_s"] = s["latency_s"] / s["calls"] if s["calls"] else 0.0
    return out
