"""`update_weights_from_tensor`'s payload (slime_env.clients.tensor_payload): CPU tensors through shared memory, and
a CUDA tensor's device named by its GPU's UUID both ways, as SGLang's `monkey_patch_torch_reductions` does, so an
engine that sees the sender's GPU under another index (its own CUDA_VISIBLE_DEVICES) rebuilds it there. The CUDA
side runs on GPUs (tests/gpu/test_megatron_gpu.py); here the device translation, with torch.cuda's answers given."""

from __future__ import annotations

import base64
import pickle
from types import SimpleNamespace

import pytest
import torch
from torch.multiprocessing import reductions

from slime_env.clients import tensor_payload as tp


def test_cpu_tensors_round_trip_through_shared_memory():
    named = [("a", torch.arange(6, dtype=torch.float32).view(2, 3)), ("b", torch.ones(3, dtype=torch.bfloat16))]
    back = tp.deserialize_named_tensors(tp.serialize_named_tensors(named))
    assert [n for n, _ in back] == ["a", "b"] and all(torch.equal(x, y) for (_, x), (_, y) in zip(named, back))


def test_a_models_cpu_tensors_travel_in_one_shared_storage():
    """One storage for every CPU tensor, whatever its dtype, shape or layout: torch's shared-memory manager is asked
    once per storage and gives up after a second without an answer (a loaded machine timed out on one of a model's
    hundreds); the receiver still gets each tensor's own values."""
    named = [(f"w{i}", torch.randn(5, 3)) for i in range(50)] + [
        ("bf16", torch.randn(7).bfloat16()), ("flag", torch.tensor(True)), ("t", torch.randn(4, 6).t()),
        ("empty", torch.empty(0))]
    back = tp.deserialize_named_tensors(tp.serialize_named_tensors(named))
    assert len({t.untyped_storage().data_ptr() for _, t in back}) == 1
    for (name, want), (got_name, got) in zip(named, back):
        assert got_name == name and got.dtype == want.dtype and torch.equal(got, want), name


class _Cuda:
    """What a CUDA tensor's reduction pickles to: torch's rebuild function and its arguments."""

    def __init__(self, args):
        self.args = args

    def __reduce__(self):
        return reductions.rebuild_cuda_tensor, self.args


def test_the_device_travels_as_its_gpus_uuid_and_comes_back_as_the_receivers_index(monkeypatch):
    uuids = ["GPU-aaaa", "GPU-bbbb"]  # the sender sees both; the receiver below sees the second alone
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=uuids[i]))
    args = ("cls", (4,), (1,), 0, "storage", torch.float32, 1, b"handle", 16, 0, False, b"ref", 0, b"event", True)

    def reduce(tensor):
        return reductions.rebuild_cuda_tensor, args

    fn, sent = tp._reduce_by_uuid(reduce)(None)
    assert fn is reductions.rebuild_cuda_tensor and sent[tp._DEVICE_ARG] == "GPU-bbbb"
    assert sent[:tp._DEVICE_ARG] + sent[tp._DEVICE_ARG + 1:] == args[:tp._DEVICE_ARG] + args[tp._DEVICE_ARG + 1:]

    payload = base64.b64encode(pickle.dumps([("w", _Cuda(sent))]))
    old_style = base64.b64encode(pickle.dumps([("w", _Cuda(args[:6] + (0,) + args[7:]))]))
    rebuilt = []
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", lambda *a: rebuilt.append(a) or "tensor")
    uuids[:] = ["GPU-bbbb"]  # the engine's process: CUDA_VISIBLE_DEVICES names the sender's second GPU alone
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert tp.deserialize_named_tensors(payload) == [("w", "tensor")]
    assert rebuilt[0][tp._DEVICE_ARG] == 0  # the same GPU, under the receiver's index
    tp.deserialize_named_tensors(old_style)  # an index (an unpatched SGLang sender's) is taken as it is
    assert rebuilt[1][tp._DEVICE_ARG] == 0
    uuids[:] = ["GPU-cccc"]
    with pytest.raises(ValueError, match=r"GPU GPU-bbbb, which this process does not see \(CUDA_VISIBLE_DEVICES="):
        tp.deserialize_named_tensors(payload)
