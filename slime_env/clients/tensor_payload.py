"""SGLang's `update_weights_from_tensor` payload: named tensors from a process on the same host.

`serialize_named_tensors([(name, tensor), ...])` pickles the list with torch's multiprocessing reductions
(`ForkingPickler`) and base64-encodes it, as SGLang's `MultiprocessingSerializer` does: a CUDA tensor travels as a
CUDA IPC handle (the receiver maps the sender's GPU memory, no copy through the host), a CPU tensor as shared
memory. A CUDA tensor's device travels as the GPU's UUID, not its index, as SGLang's `monkey_patch_torch_reductions`
sends and reads it: a receiver that sees other GPUs, or the same under other indices (an engine started with its own
CUDA_VISIBLE_DEVICES beside a trainer rank on GPU 3), finds the same GPU. The sender must keep the tensors alive
until the receiver has loaded them (the HTTP call returns after loading). The payload is a pickle: only a trusted
process on the same host may send it, which is why the engine server binds to loopback by default, as SGLang's does.
torch is imported on first use.
"""

from __future__ import annotations

import base64
import io
import os
import pickle
from collections.abc import Sequence
from typing import Any


def serialize_named_tensors(named_tensors: Sequence[tuple[str, Any]]) -> str:
    """base64 text of the pickled `[(name, tensor), ...]`; CPU tensors are copied into named shared memory.

    CPU tensors use torch's "file_system" sharing for this call only: the default "file_descriptor" strategy
    hands descriptors over a socket that only the sender's own child processes may connect to."""
    from multiprocessing.reduction import ForkingPickler

    import torch
    import torch.multiprocessing  # noqa: F401 - registers the tensor reductions with ForkingPickler

    items = _cpu_tensors_in_one_storage([(name, t.detach()) for name, t in named_tensors])
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        buf = io.BytesIO()
        pickler = ForkingPickler(buf)
        pickler.dispatch_table[torch.Tensor] = _reduce_by_uuid(pickler.dispatch_table[torch.Tensor])
        pickler.dump(items)
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _cpu_tensors_in_one_storage(items: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """The CPU tensors copied into views of one buffer (each at a 64-byte aligned offset); CUDA tensors as they are.

    "file_system" sharing asks torch's shared-memory manager process for every storage it shares, and gives up after
    one second without an answer (libshm): on a loaded machine one of a model's hundreds of storages timed out. With
    one storage the sender and each receiver ask once. Receivers see ordinary tensors (views with offsets)."""
    import torch

    cpu = [i for i, (_, t) in enumerate(items) if not t.is_cuda]
    offsets, total = [], 0
    for i in cpu:
        t = items[i][1]
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // 64) * 64
    flat = torch.empty(total, dtype=torch.uint8)
    out = list(items)
    for i, offset in zip(cpu, offsets):
        name, t = items[i]
        view = flat[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        view.copy_(t)
        out[i] = (name, view)
    return out


# The storage device's place among `rebuild_cuda_tensor`'s arguments (torch.multiprocessing.reductions; unchanged
# for years, and SGLang's patch relies on it too).
_DEVICE_ARG = 6


def _reduce_by_uuid(reduce: Any) -> Any:
    """torch's tensor reduction, with a CUDA storage's device index replaced by its GPU's UUID."""
    from torch.multiprocessing import reductions

    def reduce_tensor(tensor: Any) -> tuple[Any, tuple[Any, ...]]:
        fn, args = reduce(tensor)
        if fn is reductions.rebuild_cuda_tensor and isinstance(args[_DEVICE_ARG], int):
            args = (*args[:_DEVICE_ARG], _uuid(args[_DEVICE_ARG]), *args[_DEVICE_ARG + 1:])
        return fn, args
    return reduce_tensor


def _uuid(device: int) -> str:
    import torch

    return str(torch.cuda.get_device_properties(device).uuid)


def _device_of(device: int | str) -> int:
    """This process's index of a GPU named by its UUID (an index stays as it is), as SGLang resolves it."""
    import torch

    if isinstance(device, int):
        return device
    for i in range(torch.cuda.device_count()):
        if _uuid(i) == device:
            return i
    raise ValueError(f"a tensor lives on GPU {device}, which this process does not see "
                     f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")


def _rebuild_cuda_tensor(*args: Any) -> Any:
    from torch.multiprocessing import reductions

    return reductions.rebuild_cuda_tensor(*args[:_DEVICE_ARG], _device_of(args[_DEVICE_ARG]), *args[_DEVICE_ARG + 1:])


class _Unpickler(pickle.Unpickler):
    """Rebuilds CUDA tensors whose device is a GPU's UUID (or an index); everything else as pickle does."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return _rebuild_cuda_tensor
        return super().find_class(module, name)


def deserialize_named_tensors(payload: str | bytes) -> list[tuple[str, Any]]:
    """The `[(name, tensor), ...]` of `serialize_named_tensors` (CUDA tensors on their sender's device)."""
    import torch.multiprocessing  # noqa: F401 - the reductions that rebuild the tensors

    items = _Unpickler(io.BytesIO(base64.b64decode(payload))).load()
    if not isinstance(items, list) or not all(isinstance(i, tuple) and len(i) == 2 for i in items):
        raise ValueError("serialized_named_tensors must hold a list of (name, tensor) pairs")
    return items
