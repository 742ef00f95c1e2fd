"""The paged engine's K/V block pool: fixed-size blocks, reference counts, and a prefix cache by block content.

A sequence's K/V lives in blocks of `block_size` tokens anywhere in one preallocated pool
(`slime_env.agents.model_runner`); its block table lists them in order. A block that is full holds the K/V of a known
run of tokens after a known prefix, so it is named by a chain digest — blake2b(digest of the previous block ‖ this
block's token ids) — and any later sequence whose ids start with the same tokens reuses it instead of recomputing: the
next turn of an episode (its prompt extends the last one), the n samples of a GRPO group (one shared prompt), retries.
Shared blocks are only ever full ones, so nobody writes into a block someone else reads.

A block whose last user releases it keeps its K/V and digest and goes to the end of the free list; allocation
takes from the front, so the least recently used cached block is evicted first. New weights make every cached
block wrong: `clear()` forgets all digests. Block 0 is reserved: padded rows of a CUDA-graph batch write there.

Pure Python, no torch: the engine calls it on its own thread.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

SCRATCH = 0  # the reserved block padded rows write into


def chain_digest(previous: bytes, tokens: Sequence[int]) -> bytes:
    """The name of a full block: its tokens after the prefix named by `previous` (b"" for the first block)."""
    return hashlib.blake2b(previous + array("q", tokens).tobytes(), digest_size=16).digest()


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than asked for."""


class BlockPool:
    """`num_blocks` blocks of `block_size` tokens (block 0 reserved). See the module docstring.

    `allocate(n)` / `release(blocks)` move blocks between sequences and the free list; `match(ids)` returns the
    cached blocks of the longest full-block prefix of `ids` (taking a reference on each); `register(block, digest)`
    names a block once it is full. `hits`, `misses` and `reused_tokens` count `match` calls.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2 or block_size < 1:
            raise ValueError(f"a block pool needs >= 2 blocks of >= 1 token, got {num_blocks} x {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refs = [0] * num_blocks
        self.digest: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        # Blocks nobody holds, least recently released first (dict order; O(1) removal from the middle).
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.refs[SCRATCH] = 1  # never allocated, never freed
        self.hits = self.misses = self.reused_tokens = 0

    # --- counts ---------------------------------------------------------------------------------------------
    def num_free(self) -> int:
        return len(self.free)

    @property
    def tokens(self) -> int:
        """Tokens whose K/V is named and reusable (held or free)."""
        return len(self.cached) * self.block_size

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # --- allocation -----------------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """`n` blocks for one sequence to write into (the least recently used cached ones are evicted)."""
        if n > len(self.free):
            raise OutOfBlocks(f"asked for {n} K/V blocks, {len(self.free)} free")
        out = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            self._forget(block)
            self.refs[block] = 1
            out.append(block)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; a block nobody holds goes to the end of the free list (kept cached).
        Last blocks first: a sequence's tail is evicted before its prefix, which more sequences share and
        without which the tail can never be matched."""
        for block in reversed(blocks):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free[block] = None
            elif self.refs[block] < 0:
                raise AssertionError(f"block {block} released more often than taken")

    # --- the prefix cache -----------------------------------------------------------------------------------
    def match(self, ids: Sequence[int], *, limit: int | None = None) -> tuple[list[int], list[bytes]]:
        """(blocks, digests) of the longest run of cached full blocks that `ids` starts with, at most `limit`
        blocks; each block gets a reference (the caller releases it with the rest of its blocks)."""
        bs = self.block_size
        most = len(ids) // bs if limit is None else min(limit, len(ids) // bs)
        blocks, digests, previous = [], [], b""
        for i in range(most):
            d = chain_digest(previous, ids[i * bs:(i + 1) * bs])
            block = self.cached.get(d)
            if block is None:
                break
            blocks.append(block)
            digests.append(d)
            previous = d
        for block in blocks:
            if self.refs[block] == 0:
                del self.free[block]
            self.refs[block] += 1
        if blocks:
            self.hits += 1
            self.reused_tokens += len(blocks) * bs
        else:
            self.misses += 1
        return blocks, digests

    def register(self, block: int, digest: bytes) -> None:
        """Name a full block by its chain digest so later sequences can reuse it. If another block already holds
        the same tokens (two samples that wrote the same text), the first one stays the cached copy."""
        if digest in self.cached or self.digest[block] is not None:
            return
        self.digest[block] = digest
        self.cached[digest] = block

    def clear(self) -> None:
        """Forget every digest (new weights: no cached K/V is valid any more). Blocks in use stay in use."""
        self.cached.clear()
        self.digest = [None] * self.num_blocks

    def _forget(self, block: int) -> None:
        d = self.digest[block]
        if d is not None:
            self.digest[block] = None
            if self.cached.get(d) == block:
                del self.cached[d]
