"""Weight-sync channels to vLLM servers, over vLLM's own RL routes (`slime_env.clients.vllm.VLLMPolicy`).

Every push is one round of vLLM's protocol on every engine, the same whatever carries the bytes:

    POST /pause?mode=wait|keep|abort    (wait: requests in flight finish first; keep: they stay queued, frozen, and
                                          go on under the new weights after /resume — async `interrupt: resume`)
    the transfer (below)
    version `version` set               (/finish_weight_update {"weight_version"} or /update_weight_version)
    POST /weight_checker {"action": "checksum"}   compared: every engine holds the same tensors, and the tensors it
                                          holds under the trainer's own names are, bit for bit, the ones pushed
    POST /resume                        (also when the transfer failed: the engines go on with what they hold)

The transfers, by placement (`engine.weight_sync`, resolved in `slime_env.trainers.run.engines`):
- `VLLMDistributed` (`distributed`, engines on other GPUs): backend `nccl` of vLLM's weight-transfer engine. The
  trainer is rank 0 of an NCCL group with every engine's workers (`/init_weight_transfer_engine {"init_info":
  {"master_address", "master_port", "rank_offset", "world_size"}}`, once), then per bucket `/update_weights
  {"update_info": {"names", "dtype_names", "shapes"}}` to all engines while rank 0 broadcasts the tensors in that
  order, between `/start_weight_update` and `/finish_weight_update`. vLLM's NCCL rendezvous is its own
  (`StatelessProcessGroup` + `PyNcclCommunicator`), so the trainer's process needs `vllm` importable (the `vllm`
  extra); it is refused at the channel's creation otherwise.
- `VLLMFromTensor` (`tensor`, an engine on the trainer's GPU): backend `ipc`. `/init_weight_transfer_engine
  {"init_info": {"packed": false}}`, then one `/update_weights {"update_info": {"names", "dtype_names", "shapes",
  "ipc_handles_pickled"}}` (base64 pickle of one `{gpu_uuid: reduce_tensor args}` per tensor; the server needs
  `VLLM_ALLOW_INSECURE_SERIALIZATION=1` to accept it).
- `VLLMFromDisk` (`disk`, a shared filesystem; the only one a CPU build offers): a Hugging Face folder, then every
  worker's `reload_weights(weights_path=folder)` through `/collective_rpc` and `/update_weight_version`.

The server is started with `--weight-transfer-config '{"backend": "nccl"}'` (or `"ipc"`) for the first two.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import pickle
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from slime_env.agents.weight_layout import WeightLayout
from slime_env.errors import InvalidInput
from slime_env.trainers.distributed import free_port
from slime_env.trainers.weight_sync import _VersionFolders, _Servers, channel_for as _channel_for


class WeightSyncMismatch(RuntimeError):
    """After a push, an engine's checksums show other weights than those pushed (or than another engine's)."""


class _VLLMChannel(_Servers):
    """The round every vLLM push takes (see the module docstring); subclasses `_transfer`."""

    def __init__(self, engines: Callable[[], Sequence[Any]], layout: WeightLayout | None = None, *,
                 pause_mode: str = "wait", verify: bool = True):
        super().__init__(engines, layout)
        self.pause_mode, self.verify = pause_mode, verify

    async def push(self, weights: Mapping[str, torch.Tensor], version: str) -> dict[str, float]:
        engines = list(self.engines())
        if not engines:
            raise RuntimeError("no engine to send weights to")
        t0 = time.perf_counter()
        named = [(n, t.detach().contiguous()) for n, t in self.layout.engine_tensors(weights)]
        await asyncio.gather(*(e.pause(self.pause_mode) for e in engines))
        try:
            metrics = await self._transfer(engines, named, version)
            moved = time.perf_counter()
            if self.verify:
                metrics["sync/checked_tensors"] = float(await verify_checksums(engines, named))
                metrics["sync/check_s"] = time.perf_counter() - moved
        finally:
            await asyncio.gather(*(e.resume() for e in engines), return_exceptions=True)
        metrics["sync/s"] = time.perf_counter() - t0
        return metrics

    async def _transfer(self, engines: list[Any], named: list[tuple[str, torch.Tensor]],
                        version: str) -> dict[str, float]:
        raise NotImplementedError


class VLLMFromDisk(_VLLMChannel):
    """A model folder `folder/weights_{version}` every engine can read (written by `save(path)` when given): a temporary
    folder when `folder` is None; only the newest version is kept (`weight_sync._VersionFolders`). `scratch`: `folder`
    is this channel's alone, emptied now, its versions removed by `close`."""

    def __init__(self, engines: Callable[[], Sequence[Any]], *, folder: str | Path | None = None,
                 layout: WeightLayout | None = None, save: Callable[[Path], Any] | None = None,
                 scratch: bool = False, **kw: Any):
        super().__init__(engines, layout, **kw)
        self.versions, self.save = _VersionFolders(folder, scratch=scratch), save

    async def _transfer(self, engines: list[Any], named: list[tuple[str, torch.Tensor]],
                        version: str) -> dict[str, float]:
        t0 = time.perf_counter()
        path = self.versions.path(version)
        if self.save is not None:
            await asyncio.to_thread(self.save, path)
        else:
            await asyncio.to_thread(self.layout.save_folder, path, dict(named))
        saved = time.perf_counter()
        await asyncio.gather(*(e.reload_weights(str(path)) for e in engines))
        await asyncio.gather(*(e.update_weight_version(version) for e in engines))
        await asyncio.to_thread(self.versions.done, path)
        return {"sync/save_s": saved - t0, "sync/bytes": float(sum(t.numel() * t.element_size() for _, t in named))}

    async def close(self) -> None:
        self.versions.close()
        await super().close()


