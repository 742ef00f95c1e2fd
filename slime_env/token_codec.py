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

    def encode_plain(self, text: str) -> list[int]:
        """`text` with the tokenizer's special tokens spelled as the characters they are (`<|im_start|>` as `<`,
        `|`, `im`, ...), never as control tokens: for text a template did not write (`split_special_tokens`)."""
        if self._backend is not None:
            plain = self.__dict__.get("_plain")
            if plain is None:  # a copy: the shared tokenizer keeps parsing special tokens for everyone else
                from tokenizers import Tokenizer

                plain = self.__dict__["_plain"] = Tokenizer.from_str(self._backend.to_str())
                plain.encode_special_tokens = True
            return plain.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))

    def decode(self, ids: Sequence[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=False)
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)
