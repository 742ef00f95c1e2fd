"""Token ids <-> text through a Hugging Face tokenizer, the way the ledger needs it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class TokenCodec:
    """`encode` never adds special tokens (chat templates write them) and `decode` never skips them.

    Calls the Rust tokenizer directly when there is one: the same ids, a third less overhead.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)

    def encode(self, text: str) -> list[int]:
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=False)
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)
