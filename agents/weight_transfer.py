"""Weights between processes without a disk round trip, in the two shapes SGLang takes them.

- Same host: `update_weights_from_tensor`'s payload (below).
- Any host: a torch.distributed group between the trainer's rank 0 and every engine rank, which the trainer
  broadcasts each tensor over (`update_weights_from_distributed`). `open_update_group` forms it the way SGLang's
  engines do (a TCP rendezvous at `master_address:master_port`, the store prefixed with the group's name, a process
  group of its own beside any default one), so the same trainer code drives SGLang servers and `serve-engine`.

Same host:

`serialize_named_tensors([(name, tensor), ...])` pickles the list with torch's multiprocessing reductions
(`ForkingPickler`) and base64-encodes it, as SGLang's `MultiprocessingSerializer` does: a CUDA tensor travels
as a CUDA IPC handle (the receiver maps the sender's GPU memory, no copy through the host), a CPU tensor
as shared memory. The sender must keep the tensors alive until the receiver has loaded them (the HTTP
call returns after loading). The payload is a pickle: only a trusted process on the same host may send it,
which is why the engine server binds to loopback by default, as SGLang's does.
"""

from __future__ import annotations

import base64
import inspect
import io
import pickle
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401 - registers the tensor reductions with ForkingPickler


def serialize_named_tensors(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> str:
    """base64 text of the pickled `[(name, tensor), ...]`; CPU tensors are copied into named shared memory.

    CPU tensors use torch's "file_system" sharing for this call only: the default "file_descriptor" strategy
    hands descriptors over a socket that only the sender's own child processes may connect to."""
    items = [(name, t.detach() if t.is_cuda else t.detach().clone()) for name, t in named_tensors]
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        buf = io.BytesIO()
        ForkingPickler(buf).dump(items)
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def deserialize_named_tensors(payload: str | bytes) -> list[tuple[str, torch.Tensor]]:
    """The `[(name, tensor), ...]` of `serialize_named_tensors` (CUDA tensors on their sender's device)."""
    items = pickle.loads(base64.b64decode(payload))
    if not isinstance(items, list) or not all(isinstance(i, tuple) and len(i) == 2 for i in items):
        raise ValueError("serialized_named_tensors must hold a list of (name, tensor) pairs")
    return items


def open_update_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                      backend: str, timeout_s: float = 600.0) -> Any:
    """Join (rank 0 hosts the rendezvous) the weight-update group and return its process group. Blocks until all
    `world_size` ranks have joined. Independent of torch.distributed's default group, which may or may not exist."""
    from datetime import timedelta

    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                              timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    options = "backend_options" if "backend_options" in inspect.signature(_new_process_group_helper).parameters \
        else "pg_options"
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                         timeout=timeout, **{options: None})
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def close_update_group(group: Any, abort: bool = False) -> None:
    """Tear the group down (with every other rank at once: see `slime_env.trainers.weight_sync.Distributed`); `abort` it
    first where a rank is gone. Either way its name leaves this process's registry."""
    import torch.distributed as dist

    if abort:
        try:
            group.abort()
        except (AttributeError, RuntimeError):  # a backend without abort (gloo): the destroy below is local
            pass
    try:
        dist.destroy_process_group(group)
    except (AssertionError, RuntimeError, ValueError):  # never registered with the default world: drop it
        pass


def broadcast(tensor: torch.Tensor, group: Any) -> None:
    """Broadcast `tensor` from rank 0 of `group` (in place on the receivers)."""
    import torch.distributed as dist

    dist.broadcast(tensor, src=0, group=group)


def bucketed(named: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive buckets of at most `bucket_bytes` (a larger tensor goes alone): each is one update call, so the
    receiving side holds one bucket at a time."""
    out: list[list[tuple[str, torch.Tensor]]] = [[]]
    used = 0
    for name, t in named:
        size = t.numel() * t.element_size()
        if out[-1] and used + size > bucket_bytes:
            out.append([])
            used = 0
        out[-1].append((name, t))
        used += size
    return [b for b in out if b]
