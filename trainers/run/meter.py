"""How busy the engines were: generation time and tokens, measured on the policy the rollout manager uses.

`BusyMeter.wrap(policy)` gives a policy whose generate calls it times; the recorder turns the busy seconds and tokens
into `time/engine_idle_frac` and `rollout/generated_tokens_per_s`. Any async mode: the meter only watches.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slime_env.policy import Policy
    from slime_env.types import Generation


class BusyMeter:
    """How long the engines had at least one generation in flight, and how many tokens came back (the policy
    wrapped by `wrap`); `hold()` … `release()` brackets a weight update, whose waiting requests are not work."""

    def __init__(self) -> None:
        self.busy_s = 0.0
        self.tokens = 0
        self._live = 0
        self._since = 0.0
        self._held = False

    def wrap(self, policy: Policy) -> Policy:
        return _Metered(policy, self)

    def enter(self) -> None:
        if self._live == 0 and not self._held:
            self._since = time.perf_counter()
        self._live += 1

    def exit(self, tokens: int) -> None:
        self._live -= 1
        self.tokens += tokens
        if self._live == 0 and not self._held:
            self.busy_s += time.perf_counter() - self._since

    def hold(self) -> None:
        if self._live and not self._held:
            self.busy_s += time.perf_counter() - self._since
        self._held = True

    def release(self) -> None:
        self._held = False
        if self._live:
            self._since = time.perf_counter()

    def busy(self) -> float:
        """Busy seconds so far, the running interval included."""
        live = time.perf_counter() - self._since if self._live and not self._held else 0.0
        return self.busy_s + live


class _Metered:
    """A policy (or an episode's view of it) whose generate calls the meter times; everything else passes through."""

    def __init__(self, inner: Policy, meter: BusyMeter):
        self._inner, self._meter = inner, meter

    async def generate(self, input_ids: Sequence[int], sampling_params: Mapping[str, Any],
                       **kwargs: Any) -> Generation:
        self._meter.enter()
        tokens = 0
        try:
            gen = await self._inner.generate(input_ids, sampling_params, **kwargs)
            tokens = len(getattr(gen, "token_ids", ()))
            return gen
        finally:
            self._meter.exit(tokens)

    def for_episode(self, session_id: str) -> Policy:
        view = getattr(self._inner, "for_episode", None)
        return _Metered(view(session_id), self._meter) if callable(view) else self

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
