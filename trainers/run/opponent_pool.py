"""`OpponentPool`: frozen snapshots of the policy being trained, played as opponents (league self-play).

Plain self-play trains against the current policy only and can chase its own tail; a pool of past
snapshots keeps old strategies in play. `add(policy)` keeps a policy as an opponent (`snapshot(engine)`
makes one from a local `TransformersPolicy`: its own copy of the weights, frozen from then on);
`opponent(episode)` picks the opponent of one episode — the live policy with probability `latest_p`,
else a snapshot uniformly — the same one for every seat of that episode, reproducibly from `seed`.
At most `size` snapshots are kept; the oldest leaves first.
"""

from __future__ import annotations

import copy
import random
from collections import deque
from typing import TYPE_CHECKING

from slime_env.errors import InvalidInput

if TYPE_CHECKING:
    from slime_env.agents.transformers_policy import TransformersPolicy
    from slime_env.policy import Policy
    from slime_env.trainers.run.config import OpponentPoolConfig


def snapshot(engine: Policy, *, version: str | None = None) -> TransformersPolicy:
    """A frozen copy of a local `TransformersPolicy` (own weights, same tokenizer and batching)."""
    from slime_env.agents.transformers_policy import TransformersPolicy

    if not isinstance(engine, TransformersPolicy):
        raise InvalidInput(f"an opponent snapshot needs a local TransformersPolicy, got {type(engine).__name__} "
                           f"(for a remote engine, serve a checkpoint and pass its policy to OpponentPool.add)")
    model = copy.deepcopy(engine.model).requires_grad_(False)
    return TransformersPolicy(model, engine.tokenizer, max_batch_size=engine.max_batch_size,
                              batch_window_s=engine.batch_window_s, weight_version=version)


class OpponentPool:
    """Opponents for multi-agent training (see the module docstring)."""

    def __init__(self, live: Policy, *, size: int = 4, latest_p: float = 0.0, seed: int = 0):
        if size < 1 or not 0.0 <= latest_p <= 1.0:
            raise InvalidInput(f"opponent pool: size must be >= 1 and latest_p in [0, 1], got {size}, {latest_p}")
        self.live, self.size, self.latest_p, self.seed = live, size, latest_p, seed
        self.snapshots: deque[Policy] = deque()

    def add(self, policy: Policy) -> None:
        if len(self.snapshots) >= self.size:
            self._close(self.snapshots.popleft())
        self.snapshots.append(policy)

    def opponent(self, episode: int) -> Policy:
        rng = random.Random(self.seed * 1_000_003 + episode)
        if not self.snapshots or rng.random() < self.latest_p:
            return self.live
        return self.snapshots[rng.randrange(len(self.snapshots))]

    def close(self) -> None:
        while self.snapshots:
            self._close(self.snapshots.popleft())

    @staticmethod
    def _close(policy: Policy) -> None:
        close = getattr(policy, "close", None)
        if callable(close):
            close()


class League:
    """A run's league self-play (`opponent_pool:` of the run config): the seats in `config.agents` are played by
    snapshots of the embedded engine's policy — the one it starts from, then one every `config.every` steps."""

    def __init__(self, config: OpponentPoolConfig, policy: Policy, *, seed: int, version: int):
        self.config, self.policy = config, policy
        self.pool = OpponentPool(policy, size=config.size, latest_p=config.latest_p, seed=seed)
        self.pool.add(snapshot(policy, version=str(version)))
        self.seats = set(config.agents)

    def policy_for(self, index: int, agent: str) -> Policy | None:
        """The rollout manager's `policy_for`: a seat's opponent for episode `index` (None: the live policy)."""
        return self.pool.opponent(index) if agent in self.seats else None

    def after_step(self, step: int) -> None:
        if step % self.config.every == 0:
            self.pool.add(snapshot(self.policy, version=str(step)))

    def close(self) -> None:
        self.pool.close()
