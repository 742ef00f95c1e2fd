"""The weight-sync channels: the trainer's new weights reach every engine before the next generation.

One channel per run, chosen by `engine.weight_sync` in the run config and made by `slime_env.trainers.run.channel.
make_channel`, and one per call of `trainer.sync(policy)` (`channel_for`): the run and the library API push through the
same objects. What a push carries, the full weights or a LoRA adapter alone, is decided once, in `push_trainer`.

- `InPlace` — the embedded `TransformersPolicy`: `update_weights(state_dict)` in the trainer's process.
- `Distributed` — servers (SGLang, `serve-engine`) on any host: SGLang's `update_weights_from_distributed`, a
  torch.distributed group of the trainer (rank 0) and every engine rank; each bucket of tensors is announced over
  HTTP to all engines while rank 0 broadcasts it (NCCL on GPUs, gloo on CPUs).
- `FromTensor` — servers on this host: SGLang's `update_weights_from_tensor`, CUDA IPC handles (shared memory on
  CPUs).
- `FromDisk` — servers sharing a filesystem: a Hugging Face folder, then `update_weights_from_disk`.
- `Frozen` — nothing (evaluation-only runs).

Every channel keeps the `WeightChannel` contract (`slime_env.trainers.run.roles`): `await channel.push(weights,
version)` with `weights` the trainer's HF-named tensors in its model's layout, `await channel.close()`. Whatever leaves
the trainer's process leaves in the **engine-bound layout**, decided here and nowhere else: `layout.engine_tensors`
(`slime_env.agents.weight_layout`: one matrix per MoE expert as SGLang / vLLM / checkpoints name them, one copy of
tied embeddings, the layout's dtype). `InPlace` hands the model's own layout to a model of the same class.

No request sees half of a new set: an update that takes several calls (`Distributed`'s buckets) is wrapped in
`/pause_generation` ... `/continue_generation`; a one-call update is atomic on the engine (it admits nothing, lets the
running requests finish, then loads). A channel over servers takes `engines()`, a function returning the live
engines: when the set changes (an engine died and was restarted), `Distributed` forms a new group with the engines
there are. `push` returns seconds and bytes for the metrics.
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from slime_env.agents.weight_layout import WeightLayout
from slime_env.errors import InvalidInput
from slime_env.trainers.distributed import free_port

if TYPE_CHECKING:
    from slime_env.agents.lora_adapter import LoRAAdapter


class WeightSource(Protocol):
    """What a push takes its tensors from: a trainer (`TorchTrainer` and the backends built on it)."""

    @property
    def syncs_adapter(self) -> bool:
        """Whether a push sends the LoRA adapter alone (`trainer.lora.sync: adapter`)."""
        ...

    def adapter(self) -> LoRAAdapter:
        """The current LoRA adapter (a collective where the weights are sharded)."""
        ...

    def weights(self) -> Mapping[str, torch.Tensor]:
        """The current full weights, HF names (a collective where the weights are sharded)."""
        ...


async def push_trainer(trainer: WeightSource, channel: InPlace | _Servers | Frozen | None,
                       version: str) -> dict[str, float]:
    """The trainer's new weights through `channel` as `version`: its LoRA adapter alone when `trainer.syncs_adapter`,
    else its full weights. Every rank of a sharded trainer calls it (the gather is a collective); a rank that pushes
    to no engine passes `channel=None` and gets {}."""
    if trainer.syncs_adapter:
        adapter = trainer.adapter()
        return await channel.push_adapter(adapter, version) if channel is not None else {}
    weights = trainer.weights()
    return await channel.push(weights, version) if channel is not None else {}


class InPlace:
    """The embedded engine: a state dict handed over in this process."""

    def __init__(self, policy: Any):
        self.policy = policy

    async def push(self, weights: Mapping[str, torch.Tensor], version: str) -> dict[str, float]:
        t0 = time.perf_counter()
        copies = {k: v.detach().clone() for k, v in weights.items()}
        await self.policy.update_weights(copies, version)
        return {"sync/s": time.perf_counter() - t0, "sync/bytes": float(_nbytes(copies.values()))}

    async def push_adapter(self, adapter: Any, version: str) -> dict[str, float]:
        """A LoRA adapter (`slime_env.agents.lora_adapter.LoRAAdapter`): the engine merges it (`load_adapter`)."""
        t0 = time.perf_counter()
        await self.policy.load_adapter(adapter, version)
        return {"sync/s": time.perf_counter() - t0, "sync/bytes": float(adapter.nbytes)}

    async def close(self) -> None:
        return None


class _Servers:
    """Shared by the channels over engine servers: the engines of the moment, the layout their weights take, and a
    call made on each of them."""

    def __init__(self, engines: Callable[[], Sequence[Any]], layout: WeightLayout | None = None):
        self.engines = engines
        self.layout = layout or WeightLayout()
        self.adapter_folder: Path | None = None  # where adapter versions are written (a temporary folder if unset)
        self.keep_adapters = 2  # adapter versions every engine keeps loaded (the run's staleness bound + 1)
        self._adapter_own = False  # adapter_folder is the channel's (a temporary folder, or the run's): versions go

    async def _each(self, fn: Callable[[Any], Any]) -> list[Any]:
        return await asyncio.gather(*(fn(e) for e in self.engines()))

    async def push_adapter(self, adapter: Any, version: str) -> dict[str, float]:
        """A LoRA adapter, whatever channel carries full weights: written as a PEFT folder (kilobytes to megabytes)
        that every engine loads by name and version (`load_lora_adapter("{name}@{version}", folder)`: SGLang's
        `/load_lora_adapter`, vLLM's `/v1/load_lora_adapter`, serve-engine's); each engine then unloads the versions
        older than its newest `keep_adapters`, so every in-flight request's adapter stays loaded. In a folder of the
        channel's own (a temporary one when `adapter_folder` is unset, or `own_adapter_folder`'s), a version's folder
        goes once no engine holds it loaded: vLLM re-reads a loaded adapter's folder when the adapter comes back into
        its cache, an unloaded one's never."""
        t0 = time.perf_counter()
        if self.adapter_folder is None:
            self.adapter_folder, self._adapter_own = Path(tempfile.mkdtemp(prefix="slime_env-adapters-")), True
        lora_name = f"{adapter.name}@{version}"
        folder = await asyncio.to_thread(adapter.save, self.adapter_folder / lora_name)
        saved = time.perf_counter()
        await self._each(lambda e: e.load_lora_adapter(lora_name, str(folder), weight_version=version))
        await self._each(lambda e: e.unload_lora_adapters(keep=self.keep_adapters))
        if self._adapter_own:
            await asyncio.to_thread(self._drop_unloaded, lora_name)
        return {"sync/s": time.perf_counter() - t0, "sync/save_s": saved - t0, "sync/bytes": float(adapter.nbytes)}

    def own_adapter_folder(self, folder: str | Path) -> None:
        """Adapter versions go to `folder`, this channel's alone (a run's `run_dir/weight_sync/adapters`): emptied
        now, of what a killed run left; a version's folder removed once no engine holds it loaded."""
        shutil.rmtree(folder, ignore_errors=True)
        self.adapter_folder, self._adapter_own = Path(folder), True

    def _drop_unloaded(self, newest: str | None = None) -> None:
        """Remove the adapter folders no engine holds loaded (by its client's `loras`; all kept if one cannot say),
        and the channel's folder once empty."""
        held = {newest}
        for engine in self.engines():
            loras = getattr(engine, "loras", None)
            if loras is None:
                return
            held.update(loras)
        for folder in list(self.adapter_folder.iterdir()) if self.adapter_folder.is_dir() else ():
            if folder.name not in held:
                shutil.rmtree(folder, ignore_errors=True)
        if self.adapter_folder.is_dir() and not any(self.adapter_folder.iterdir()):
            self.adapter_folder.rmdir()

    async def close(self) -> None:
        if self._adapter_own:  # the versions engines still hold stay while they may re-read them
            await asyncio.to_thread(self._drop_unloaded)


