"""From trajectories to tensors: padded batches (simple models) and unpadded sequences with cumulative
lengths (varlen attention), with per-token advantages. Group-aware: groups of the same task stay together
(advantages are computed per group; mini-batches split only between groups).

Rows are left-padded, so every sequence ends in the last column: a trainer then needs logits only for
the last `response_columns()` positions (the LM head over a 49k vocabulary is the costliest part of a
small model's forward, and prompts are most of a short-answer batch). `position_ids` count from each
row's first real token. `loss_mask` is the trajectory's loss mask at response positions (0 for the
prompt and padding), `rollout_logprobs` the engine's log-prob of each token. Advantages are per sequence, broadcast to
its tokens (`reward_assignment="sequence"`), or per turn (`"per_turn"`): token t of turn k gets the return-to-go from
turn k, normalised with its group's outcome statistics — an option that carries per-turn env rewards all the way to the
loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch
from slime_env.trainers.algorithms import RoleBaselines, outcome_advantages, token_returns, token_rewards

from slime_env.routing import stream_routing
from slime_env.trajectory import EXCLUDED_STATUSES, Trajectory


@dataclass(frozen=True)
class TrainBatch:
    """Padded `[B, L]` tensors of whole groups (`group_size` consecutive rows each), plus `rewards` [B]."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    turn_of_token: torch.Tensor
    rewards: torch.Tensor
    group_size: int
    token_rewards: torch.Tensor | None = None  # [B, L]: each turn's reward on its last generated token (PPO)
    teacher_logprobs: torch.Tensor | None = None  # [B, L]: a teacher's log-prob of each response token (OPD)
    # [B, L, layers, top_k] int16 (routing replay): the engine's experts for the forward over each column, -1 where the
    # trainer routes itself (prompt, inserted tokens, lost routing); slime_env.trainers.routing_replay
    routed_experts: torch.Tensor | None = None
    # Vision-language rows (trajectories with `vision`): the processor's pixel inputs per row, e.g. `pixel_values`
    # [B, images, C, H, W] and `pixel_attention_mask` [B, images, H, W], zero-padded (the model skips all-zero images)
    vision: dict[str, torch.Tensor] | None = None

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, index: slice | torch.Tensor) -> TrainBatch:
        vision = None if self.vision is None else {k: v[index] for k, v in self.vision.items()}
        return replace(self, vision=vision, **{f.name: getattr(self, f.name)[index] for f in fields(self)
                                               if isinstance(getattr(self, f.name), torch.Tensor)})

    def minibatch_bounds(self, n: int) -> list[tuple[int, int]]:
        """Row ranges of `n` parts, split only at group boundaries (as even as the groups allow); rows in any parts
        when agent side branches make groups uneven (advantages are set by then)."""
        if self.size % self.group_size:
            n = max(1, min(n, self.size))
            bounds = [round(i * self.size / n) for i in range(n + 1)]
            return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
        groups = self.size // self.group_size
        n = max(1, min(n, groups))
        bounds = [round(i * groups / n) * self.group_size for i in range(n + 1)]
        return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]

    def minibatches(self, n: int) -> list[TrainBatch]:
        return [self.rows(slice(a, b)) for a, b in self.minibatch_bounds(n)]

    def micro_batches(self, size: int) -> list[TrainBatch]:
        """Rows in chunks of `size` (for gradient accumulation; groups may be split here: advantages are set)."""
        return [self.rows(slice(i, i + size)) for i in range(0, self.size, size)]

    def trimmed(self) -> TrainBatch:
        """Drop leading padding columns no row uses (micro-batches of short sequences run faster)."""
        used = int(self.attention_mask.sum(-1).max().item()) if self.size else 0
        start = self.input_ids.shape[1] - used
        return replace(self, **{f.name: getattr(self, f.name)[:, start:] for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)
                                and getattr(self, f.name).dim() >= 2})

    @property
    def position_ids(self) -> torch.Tensor:
        return (self.attention_mask.cumsum(-1) - 1).clamp(min=0)

    def response_columns(self) -> int:
        """How many trailing columns hold every loss-bearing token (0 if none)."""
        cols = self.loss_mask.sum(0).nonzero()
        return int(self.input_ids.shape[1] - cols[0].item()) if len(cols) else 0

    def unpadded(self) -> dict[str, torch.Tensor]:
        """Sequences concatenated without padding: `input_ids` [N], `cu_seqlens` [B + 1], `position_ids` [N],
        and `loss_mask`, `rollout_logprobs`, `advantages` [N] — for varlen / packed attention."""
        lengths = self.attention_mask.sum(-1)
        keep = self.attention_mask.bool()
        cu = torch.zeros(self.size + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lengths, 0)
        positions = (torch.cat([torch.arange(int(n)) for n in lengths]) if self.size
                     else torch.zeros(0, dtype=torch.long))
        return {"input_ids": self.input_ids[keep], "cu_seqlens": cu, "position_ids": positions,
                "loss_mask": self.loss_mask[keep], "rollout_logprobs": self.rollout_logprobs[keep],
                "advantages": self.advantages[keep]}