class VLLMFromTensor(_VLLMChannel):
    """CUDA IPC to engines that see the trainer's GPU (vLLM's `ipc` backend)."""

    def __init__(self, engines: Callable[[], Sequence[Any]], layout: WeightLayout | None = None, **kw: Any):
        super().__init__(engines, layout, **kw)
        self.joined: set[int] = set()

    async def _transfer(self, engines: list[Any], named: list[tuple[str, torch.Tensor]],
                        version: str) -> dict[str, float]:
        if any(not t.is_cuda for _, t in named):
            raise InvalidInput("engine.weight_sync tensor: vLLM's ipc backend takes CUDA tensors; this trainer's "
                               "weights are on the CPU (use weight_sync: disk)")
        fresh = [e for e in engines if id(e) not in self.joined]
        await asyncio.gather(*(e.init_weight_transfer_engine({"packed": False}) for e in fresh))
        self.joined |= {id(e) for e in fresh}
        info = ipc_update_info(named)
        await asyncio.gather(*(e.start_weight_update() for e in engines))
        await asyncio.gather(*(e.update_weights(info) for e in engines))
        await asyncio.gather(*(e.finish_weight_update(version) for e in engines))
        torch.cuda.synchronize()
        return {"sync/bytes": float(sum(t.numel() * t.element_size() for _, t in named))}