_GROUP_IDS = itertools.count(1)


class Distributed(_Servers):
    """SGLang's disaggregated update: see the module docstring. `backend` "nccl" (GPUs) or "gloo" (CPUs);
    `master_address` is this host as the engines reach it; `bucket_bytes` bounds one update call (an engine
    receives a call's tensors into buffers) — unless every engine reports a bound of its own (serve-engine's
    `update_buffer_bytes`) and `one_call` is on: then the whole update is one call (each call costs an HTTP round
    trip and the engine's load, 3-9 ms measured: 32 calls made 0.14-0.31 s of an 8B model's sync, one call 0.06 s)."""

    def __init__(self, engines: Callable[[], Sequence[Any]], *, backend: str, layout: WeightLayout | None = None,
                 master_address: str = "127.0.0.1", bucket_bytes: int = 512 << 20,
                 group_name: str = "weight_update_group", one_call: bool = True):
        super().__init__(engines, layout)
        if backend not in ("nccl", "gloo"):
            raise InvalidInput(f"engine.weight_sync distributed: backend {backend!r} is not 'nccl' or 'gloo'")
        self.backend, self.master_address, self.bucket_bytes = backend, master_address, bucket_bytes
        self.one_call, self.bounded = one_call, False  # bounded: every engine of the group bounds its own buffers
        self.base_name = group_name
        self.group, self.name = None, group_name
        # The engine clients of the group (by identity: a restarted engine is a new client at the same URL, and its
        # old rank is gone from the group).
        self.members: tuple[int, ...] = ()

    async def _form(self, engines: Sequence[Any]) -> None:
        """A group of this process (rank 0) and every engine rank; the old one (other members) is dissolved."""
        from slime_env.agents.weight_transfer import open_update_group

        await self._dissolve(engines)
        ranks, bounded = [], True
        for e in engines:  # an SGLang server with tensor parallelism has one rank per GPU
            info = await e.get_server_info() if hasattr(e, "get_server_info") else {}
            ranks.append(int(info.get("tp_size", 1) or 1))
            bounded = bounded and isinstance(info.get("update_buffer_bytes"), int)
        world = 1 + sum(ranks)
        name = f"{self.base_name}_{next(_GROUP_IDS)}"  # unique in this process: an aborted group may linger
        port = free_port()
        offsets = [1 + sum(ranks[:i]) for i in range(len(engines))]
        joins = [asyncio.ensure_future(e.init_weights_update_group(self.master_address, port, off, world, name,
                                                                   self.backend))
                 for e, off in zip(engines, offsets)]
        try:
            group = await asyncio.to_thread(open_update_group, self.master_address, port, 0, world, name,
                                            self.backend)
            await asyncio.gather(*joins)
        except BaseException:
            for j in joins:
                j.cancel()
            raise
        self.group, self.name, self.bounded = group, name, bounded
        self.members = tuple(id(e) for e in engines)

    async def _dissolve(self, engines: Sequence[Any]) -> None:
        from slime_env.agents.weight_transfer import close_update_group

        if self.group is None:
            return
        group, self.group = self.group, None
        live = {id(e): e for e in engines}
        if set(self.members) <= set(live):
            # Every rank tears down at once: NCCL's teardown waits for the group's other ranks (a collective in
            # some NCCL versions), so this rank must not wait for the engines' answers first.
            await asyncio.gather(*(live[m].destroy_weights_update_group(self.name) for m in self.members),
                                 asyncio.to_thread(close_update_group, group), return_exceptions=True)
        else:  # a member is gone (an engine restarted: a new client): no teardown can complete; abort ours aside
            threading.Thread(target=close_update_group, args=(group, True), daemon=True).start()
            calls = [live[m].destroy_weights_update_group(self.name) for m in self.members if m in live]
            if calls:  # the live ones drop theirs (bounded: their teardown may wait on the gone rank too)
                await asyncio.wait([asyncio.ensure_future(c) for c in calls], timeout=30)

    async def push(self, weights: Mapping[str, torch.Tensor], version: str) -> dict[str, float]:
        from slime_env.agents.weight_transfer import broadcast, bucketed

        engines = list(self.engines())
        if not engines:
            raise RuntimeError("no engine to send weights to")
        t0 = time.perf_counter()
        if self.group is None or self.members != tuple(id(e) for e in engines):
            await self._form(engines)
        formed = time.perf_counter()
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        named = [(n, t.detach().to(device=device).contiguous()) for n, t in self.layout.engine_tensors(weights)]
        sent = 0
        await asyncio.gather(*(e.pause_generation() for e in engines))
        try:
            for bucket in [named] if self.one_call and self.bounded else bucketed(named, self.bucket_bytes):
                names = [n for n, _ in bucket]
                dtypes = [str(t.dtype).removeprefix("torch.") for _, t in bucket]
                shapes = [list(t.shape) for _, t in bucket]
                calls = [asyncio.ensure_future(e.update_weights_from_distributed(names, dtypes, shapes, self.name,
                                                                                 version)) for e in engines]

                def send(bucket=bucket) -> None:
                    for _, t in bucket:
                        broadcast(t, self.group)

                await asyncio.to_thread(send)
                await asyncio.gather(*calls)
                sent += sum(t.numel() * t.element_size() for _, t in bucket)
        except BaseException:
            self.group = None  # a failed broadcast leaves the group unusable: form a new one next time
            raise
        finally:
            await asyncio.gather(*(e.continue_generation() for e in engines), return_exceptions=True)
        return {"sync/s": time.perf_counter() - t0, "sync/group_s": formed - t0, "sync/bytes": float(sent)}

    async def close(self) -> None:
        engines = list(self.engines())
        await self._dissolve(engines)
        await super().close()