def kept_outcome_advantages(estimator: str, rewards: torch.Tensor, group_size: int,
                            kept: torch.Tensor) -> torch.Tensor:
    """`outcome_advantages` over the `kept` rows alone (bool [N]): each group's mean and std (REINFORCE++: the batch's)
    from its kept rows, 0.0 for the others. With every row kept, exactly `outcome_advantages`."""
    if bool(kept.all()) or estimator == "ppo":
        return outcome_advantages(estimator, rewards, group_size)
    adv = torch.zeros_like(rewards)
    if estimator == "reinforce_plus_plus":  # whitened over the batch: the kept rows are the batch
        adv[kept] = outcome_advantages(estimator, rewards[kept], group_size)
        return adv
    if estimator not in ("grpo", "gspo", "dr_grpo", "reinforce_plus_plus_baseline"):
        return outcome_advantages(estimator, rewards, group_size)  # names the estimator it does not know
    for start in range(0, len(rewards), group_size):
        rows = torch.nonzero(kept[start:start + group_size]).flatten() + start
        if len(rows):  # one group of the kept rows, or (REINFORCE++-baseline) their deviations from its mean
            adv[rows] = (rewards[rows] - rewards[rows].mean() if estimator == "reinforce_plus_plus_baseline"
                         else outcome_advantages(estimator, rewards[rows], len(rows)))
    if estimator == "reinforce_plus_plus_baseline":
        centred = adv[kept]
        adv[kept] = centred / (centred.std(unbiased=False) + 1e-6)
    return adv


