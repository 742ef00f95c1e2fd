"""SGLang's `update_weights_from_tensor` payload: named tensors from a process on the same host.

`serialize_named_tensors([(name, tensor), ...])` pickles the list with torch's multiprocessing reductions
(`ForkingPickler`) and base64-encodes it, as SGLang's `MultiprocessingSerializer` does: a CUDA tensor travels
as a CUDA IPC handle (the receiver maps the sender's GPU memory, no copy through the host), a CPU tensor
as shared memory. The sender must keep the tensors alive until the receiver has loaded them (the HTTP
call returns after loading). The payload is a pickle: only a trusted process on the same host may send it,
which is why the engine server binds to loopback by default, as SGLang's does. torch is imported on first use.
"""

from __future__ import annotations

import base64
import io
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

    items = [(name, t.detach() if t.is_cuda else t.detach().clone()) for name, t in named_tensors]
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        buf = io.BytesIO()
        ForkingPickler(buf).dump(items)
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def deserialize_named_tensors(payload: str | bytes) -> list[tuple[str, Any]]:
    """The `[(name, tensor), ...]` of `serialize_named_tensors` (CUDA tensors on their sender's device)."""
    import torch.multiprocessing  # noqa: F401 - the reductions that rebuild the tensors

    items = pickle.loads(base64.b64decode(payload))
    if not isinstance(items, list) or not all(isinstance(i, tuple) and len(i) == 2 for i in items):
        raise ValueError("serialized_named_tensors must hold a list of (name, tensor) pairs")
    return items