class FromTensor(_Servers):
    """Same host: CUDA IPC handles (shared memory on CPUs) through `update_weights_from_tensor`. CUDA tensors are
    sent as views of one flat buffer per dtype: torch shares one IPC handle per storage, so the engine opens one
    handle instead of one per tensor (~200 for a 1B model), in SGLang's own payload format."""

    async def push(self, weights: Mapping[str, torch.Tensor], version: str) -> dict[str, float]:
        t0 = time.perf_counter()
        named = _flat_views([(n, t.detach().contiguous()) for n, t in self.layout.engine_tensors(weights)])
        # One call per engine, atomic there (admission held, running requests finished, then the load): no pause.
        await self._each(lambda e: e.update_weights_from_tensor(named, weight_version=version))
        return {"sync/s": time.perf_counter() - t0, "sync/bytes": float(_nbytes(t for _, t in named))}


class _VersionFolders:
    """Where a disk channel writes each version's model folder: `root/weights_{version}`, under a temporary folder of
    its own when `root` is None (removed by `close`). Once every engine has loaded a version, the folder it replaces
    goes: engines load a full set eagerly, and a copy of the weights per sync would fill the disk within a run.
    `scratch`: `root` is the channel's alone (a run's `run_dir/weight_sync`): emptied now, of what a killed run left
    there; `close` removes its versions, and the folder once nothing else is in it."""

    def __init__(self, root: str | Path | None, *, scratch: bool = False):
        self.owned = root is None or scratch
        self.root = Path(tempfile.mkdtemp(prefix="slime_env_sync_")) if root is None else Path(root)
        if scratch:
            shutil.rmtree(self.root, ignore_errors=True)
        self.loaded: Path | None = None

    def path(self, version: str) -> Path:
        return self.root / f"weights_{version}"

    def done(self, path: Path) -> None:
        """Every engine has loaded `path`: the folder written before it is removed."""
        if self.loaded is not None and self.loaded != path:
            shutil.rmtree(self.loaded, ignore_errors=True)
        self.loaded = path

    def close(self) -> None:
        if self.owned:  # its versions; the rest of a run's folder (adapters an engine may still hold) stays
            for folder in self.root.glob("weights_*"):
                shutil.rmtree(folder, ignore_errors=True)
            if self.root.is_dir() and not any(self.root.iterdir()):
                self.root.rmdir()