def pack(trajectories: Sequence[Trajectory], *, group_size: int, pad_id: int, estimator: str = "grpo",
         reward_assignment: str = "sequence", role_baselines: RoleBaselines | None = None,
         routing: bool = False) -> TrainBatch:
    """Tensors and advantages for `trajectories` (groups of `group_size`, consecutive, in sample order).

    An excluded trajectory (status failed or infra_error: `EXCLUDED_STATUSES`) keeps its place, reward 0.0 and a loss
    mask of zeros, as slime's `remove_sample` does, and is left out of its group's statistics: the others' baseline and
    spread come from the kept ones alone (a container that did not start is no 0 beside its group's 1s). `estimator`
    is an outcome estimator of `slime_env.trainers.algorithms`; "rae" takes `role_baselines` (keyed by each
    trajectory's env id and role) and updates them. `routing`: lay out the
    trajectories' routed experts (`routed_experts`, for routing replay) when any has them.
    """
    if reward_assignment not in ("sequence", "per_turn"):
        raise ValueError(f"reward_assignment must be 'sequence' or 'per_turn', got {reward_assignment!r}")
    # Side branches of an agent session (AgentEnv: a context the agent rewrote, a sub-agent) follow their sample's
    # main trajectory and share its outcome: groups are formed by the main trajectories.
    is_main = [not t.metadata.get("branch_of") for t in trajectories]
    main = [i for i, m in enumerate(is_main) if m]
    if not trajectories or len(main) % group_size or (main and main[0] != 0):
        raise ValueError(f"{len(trajectories)} trajectories ({len(main)} main ones) do not form groups of "
                         f"{group_size}")
    B = len(trajectories)
    if len(main) < B and (estimator in ("rae", "ppo") or reward_assignment != "sequence"):
        raise ValueError("agent sessions with side branches take an outcome estimator (grpo, dr_grpo, reinforce++, "
                         "...) and reward_assignment 'sequence'")
    L = max(len(t.prompt_ids) + len(t.response_ids) for t in trajectories)
    K = max(1, max(len(t.turn_rewards) for t in trajectories))
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention = torch.zeros((B, L), dtype=torch.long)
    loss_mask = torch.zeros((B, L), dtype=torch.float32)
    rollout = torch.zeros((B, L), dtype=torch.float32)
    turn_of = torch.zeros((B, L), dtype=torch.long)
    turn_rewards = torch.zeros((B, K), dtype=torch.float32)
    rewards = torch.zeros(B, dtype=torch.float32)
    # On-policy distillation: a teacher's log-probs of the response tokens (slime_env.trainers.run.teacher), when every
    # row has them
    with_teacher = all("teacher_logprobs" in t.metadata or t.status in EXCLUDED_STATUSES for t in trajectories) and \
        any("teacher_logprobs" in t.metadata for t in trajectories)
    teacher = torch.zeros((B, L), dtype=torch.float32) if with_teacher else None
    shapes = {t.routing.experts.shape[1:] for t in trajectories if routing and t.routing is not None}
    if len(shapes) > 1:
        raise ValueError(f"trajectories carry routed experts of different shapes [*, layers, top_k]: {sorted(shapes)}")
    routed = torch.full((B, L, *shapes.pop()), -1, dtype=torch.int16) if shapes else None
    for i, t in enumerate(trajectories):
        p, r = len(t.prompt_ids), len(t.response_ids)
        o = L - p - r  # left padding
        input_ids[i, o:] = torch.tensor(t.prompt_ids + t.response_ids, dtype=torch.long)
        attention[i, o:] = 1
        failed = t.status in EXCLUDED_STATUSES
        if not failed:
            loss_mask[i, o + p:] = torch.tensor(t.loss_mask, dtype=torch.float32)
            rollout[i, o + p:] = torch.tensor(t.rollout_logprobs, dtype=torch.float32)
            rewards[i] = float(t.reward)
            turn_rewards[i, :len(t.turn_rewards)] = torch.tensor(t.turn_rewards, dtype=torch.float32)
            if teacher is not None:
                lps = t.metadata["teacher_logprobs"]
                if len(lps) != r:
                    raise ValueError(f"trajectory {i}: {len(lps)} teacher log-probs for {r} response tokens")
                teacher[i, o + p:] = torch.tensor(lps, dtype=torch.float32)
        for span in t.spans:
            turn_of[i, o + p + span.start:o + p + span.end] = span.turn
        if routed is not None and t.routing is not None and not failed:
            rows = stream_routing(p, r, t.routing)  # row j: the forward over token j, which gives token j + 1
            routed[i, o:o + len(rows)] = torch.from_numpy(rows)
    per_token, advantages = _advantages(trajectories, main, is_main, rewards, turn_rewards, turn_of, loss_mask,
                                        group_size=group_size, estimator=estimator,
                                        reward_assignment=reward_assignment, role_baselines=role_baselines)
    return TrainBatch(input_ids, attention, loss_mask, rollout, advantages, turn_of, rewards, group_size, per_token,
                      teacher, routed, vision_rows(trajectories))


