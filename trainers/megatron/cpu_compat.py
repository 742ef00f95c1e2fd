"""megatron-core on a machine without CUDA (the gloo tests in CI): sequence parallelism and the MoE layers.

megatron-core 0.16.1 allocates buffers with `device=torch.cuda.current_device()` throughout its
sequence-parallel collectives, its linear layers' backward, its global memory buffer and its MoE router, and
its sequence-parallel embedding forks the CUDA RNG tracker (for dropout, which our models do not use), and its
activation recompute saves and restores the CUDA RNG state around each recomputed block. Gloo has every
collective those paths call. So where CUDA is absent — and only there, in a process that runs megatron
(`parallel.init_parallel` calls this) — `torch.cuda.current_device()` answers the CPU device instead of raising,
the RNG fork is a no-op and the CUDA RNG state is empty (the CPU generator's state is still saved and restored
by megatron itself). Building a pipeline stage with tied embeddings moves the last stage's copy of the embedding
`.cuda()` before summing it over the embedding group: `building()` leaves tensors where they are while a model is
constructed. The pipeline schedules count tokens in a `torch.zeros(..., device="cuda")` (their module sees a
`torch` whose `zeros` puts that on the CPU) and their point-to-point exchange calls `torch.cuda.synchronize()` (a
no-op here: nothing runs asynchronously on a CPU). Where CUDA exists nothing changes.
"""

from __future__ import annotations

import contextlib
import types

import torch


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def install() -> None:
    """Apply the CPU stand-ins (see the module docstring); a no-op with CUDA, idempotent."""
    if torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = _cpu_device
    torch.cuda.synchronize = lambda *args, **kwargs: None
    mrandom.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None
    from megatron.core.pipeline_parallel import schedules

    schedules.torch = _TorchOnCPU("torch")


class _TorchOnCPU(types.ModuleType):
    """`torch` for megatron's schedules module on a machine without CUDA: `zeros(device="cuda")` lands on the CPU."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


@contextlib.contextmanager
def building():
    """While a megatron model is constructed on a machine without CUDA, `Tensor.cuda()` returns the tensor itself;
    with CUDA, nothing changes."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original
