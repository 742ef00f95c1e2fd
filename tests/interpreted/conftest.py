"""Tests of the Triton kernels in Triton's interpreter (numpy, on the CPU), run in their own process.

The interpreter is chosen when Triton is first imported, so these tests only run in a process started with
`TRITON_INTERPRET=1` — tests/test_paged_engine.py starts one (`python -m pytest tests/interpreted`); in any other
process they skip. Triton 3.6's interpreter turns a loaded scalar into a one-element array that numpy >= 2.4
refuses to convert with `int()` (a loop bounded by a loaded length fails): the patch below converts it the way
numpy allows. The interpreter's bfloat16 `tl.dot` multiplies raw bits (numpy has no bfloat16), so float32 and
float16 are checked here and bfloat16 on the GPU (tests/gpu/test_paged_gpu.py)."""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":
    triton = pytest.importorskip("triton", reason="Triton is not installed")
    import triton.runtime.interpreter as _interpreter

    _original = _interpreter._patch_lang_tensor

    def _patched(tensor, scope):
        _original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interpreter._patch_lang_tensor = _patched


def pytest_collection_modifyitems(config, items):
    if os.environ.get("TRITON_INTERPRET") != "1":
        skip = pytest.mark.skip(reason="Triton-interpreter tests run in their own process "
                                       "(tests/test_paged_engine.py::test_triton_kernels_in_the_interpreter)")
        here = os.path.dirname(os.path.abspath(__file__))
        for item in items:
            if str(item.path).startswith(here + os.sep):
                item.add_marker(skip)
