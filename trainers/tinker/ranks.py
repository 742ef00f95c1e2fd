"""`serve-tinker` over several ranks (torchrun): rank 0 serves, every rank runs each training call.

The trainers' split-step methods are collectives (FSDP gathers parameters, Megatron exchanges TP shards and sums DP
gradients), so every rank must make the same calls in the same order. `Leader` wraps rank 0's `TinkerBackend`: each
training call the server's worker thread makes is first broadcast (a small pickled record: the method and its
arguments; a call's data are small arrays) over a gloo group of its own, then run here; results come from rank 0
(the split step reports global losses and norms on every rank). `follow` is the other ranks' loop: receive, run the
same method on their own backend, until `close` sends the shutdown record. Sampling stays on rank 0.

A follower waits for the next call as long as the server idles (the group's timeout is a week); if rank 0 dies, the
group's connection breaks and the follower raises, and torchrun ends the job.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch.distributed as dist

log = logging.getLogger(__name__)

# The TinkerBackend methods that reach a trainer (collectives); everything else is rank 0's alone.
# free_session is not a collective, but every rank holds the finished session's trainers: each frees its own.
COLLECTIVE = ("create_model", "forward_backward", "optim_step", "save_state", "load_state", "save_for_sampler",
              "free_session")
IDLE = timedelta(days=7)  # how long a follower waits for the next call


def command_group() -> Any:
    """The gloo group the calls travel on (every rank creates it, in the same order): CPU objects, an idle-long
    timeout, apart from the trainers' NCCL group."""
    return dist.new_group(backend="gloo", timeout=IDLE)


def _receive(group: Any) -> Any:
    box = [None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


class Leader:
    """Rank 0's backend: `COLLECTIVE` calls broadcast to the other ranks, then run here; the rest is the backend's.
    `close` ends the followers."""

    def __init__(self, backend: Any, group: Any):
        self._backend, self._group, self._closed = backend, group, False

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._backend, name)
        if name not in COLLECTIVE:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            dist.broadcast_object_list([(name, args, kwargs)], src=0, group=self._group)
            return attr(*args, **kwargs)

        return call

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            dist.broadcast_object_list([None], src=0, group=self._group)  # the shutdown record
        self._backend.close()


def follow(backend: Any, group: Any) -> int:
    """A non-zero rank: run each broadcast call on `backend` until the shutdown record; returns the calls run. A
    call that fails here failed on rank 0 too (same data, same checks): it is logged and the loop goes on."""
    calls = 0
    while (record := _receive(group)) is not None:
        name, args, kwargs = record
        calls += 1
        try:
            getattr(backend, name)(*args, **kwargs)
        except Exception as e:  # rank 0 answers the client; this rank stays in step
            log.info("rank %d: %s failed as on rank 0: %s", dist.get_rank(), name, e)
    backend.close()
    return calls
