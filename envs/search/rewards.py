"""Search-R1 answer rewards: exact match after SQuAD normalisation (default), substring EM, token F1.

Each metric is a small function `(prediction, golds) -> float`; `SearchReward` adds Search-R1's format
score (awarded to a well-formed but wrong answer) and handles a missing answer (0).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass


def normalize_answer(s: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def _golds(golds: str | Sequence[str]) -> list[str]:
    return [golds] if isinstance(golds, str) else [str(g) for g in golds]


def exact_match(prediction: str, golds: str | Sequence[str]) -> float:
    p = normalize_answer(prediction)
    return float(any(p == normalize_answer(g) for g in _golds(golds)))


def substring_exact_match(prediction: str, golds: str | Sequence[str]) -> float:
    p = normalize_answer(prediction)
    return float(any(normalize_answer(g) in p for g in _golds(golds)))


def f1_score(prediction: str, golds: str | Sequence[str]) -> float:
    """Token F1 (SQuAD), the best over the gold answers."""
    pred = normalize_answer(prediction).split()
    best = 0.0
    for g in _golds(golds):
        gold = normalize_answer(g).split()
        common = sum((Counter(pred) & Counter(gold)).values())
        if common:
            precision, recall = common / len(pred), common / len(gold)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


METRICS: dict[str, Callable[[str, str | Sequence[str]], float]] = {
    "em": exact_match, "subem": substring_exact_match, "f1": f1_score}


@dataclass
class SearchReward:
    """`metric` em / subem / f1 (or any `(prediction, golds) -> float`); `format_score` is given to an
    answer that was well formed but scored 0 (Search-R1's option); no answer scores 0."""

    metric: str | Callable[[str, str | Sequence[str]], float] = "em"
    format_score: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.metric, str) and self.metric not in METRICS:
            raise ValueError(f"unknown metric {self.metric!r}; use one of {sorted(METRICS)} or a callable")

    def __call__(self, answer: str | None, golds: str | Sequence[str]) -> float:
        if answer is None:
            return 0.0
        fn = METRICS[self.metric] if isinstance(self.metric, str) else self.metric
        score = float(fn(answer, golds))
        return score if score > 0 else self.format_score
