"""The Tinker SDK's wire formats: its protobuf `forward_backward` request in, its protobuf `ForwardBackwardOutput` and
`SampleResponse` out (the SDK sends `Accept: application/x-protobuf` for those two and refuses JSON for them).

The message classes are the SDK's own (`tinker.proto.tinker_public_pb2`), so the bytes are exactly what it reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from slime_env.errors import InvalidInput

_NP = {"float32": np.float32, "int64": np.int64, "int32": np.int32}


def _pb():
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


@dataclass(frozen=True, slots=True)
class Datum:
    """One training example: the input tokens and the loss function's named inputs (flat arrays)."""
    tokens: np.ndarray
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ForwardBackwardCall:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    data: list[Datum]


def _tensor(msg, name: str, index: int) -> np.ndarray:
    pb = _pb()
    dtypes = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
    if msg.dtype not in dtypes:
        raise InvalidInput(f"datum {index}: loss_fn_inputs[{name!r}] has an unsupported dtype ({msg.dtype})")
    if msg.HasField("sparse_csr"):
        raise InvalidInput(f"datum {index}: loss_fn_inputs[{name!r}] is sparse; this server takes dense tensors only")
    arr = np.frombuffer(msg.dense, dtype=dtypes[msg.dtype])
    shape = list(msg.shape)
    if shape and int(np.prod(shape)) != arr.size:
        raise InvalidInput(f"datum {index}: loss_fn_inputs[{name!r}] has shape {shape} but {arr.size} values")
    return arr.reshape(shape) if shape else arr


def decode_forward_backward(body: bytes) -> ForwardBackwardCall:
    """The SDK's `ForwardBackwardRequest` proto (already un-zstd'ed) as plain arrays."""
    msg = _pb().ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # noqa: BLE001 - protobuf raises its own DecodeError
        raise InvalidInput(f"forward_backward: the body is not a ForwardBackwardRequest proto ({e})") from None
    config: dict[str, float | str] = dict(msg.loss_fn_config)
    for k, v in msg.loss_fn_config_v2.items():
        config[k] = v.text if v.WhichOneof("value") == "text" else v.number
    data = []
    for i, d in enumerate(msg.data):
        tokens = []
        for chunk in d.model_input:
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise InvalidInput(f"datum {i}: model_input has a {kind} chunk; this server takes text tokens only")
            tokens.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
        ids = np.concatenate(tokens).astype(np.int64) if tokens else np.zeros(0, np.int64)
        data.append(Datum(ids, {name: _tensor(t, name, i) for name, t in d.loss_fn_inputs.items()}))
    return ForwardBackwardCall(msg.model_id, msg.seq_id, msg.loss_fn, config, msg.forward_only, data)


def encode_forward_backward_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """Per-datum outputs (same field names in every datum) as one batched `ArrayRecord`."""
    pb = _pb()
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics={k: float(v) for k, v in metrics.items()})
    record = msg.loss_fn_outputs.add()
    record.num_datums = len(outputs)
    for name in (outputs[0] if outputs else {}):
        arrays = [np.ascontiguousarray(o[name]) for o in outputs]
        is_float = arrays[0].dtype.kind == "f"
        arrays = [a.astype(np.float32 if is_float else np.int64) for a in arrays]
        sizes = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        record.fields[name].CopyFrom(pb.BatchedTensor(
            data=b"".join(a.tobytes() for a in arrays), offsets=sizes.tobytes(),
            dtype=pb.DTYPE_FLOAT32 if is_float else pb.DTYPE_INT64, trailing_shape=list(arrays[0].shape[1:])))
    return msg.SerializeToString()


def encode_sample_response(sequences: list[tuple[list[int], list[float], str]],
                           prompt_logprobs: list[float] | None) -> bytes:
    """(tokens, log-probs, "stop" | "length") per sample, and the prompt's log-probs (NaN for its first token)."""
    pb = _pb()
    msg = pb.SampleResponse()
    for tokens, logprobs, stop in sequences:
        msg.sequences.add(stop_reason=pb.STOP_REASON_STOP if stop == "stop" else pb.STOP_REASON_LENGTH,
                          tokens=np.asarray(tokens, np.int32).tobytes(),
                          logprobs=np.asarray(logprobs, np.float32).tobytes())
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, np.float32).tobytes()
    return msg.SerializeToString()