def ipc_update_info(named: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """vLLM's `IPCWeightTransferUpdateInfo` for these CUDA tensors, handles pickled for HTTP."""
    from torch.multiprocessing.reductions import reduce_tensor

    handles = []
    for _, t in named:
        uuid = str(torch.cuda.get_device_properties(t.device).uuid)
        handles.append({uuid: reduce_tensor(t)[1]})
    return {"names": [n for n, _ in named], "dtype_names": [_dtype_name(t) for _, t in named],
            "shapes": [list(t.shape) for _, t in named],
            "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode()}


class VLLMDistributed(_VLLMChannel):
    """vLLM's `nccl` backend to engines on other GPUs (see the module docstring); `bucket_bytes` bounds one
    `/update_weights` call."""

    def __init__(self, engines: Callable[[], Sequence[Any]], layout: WeightLayout | None = None, *,
                 master_address: str = "127.0.0.1", bucket_bytes: int = 512 << 20,
                 open_group: Callable[..., Any] | None = None, device: str | None = None, **kw: Any):
        super().__init__(engines, layout, **kw)
        if open_group is None:
            try:
                from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group
            except ImportError as err:
                raise InvalidInput("engine.weight_sync distributed to vLLM engines: the trainer joins vLLM's own "
                                   f"NCCL rendezvous, which needs vllm importable here ({err}); install vllm in the "
                                   "trainer's environment, or use weight_sync: disk") from None
            open_group = stateless_init_process_group
        # open_group(master_address, master_port, rank, world_size, device) -> a communicator with
        # broadcast(tensor, src=0): vLLM's PyNcclCommunicator (tests pass their own)
        self._open, self.device = open_group, device
        self.master_address, self.bucket_bytes = master_address, bucket_bytes
        self.group: Any = None
        self.members: tuple[int, ...] = ()

    async def _form(self, engines: list[Any]) -> None:
        sizes = [await e.world_size() for e in engines]
        world, port = 1 + sum(sizes), free_port()
        offsets = [1 + sum(sizes[:i]) for i in range(len(engines))]
        joins = [asyncio.ensure_future(e.init_weight_transfer_engine(
            {"master_address": self.master_address, "master_port": port, "rank_offset": off, "world_size": world}))
            for e, off in zip(engines, offsets)]
        try:
            self.group = await asyncio.to_thread(self._open, self.master_address, port, 0, world, self._device())
            await asyncio.gather(*joins)
        except BaseException:
            for j in joins:
                j.cancel()
            self.group = None
            raise
        self.members = tuple(id(e) for e in engines)

    async def _transfer(self, engines: list[Any], named: list[tuple[str, torch.Tensor]],
                        version: str) -> dict[str, float]:
        from slime_env.agents.weight_transfer import bucketed

        t0 = time.perf_counter()
        if self.group is None or self.members != tuple(id(e) for e in engines):
            await self._form(engines)
        formed = time.perf_counter()
        device = self._device()
        named = [(n, t.to(device)) for n, t in named]
        await asyncio.gather(*(e.start_weight_update() for e in engines))
        sent = 0
        try:
            for bucket in bucketed(named, self.bucket_bytes):
                info = {"names": [n for n, _ in bucket], "dtype_names": [_dtype_name(t) for _, t in bucket],
                        "shapes": [list(t.shape) for _, t in bucket]}
                calls = [asyncio.ensure_future(e.update_weights(info)) for e in engines]

                def send(bucket=bucket) -> None:
                    for _, t in bucket:
                        self.group.broadcast(t, src=0)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)

                await asyncio.to_thread(send)
                await asyncio.gather(*calls)
                sent += sum(t.numel() * t.element_size() for _, t in bucket)
        except BaseException:
            self.group = None  # a failed broadcast leaves the group unusable: a new one next time
            raise
        await asyncio.gather(*(e.finish_weight_update(version) for e in engines))
        return {"sync/group_s": formed - t0, "sync/bytes": float(sent)}

    def _device(self) -> torch.device:
        return torch.device(self.device) if self.device else torch.device("cuda", torch.cuda.current_device())

    async def close(self) -> None:
        if self.group is not None:
            await asyncio.gather(*(e.shutdown_weight_transfer_engine() for e in self.engines()),
                                 return_exceptions=True)
            self.group = None
        await super().close()


async def verify_checksums(engines: Sequence[Any], named: list[tuple[str, torch.Tensor]]) -> int:
    """Compare the engines' `/weight_checker` checksums after a push: all engines alike, and the tensors an engine
    holds as loaded — the embeddings and every 1-D tensor (norms, biases) — bit-identical to the pushed ones in the
    engine's dtype. vLLM fuses q/k/v and gate/up and may repack linear weights after loading (the CPU build does:
    `o_proj` and `down_proj` differ from the checkpoint's bytes), so matrices are compared among engines only.
    Returns how many tensors matched the trainer's; `WeightSyncMismatch` naming the engine and tensors otherwise."""
    sums = await asyncio.gather(*(e.weight_checksums() for e in engines))
    first = sums[0]
    for e, s in zip(engines[1:], sums[1:]):
        if s != first:
            differ = sorted(k for k in first.keys() | s.keys() if first.get(k) != s.get(k))
            raise WeightSyncMismatch(f"after the sync {e.url} holds other weights than {engines[0].url}: "
                                     f"{differ[:5]}{' ...' if len(differ) > 5 else ''}")
    if len({k.rsplit(":", 1)[0] for k in first}) > 1:  # several workers (tensor parallel): shards, not tensors
        return 0
    pushed = dict(named)
    held = {k.rsplit(":", 1)[-1]: v for k, v in first.items()}  # "dp0:pp0:pcp0:tp0:model.norm.weight" -> its name
    common = sorted(n for n in held if n in pushed and _as_loaded(n, pushed[n]))
    if not common:
        return 0
    wrong = await asyncio.to_thread(lambda: [n for n in common if held[n] not in _digests(pushed[n])])
    if wrong:
        raise WeightSyncMismatch(f"after the sync {engines[0].url} holds tensors other than those pushed: "
                                 f"{wrong[:5]}{' ...' if len(wrong) > 5 else ''} (sha256 differs in every dtype)")
    return len(common)


def _as_loaded(name: str, t: torch.Tensor) -> bool:
    """A tensor vLLM keeps with the bytes it loaded (see `verify_checksums`)."""
    return t.dim() == 1 or name.endswith(("embed_tokens.weight", "lm_head.weight"))


def _digests(t: torch.Tensor) -> set[str]:
    """sha256 of the tensor's bytes as vLLM's weight checker takes them, in each dtype the engine may hold."""
    out = set()
    for dtype in (t.dtype, torch.bfloat16, torch.float16, torch.float32):
        x = t.detach().to("cpu", dtype).contiguous().view(-1).view(torch.uint8).numpy()
        out.add(hashlib.sha256(x).hexdigest())
    return out


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).split(".")[-1]


def sha256_of(t: torch.Tensor) -> str:
    """vLLM's per-tensor checksum (`vllm/model_executor/model_loader/weight_checksum.py`) of a tensor."""
    return hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def channel_for(policy: Any, layout: WeightLayout, *, path: str | Path | None = None) -> Any:
    """The channel `trainer.sync(policy)` pushes through: `weight_sync.channel_for`'s, and for a vLLM server
    (`VLLMPolicy`) a model folder at `path` (a temporary folder if None) it reloads (`reload_weights`), adapters
    through `/v1/load_lora_adapter`."""
    if not hasattr(policy, "reload_weights"):
        return _channel_for(policy, layout, path=path)
    channel = VLLMFromDisk(lambda: [policy], folder=path, layout=layout)  # None: a temporary folder, removed by close
    if path is not None:  # adapters outlive the channel: vLLM reads one's folder when it takes it back into its cache
        channel.adapter_folder = Path(path)
    return channel