class FromDisk(_Servers):
    """A model folder visible to every engine, then `update_weights_from_disk`. The folder is
    `folder/weights_{version}` (`_VersionFolders`: a temporary folder when neither `folder` nor `path` is given, only
    the newest version kept), or exactly `path` when given (`trainer.sync(policy, path=...)`, kept); it is written by
    `save(path)` when given (a function writing the weights being pushed), else as `layout.save_folder` writes it.
    `scratch`: `folder` is this channel's alone, emptied now, its versions removed by `close` (`_VersionFolders`)."""

    def __init__(self, engines: Callable[[], Sequence[Any]], *, folder: str | Path | None = None,
                 layout: WeightLayout | None = None, save: Callable[[Path], Any] | None = None,
                 path: str | Path | None = None, scratch: bool = False):
        super().__init__(engines, layout)
        self.path, self.save = path and Path(path), save
        self.versions = None if path is not None else _VersionFolders(folder, scratch=scratch)

    async def push(self, weights: Mapping[str, torch.Tensor], version: str) -> dict[str, float]:
        t0 = time.perf_counter()
        path = self.path or self.versions.path(version)
        if self.save is not None:
            await asyncio.to_thread(self.save, path)
        else:
            await asyncio.to_thread(self.layout.save_folder, path, weights)
        saved = time.perf_counter()
        await self._each(lambda e: e.update_weights_from_disk(str(path), weight_version=version))  # atomic there
        if self.versions is not None:
            await asyncio.to_thread(self.versions.done, path)
        return {"sync/s": time.perf_counter() - t0, "sync/save_s": saved - t0}

    async def close(self) -> None:
        if self.versions is not None:
            self.versions.close()
        await super().close()


