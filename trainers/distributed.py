"""What the data-parallel trainers share: the process group, each rank's rows, lockstep micro-batches, the sums.

Every rank receives the same trajectories. `balanced_ranges` gives each rank a contiguous, token-balanced share of
a mini-batch's rows; `lockstep` appends empty micro-batches so that every rank runs as many forward and backward
passes (FSDP gathers parameters, expert parallelism exchanges tokens, in each one: a rank that ran fewer would
hang its group); `reduce_stats` sums the ranks' token-weighted partial statistics.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group() -> tuple[int, int]:
    """Join (once) torchrun's job — RANK / WORLD_SIZE / LOCAL_RANK set; NCCL on CUDA, gloo otherwise — or start a
    one-process group on a free loopback port, so the same trainer runs in a notebook, in CI and on a GPU node.
    Returns (rank, world size)."""
    if not dist.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group("nccl" if cuda else "gloo")
        else:
            dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                    rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def balanced_ranges(lengths: list[int], parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous row ranges whose token counts are as even as a greedy cut allows (some may be empty)."""
    total = sum(lengths)
    bounds, acc, row = [0], 0, 0
    for p in range(1, parts):
        target = total * p / parts
        while row < len(lengths) and acc + lengths[row] / 2 <= target:
            acc += lengths[row]
            row += 1
        bounds.append(row)
    bounds.append(len(lengths))
    return list(zip(bounds, bounds[1:]))


def token_budget_slices(lengths: list[int], start: int, stop: int, budget: int) -> list[slice]:
    """Consecutive rows of [start, stop) in chunks of at most `budget` tokens (a longer row goes alone)."""
    out, a, used = [], start, 0
    for i in range(start, stop):
        if i > a and used + lengths[i] > budget:
            out.append(slice(a, i))
            a, used = i, 0
        used += lengths[i]
    if stop > a:
        out.append(slice(a, stop))
    return out


def padded_slices(lengths: list[int], start: int, stop: int, rows: int, budget: int) -> list[slice]:
    """Consecutive rows of [start, stop), at most `rows` at a time and at most `budget` tokens once padded (the rows
    times the longest of them; a longer row goes alone): the micro-batches of a trainer that pads its rows."""
    out, a, longest = [], start, 0
    for i in range(start, stop):
        wider = max(longest, lengths[i])
        if i > a and (i - a >= rows or (i - a + 1) * wider > budget):
            out.append(slice(a, i))
            a, wider = i, lengths[i]
        longest = wider
    if stop > a:
        out.append(slice(a, stop))
    return out


def lockstep(per_rank: Sequence[list[slice]], rank: int) -> list[slice]:
    """`rank`'s micro-batches with empty ones appended up to the most any rank has."""
    own = list(per_rank[rank])
    end = own[-1].stop if own else 0
    return own + [slice(end, end)] * (max(map(len, per_rank)) - len(own))


def reduce_stats(stats: dict[str, float], keys: Iterable[str], group: Any, device: torch.device) -> dict[str, float]:
    """Sum each rank's partial `stats` over `group`; every rank reduces `keys` and its own (a rank with no tokens
    reports none, so the caller names the keys every rank must send)."""
    names = sorted(set(keys) | set(stats))
    t = torch.tensor([stats.get(k, 0.0) for k in names], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return dict(zip(names, t.tolist()))
