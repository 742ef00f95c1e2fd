"""Math reward functions: small, reusable callables over (response, label) (and slime's `--custom-rm-path`).

- `MathReward(mode="binary")`: 1.0 correct / 0.0 otherwise; `mode="pm1"`: +1 / -1 (DAPO style).
- `format_penalty`: subtracted when no final answer could be extracted.
- `require_think_close`: the answer counts only after `</think>` (DeepScaleR style); a response
  without `</think>` scores as unanswered.
Each call returns `(reward, info)` with the verdict in `info`. `slime_reward` is the slime plug-in form.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from slime_env.envs.math.extract import FORMATS
from slime_env.envs.math.verifier import MathVerifier, Verdict, shared_verifier


@dataclass
class MathReward:
    """Scores a response against a gold label with a `MathVerifier` (a shared one by default)."""

    mode: str = "binary"
    format_penalty: float = 0.0
    require_think_close: bool = False
    formats: Sequence[str] = FORMATS
    verifier: MathVerifier | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("binary", "pm1"):
            raise ValueError(f"MathReward mode must be 'binary' or 'pm1', got {self.mode!r}")

    async def __call__(self, response: str, label: Any) -> tuple[float, dict[str, Any]]:
        verifier = self.verifier or shared_verifier()
        if self.require_think_close:
            head, sep, tail = response.rpartition("</think>")
            if not sep:
                verdict = Verdict(False, None, "no_answer", reason="no </think> before the answer")
            else:
                verdict = await verifier.verify(tail, label, formats=self.formats)
        else:
            verdict = await verifier.verify(response, label, formats=self.formats)
        return self.score(verdict), verdict.to_dict()

    def score(self, verdict: Verdict) -> float:
        low = 0.0 if self.mode == "binary" else -1.0
        reward = 1.0 if verdict.correct else low
        if verdict.extracted is None:
            reward -= self.format_penalty
        return reward


def _math_reward(args: Any) -> MathReward:
    return MathReward(mode=getattr(args, "math_reward_mode", "binary"),
                      format_penalty=float(getattr(args, "math_format_penalty", 0.0)),
                      require_think_close=bool(getattr(args, "math_require_think_close", False)))


async def slime_reward(args: Any, sample: Any, **kwargs: Any) -> float | list[float]:
    """slime `--custom-rm-path slime_env.envs.math.rewards.slime_reward`: `sample.response` against `sample.label`.

    slime's one-sample signature `(args, sample)`; a list is accepted too. Reads `math_reward_mode`
    ("binary"/"pm1"), `math_format_penalty` and `math_require_think_close` from `args` (set them in
    `--custom-config-path`).
    """
    if isinstance(sample, (list, tuple)):
        return await slime_group_reward(args, list(sample))
    return (await _math_reward(args)(sample.response, sample.label))[0]


async def slime_group_reward(args: Any, samples: list[Any], **kwargs: Any) -> list[float]:
    """slime `--custom-rm-path slime_env.envs.math.rewards.slime_group_reward` with `--group-rm`: `(args, samples)`."""
    reward = _math_reward(args)
    return [(await reward(s.response, s.label))[0] for s in samples]