class Frozen:
    """`weight_sync: none`: the engines keep the weights they started with."""

    async def push(self, weights: Mapping[str, torch.Tensor], version: str) -> dict[str, float]:
        return {}

    async def push_adapter(self, adapter: Any, version: str) -> dict[str, float]:
        return {}

    async def close(self) -> None:
        return None


def channel_for(policy: Any, layout: WeightLayout, *, path: str | Path | None = None) -> Any:
    """The channel `trainer.sync(policy)` pushes through: in place for a policy that takes a state dict
    (`TransformersPolicy`), a model folder at `path` for an engine server when `path` is given, else its memory
    (`update_weights_from_tensor`: CUDA IPC / shared memory, same host). vLLM servers: `vllm_sync.channel_for`."""
    if hasattr(policy, "reload_weights"):  # VLLMPolicy: its `update_weights` is vLLM's transfer RPC, not a state dict
        raise TypeError(f"{type(policy).__name__} is a vLLM server: its channel is slime_env.trainers.vllm_sync."
                        "channel_for's")
    if hasattr(policy, "update_weights"):
        return InPlace(policy)
    if path is not None and hasattr(policy, "update_weights_from_disk"):
        channel = FromDisk(lambda: [policy], path=path, layout=layout)
        channel.adapter_folder = Path(path)
        return channel
    if hasattr(policy, "update_weights_from_tensor"):
        channel = FromTensor(lambda: [policy], layout)
        if path is not None:
            channel.adapter_folder = Path(path)
        return channel
    raise TypeError(f"{type(policy).__name__} takes no weights: it has neither update_weights, "
                    "update_weights_from_tensor nor update_weights_from_disk")


def _flat_views(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """CUDA tensors copied into one buffer per dtype, returned as views of it (CPU tensors as they are)."""
    out: list[tuple[str, torch.Tensor] | None] = [None] * len(named)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, (name, t) in enumerate(named):
        if t.is_cuda:
            groups.setdefault((t.device, t.dtype), []).append(i)
        else:
            out[i] = (name, t)
    for (device, dtype), idx in groups.items():
        flat = torch.empty(sum(named[i][1].numel() for i in idx), dtype=dtype, device=device)
        at = 0
        for i in idx:
            name, t = named[i]
            view = flat[at:at + t.numel()].view(t.shape)
            view.copy_(t)
            out[i] = (name, view)
            at += t.numel()
    return out  # type: ignore[return-value]


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
