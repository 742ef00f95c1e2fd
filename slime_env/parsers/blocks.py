"""`<tool_call>...</tool_call>` blocks, shared by the parsers whose calls live in them."""

from __future__ import annotations

import re

from slime_env.types import ParseError

_OPEN = "<tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def tool_call_blocks(text: str) -> tuple[list[re.Match], ParseError | None]:
    """Every complete block (group 1 is its body), and an error for a block opened after the last
    complete one but never closed (e.g. cut by max_new_tokens)."""
    blocks = list(_BLOCK.finditer(text))
    tail = text[blocks[-1].end():] if blocks else text
    unclosed = ParseError("<tool_call> is not closed", tail[tail.index(_OPEN):]) if _OPEN in tail else None
    return blocks, unclosed
