"""GPU tests: never run in CI (no GPU there). On a GPU machine: `python -m pytest tests/gpu -q`.

Every test here needs CUDA and skips with that reason without it; the two-GPU tests also need two GPUs."""

import os
import sys

import pytest
import torch

# tests/gpu imports helpers of tests/ as `tests.<module>`: the repository root must be importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (GPU tests run on the GPU machine, never in CI)")
        here = os.path.dirname(os.path.abspath(__file__))
        for item in items:  # this hook sees the whole session's items: mark only the ones in tests/gpu
            if str(item.path).startswith(here + os.sep):
                item.add_marker(skip)