def _advantages(trajectories: Sequence[Trajectory], main: list[int], is_main: list[bool], rewards: torch.Tensor,
                turn_rewards: torch.Tensor, turn_of: torch.Tensor, loss_mask: torch.Tensor, *, group_size: int,
                estimator: str, reward_assignment: str, role_baselines: RoleBaselines | None
                ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """`pack`'s (per-token rewards for PPO's GAE or None, [B, L] advantages)."""
    B = len(trajectories)
    if estimator == "rae":
        if role_baselines is None:
            raise ValueError("estimator 'rae' needs role_baselines (slime_env.trainers.algorithms.RoleBaselines)")
        keys = [None if t.status in EXCLUDED_STATUSES
                else (str(t.metadata.get("env_id", "")), str(t.metadata.get("role", t.agent_id)))
                for t in trajectories]
        seq_adv = role_baselines.advantages(rewards, keys)
        if reward_assignment != "sequence":
            raise ValueError("estimator 'rae' gives one advantage per sequence: use reward_assignment 'sequence'")
    else:
        kept = torch.tensor([trajectories[i].status not in EXCLUDED_STATUSES for i in main])
        seq_adv = kept_outcome_advantages(estimator, rewards[main], group_size, kept)
        if len(main) < B:
            owner = torch.cumsum(torch.tensor(is_main), 0) - 1  # each row's main trajectory, among the main ones
            seq_adv = seq_adv[owner]
    per_token = token_rewards(turn_rewards if reward_assignment == "per_turn" else rewards.unsqueeze(-1), turn_of,
                              loss_mask) if estimator == "ppo" else None
    if estimator == "ppo":  # advantages come from GAE over the critic's values, in the trainer
        advantages = torch.zeros_like(loss_mask)
    elif reward_assignment == "sequence":
        advantages = seq_adv.unsqueeze(-1) * loss_mask
    else:
        returns = token_returns(turn_rewards, turn_of, loss_mask)
        g, k = rewards.view(-1, group_size), kept.view(-1, group_size).float()  # statistics of the kept rows
        n = k.sum(-1, keepdim=True)
        m = (g * k).sum(-1, keepdim=True) / n.clamp(min=1)
        var = (((g - m) ** 2) * k).sum(-1, keepdim=True) / (n - 1).clamp(min=1)
        mean = m.expand(-1, group_size).reshape(-1, 1)
        std = (var.sqrt() if group_size > 1 else torch.zeros_like(g[:, :1])).expand(-1, group_size).reshape(-1, 1)
        scale = 1.0 if estimator == "dr_grpo" else 1.0 / (std + 1e-6)
        advantages = (returns - mean) * scale * loss_mask
    return per_token, advantages


def vision_rows(trajectories: Sequence[Trajectory]) -> dict[str, torch.Tensor] | None:
    """The trajectories' pixel inputs as `[B, images, ...]` tensors (None when none has images): each row's arrays
    (Idefics3's `[1, images, ...]`, as its processor gives one sequence) zero-padded to the most images of a row."""
    rows = [t.vision.arrays if t.vision is not None else None for t in trajectories]
    if not any(rows):
        return None
    keys = next(r for r in rows if r).keys()
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        parts = []
        for i, r in enumerate(rows):
            a = None if r is None else r.get(key)
            if a is not None and (a.ndim < 2 or a.shape[0] != 1):
                raise ValueError(f"trajectory {i}: vision array {key!r} of shape {tuple(a.shape)} is not one "
                                 "sequence's [1, images, ...] (Idefics3 / SmolVLM); the torch and FSDP trainers batch "
                                 "only that "
                                 "layout (Qwen-VL's flattened patches train with slime)")
            parts.append(None if a is None else torch.from_numpy(a[0]))
        like = next(p for p in parts if p is not None)
        n = max(p.shape[0] if p is not None else 0 for p in parts)
        x = torch.zeros((len(parts), n, *like.shape[1:]), dtype=like.dtype)
        for i, p in enumerate(parts):
            if p is not None:
                x[i, :p.shape[0]] = p
        out[key] = x
    return out
