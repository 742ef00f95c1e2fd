"""Cutting an observation (tool output, test feedback) to a token budget without a tokenizer in the env.

Envs never tokenize; a budget is kept approximately (≈4 characters a token) unless the caller passes a
`count_tokens` function (e.g. `lambda s: len(tok.encode(s))`). The head and the tail are kept: errors
and tracebacks end a text.
"""

from __future__ import annotations

from collections.abc import Callable


def truncate_to_budget(text: str, budget_tokens: int, count_tokens: Callable[[str], int] | None = None) -> str:
    """`text` cut to about `budget_tokens` tokens, keeping about 2/3 head and 1/3 tail, with a marker."""
    if count_tokens is None:
        limit = budget_tokens * 4
        if len(text) <= limit:
            return text
        head = limit * 2 // 3
        return f"{text[:head]}\n... [{len(text) - limit} characters cut] ...\n{text[len(text) - (limit - head):]}"
    if count_tokens(text) <= budget_tokens:
        return text
    lo, hi = 0, len(text)
    while lo < hi:  # the longest head + tail that fits
        mid = (lo + hi + 1) // 2
        candidate = f"{text[:mid * 2 // 3]}\n... [cut] ...\n{text[len(text) - mid // 3:]}"
        lo, hi = (mid, hi) if count_tokens(candidate) <= budget_tokens else (lo, mid - 1)
    return f"{text[:lo * 2 // 3]}\n... [cut] ...\n{text[len(text) - lo // 3:]}"
