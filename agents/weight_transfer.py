"""Weights between processes without a disk round trip, in the two shapes SGLang takes them.

- Same host: `update_weights_from_tensor`'s payload (`slime_env.clients.tensor_payload`).
- Any host: a torch.distributed group between the trainer's rank 0 and every engine rank, which the trainer
  broadcasts each tensor over (`update_weights_from_distributed`). `open_update_group` forms it the way SGLang's
  engines do (a TCP rendezvous at `master_address:master_port`, the store prefixed with the group's name, a process
  group of its own beside any default one), so the same trainer code drives SGLang servers and `serve-engine`.

The same-host payload (`serialize_named_tensors` / `deserialize_named_tensors`) is the SGLang client's
(`slime_env.clients.tensor_payload`), re-exported here for the engine server.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from slime_env.clients.tensor_payload import deserialize_named_tensors, serialize_named_tensors  # noqa: F401


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
