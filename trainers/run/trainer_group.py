"""The trainer group of a run: the trainer backend in this process, or its ranks as Ray actors or child processes.

Both keep the `TrainerGroup` contract (`slime_env.trainers.run.roles`): `step`, `sft_step`, `sync(channel, version)`,
`save` / `load`, `weights`, `step_count`, `channel(engines)`. `TRAINER_GROUPS` picks one by `cluster.backend`;
`BACKENDS` builds the trainer of `trainer.backend` (`TorchTrainer`, `FSDPTrainer`, `MegatronTrainer`) from a model
folder.

With Ray, every rank is a `_TrainerRank` actor on its bundle of the run's placement group
(`slime_env.trainers.run.placement`): the ranks set up torch.distributed among themselves (rank 0's node address and a
free port come from Ray, nothing is typed by hand) and every one takes the same trajectories (Megatron splits the rows
by DP rank); every rank gathers the weights and rank 0 pushes them to the engines through the channel it builds in its
own process, in the same engine-bound layout as a local run (`trainer.weight_layout()`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import os
import socket
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slime_env.errors import InvalidInput
from slime_env.trainers.run.rank_process import RankDied, RankProcess

if TYPE_CHECKING:
    from slime_env.trainers.run.placement import Placement
    from slime_env.trainers.torch_trainer import TorchTrainer, TrainerConfig


# --- the trainer backends ------------------------------------------------------------------------------------
def _torch(source: Any, tc: Any, pad_id: int, policy: Any, device: str) -> Any:
    from slime_env.trainers.torch_trainer import TorchTrainer

    if policy is not None and getattr(policy, "device", None) is not None:
        target = policy.device
    else:
        from slime_env.agents.default_model import resolve_device

        target = resolve_device(device)[0]
    # TorchTrainer updates its model in place: it must not be the engine's
    return TorchTrainer((copy.deepcopy(source) if policy is not None and source is getattr(policy, "model", None)
                         else source).to(target), tc, pad_id=pad_id)


def _fsdp(source: Any, tc: Any, pad_id: int, policy: Any, device: str) -> Any:
    from slime_env.trainers.fsdp_trainer import FSDPTrainer

    # FSDP shards its model in place: never the engine's
    return FSDPTrainer(copy.deepcopy(source) if source is getattr(policy, "model", None) else source, tc, pad_id=pad_id)


def _megatron(source: Any, tc: Any, pad_id: int, policy: Any, device: str) -> Any:
    from slime_env.trainers.megatron_trainer import MegatronTrainer

    return MegatronTrainer(source, tc, pad_id=pad_id)  # reads the weights; keeps no reference to `source`


# trainer.backend -> fn(float32 HF model, TrainerConfig, pad_id, embedded policy or None, device) -> trainer
BACKENDS: dict[str, Callable[..., Any]] = {"torch": _torch, "fsdp": _fsdp, "megatron": _megatron}


def make_trainer(tc: TrainerConfig, model_path: str, policy: Any, pad_id: int, device: str = "auto") -> TorchTrainer:
    """The trainer of `tc.backend` (`BACKENDS`) from float32 weights of `model_path`; next to an embedded `policy` it
    trains on the engine's device and reuses its float32 weights as the starting point (no second read)."""
    import torch
    from transformers import AutoModelForCausalLM

    if policy is not None and getattr(policy, "model", None) is not None and policy.model.dtype == torch.float32:
        source = policy.model  # already the float32 weights: no second read
    else:
        source = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return BACKENDS[tc.backend](source, tc, pad_id, policy, device)


# --- one process ---------------------------------------------------------------------------------------------
class LocalTrainerGroup:
    """The trainer in this process (its own worker thread runs each step: the event loop never does)."""

    def __init__(self, trainer: Any):
        self.trainer = trainer

    @classmethod
    def make(cls, placement: Placement, tc: Any, engines: Any, pad_id: int, device: str) -> LocalTrainerGroup:
        return cls(make_trainer(tc, engines.model_path, engines.policy if engines.embedded else None, pad_id, device))

    @property
    def step_count(self) -> int:
        return self.trainer.step_count

    def channel(self, engines: Any) -> Any:
        channel = engines.channel(self.trainer.weight_layout())
        lora = getattr(self.trainer.config, "lora", None)
        if lora is not None and hasattr(channel, "keep_adapters"):
            channel.keep_adapters = lora.keep_loaded
        return channel

    async def step(self, trajectories: list[Any], group_size: int) -> dict[str, float]:
        from slime_env.trainers.run.gpu_memory import torch_view

        metrics = await asyncio.to_thread(self.trainer.step, trajectories, group_size)
        return {**metrics, **torch_view("memory/rank0_")}  # the GPU since the last step (an embedded engine's too)

    async def sft_step(self, trajectories: list[Any], lr: float | None = None) -> dict[str, float]:
        return await asyncio.to_thread(lambda: self.trainer.sft_step(trajectories, lr=lr))

    async def sync(self, channel: Any, version: str) -> dict[str, float]:
        if getattr(self.trainer, "syncs_adapter", False):  # LoRA: the adapter alone (trainer.lora.sync: adapter)
            return await channel.push_adapter(self.trainer.adapter(), version)
        return await channel.push(self.trainer.weights(), version)

    def save(self, path: Any) -> None:
        self.trainer.save(path)

    def load(self, path: Any) -> None:
        self.trainer.load(path)

    def save_weights(self, path: Any) -> None:
        self.trainer.save_weights(path)

    def weights(self) -> dict[str, Any]:
        return self.trainer.weights()

    def close(self) -> None:
        return None


# --- ranks in other processes: Ray actors or child processes -------------------------------------------------
def _rank_channel(kind: str, spec: dict[str, Any], engines: Callable[[], list[Any]], layout: Any, rank: int) -> Any:
    """A pushing rank's channel of `kind` to `engines()` (what the group's `channel` announced in `spec`)."""
    channel = _rank_channel_of(kind, spec, engines, layout)
    if hasattr(channel, "own_adapter_folder"):  # LoRA versions in the run's sync folder, as Engines.channel puts them
        channel.own_adapter_folder(Path(spec["folder"]) / ("adapters" if rank == 0 else f"adapters_rank{rank}"))
    return channel


def _rank_channel_of(kind: str, spec: dict[str, Any], engines: Callable[[], list[Any]], layout: Any) -> Any:
    from slime_env.trainers import weight_sync as ws

    if kind == "distributed":
        address = spec.get("master_address")
        if address is None:  # Ray: this rank's node, as the engines reach it
            import ray

            address = ray.util.get_node_ip_address()
        return ws.Distributed(engines, backend=spec["backend"], layout=layout, master_address=address,
                              bucket_bytes=spec["bucket_bytes"])
    if kind == "tensor":
        return ws.FromTensor(engines, layout)
    if kind == "disk":  # the run's sync folder (Engines.sync_folder), read by the engines
        return ws.FromDisk(engines, layout=layout, folder=spec["folder"], scratch=True)
    return ws.Frozen()


class _TrainerRank:
    """One trainer rank (a Ray actor's or a child process's body): torch.distributed among the ranks, then the
    trainer of the config."""

    def address(self) -> tuple[str, int]:
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, rank: int, world: int, master: tuple[str, int], tc: dict[str, Any], model_path: str, pad_id: int,
              device: str, local_rank: int = 0) -> None:
        """`local_rank`: this rank's GPU among those this process sees (a Ray actor sees its own alone: 0)."""
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank),
                           "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1])})
        import torch

        from slime_env.trainers.torch_trainer import TrainerConfig

        if torch.cuda.is_available() and device != "cpu":
            torch.cuda.set_device(local_rank)  # a one-device trainer ("cuda") takes the current device
        self.rank = rank
        self.trainer = make_trainer(TrainerConfig(**tc), model_path, None, pad_id, device)
        self.channel = None

    def step(self, trajectories: list[Any], group_size: int) -> dict[str, float]:
        from slime_env.trainers.run.gpu_memory import torch_view

        return {**self.trainer.step(trajectories, group_size), **torch_view(f"memory/rank{self.rank}_")}

    def sft_step(self, trajectories: list[Any], lr: float | None) -> dict[str, float]:
        return self.trainer.sft_step(trajectories, lr=lr)

    def step_count(self) -> int:
        return self.trainer.step_count

    async def sync(self, spec: dict[str, Any], engines: list[tuple[str, int, int]], version: str) -> dict[str, float]:
        """Every rank gathers the weights (a collective under TP); each rank pushes them to its `engines` ((url,
        token, pushing rank): a new token at a known URL is a restarted engine, which the channel's group must take
        in anew). {} from a rank other than 0 with none to push to."""
        adapter = getattr(self.trainer, "syncs_adapter", False)  # LoRA: the adapter alone
        weights = self.trainer.adapter() if adapter else self.trainer.weights()
        engines = [(url, token) for url, token, pusher in engines if pusher == self.rank]
        if not engines and self.rank != 0:  # rank 0 goes on: its channel lets go of engines that are gone
            return {}
        from slime_env.clients.sglang import SGLangPolicy

        if self.channel is None:
            self.clients: dict[tuple[str, int], Any] = {}
            self.channel = _rank_channel(spec["kind"], spec, lambda: self.current, self.trainer.weight_layout(),
                                         self.rank)
        for key in set(self.clients) - set(engines):
            await self.clients.pop(key).close()
        self.current = [self.clients.setdefault(key, SGLangPolicy(key[0])) for key in engines]
        if adapter:
            self.channel.keep_adapters = self.trainer.config.lora.keep_loaded
            return await self.channel.push_adapter(weights, version)
        return await self.channel.push(weights, version)

    def weights(self) -> dict[str, Any] | None:
        """The full HF weights on rank 0 (None elsewhere); every rank must join (a collective under TP / PP / EP)."""
        weights = self.trainer.weights()
        return {k: v.detach().cpu() for k, v in weights.items()} if self.rank == 0 else None

    def save(self, path: str) -> None:
        self.trainer.save(path)

    def save_weights(self, path: str) -> None:
        self.trainer.save_weights(path)

    def load(self, path: str) -> None:
        self.trainer.load(path)

    async def close(self) -> None:
        """The channel and the engine clients (rank 0), before the process exits."""
        if self.channel is not None:
            await self.channel.close()
            for client in self.clients.values():
                await client.close()


class _RemoteTrainerGroup:
    """What a trainer group whose ranks run in other processes shares: every call goes to every rank (`_all`, or
    `_all_now` blocking), rank 0's answer is the group's, and rank 0 builds the weight channel in its own process."""

    backend = ""  # cluster.backend, for messages
    channels: tuple[str, ...] = ("distributed", "tensor", "none")  # weight_sync kinds a rank can build here
    grace_s = 60.0  # how long the other ranks get to finish a call one rank failed
    failed: str | None = None  # why the ranks were stopped (every later call raises it)
    _steps = 0

    def _submit(self, calls: list[tuple[Any, ...]], pool: Executor) -> list[Future]:
        """calls[r] (method, *args) started on rank r; one future each (`pool` runs blocking calls)."""
        raise NotImplementedError

    def _died(self, error: BaseException) -> bool:
        """Whether `error` says its rank is gone (not an exception the rank raised)."""
        raise NotImplementedError

    def _kill(self) -> None:
        """Stop every rank now (a call in flight on one fails with its rank's death)."""
        raise NotImplementedError

    def _cause(self, error: BaseException) -> BaseException:
        """The exception the rank raised, out of the wrapper its transport may put around it."""
        return error

    def _each(self, calls: list[tuple[Any, ...]]) -> list[Any]:
        """calls[r] on rank r, all in flight together (blocking); the first failure is raised. A rank that died, or
        one that failed while others still wait `grace_s` later (in a collective that can never complete), stops the
        group: every rank is killed, and every later call raises that failure. A failure every rank shares leaves the
        ranks up (the run can still save the trainer)."""
        if self.failed is not None:
            raise RuntimeError(f"the trainer ranks were stopped after a failure: {self.failed}")
        wait, first = concurrent.futures.wait, concurrent.futures.FIRST_EXCEPTION
        with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
            futures = self._submit(calls, pool)
            done, pending = wait(futures, return_when=first)
            failed = next((f for f in futures if f in done and f.exception() is not None), None)
            if failed is None:
                return [f.result() for f in futures]
            error = failed.exception()
            died = self._died(error)
            if pending and not died:
                pending = wait(pending, timeout=self.grace_s).not_done
            if pending or died:
                cause = self._cause(error)
                self.failed = f"trainer rank {futures.index(failed)}: {type(cause).__name__}: {cause}"
                self._kill()
            raise error

    async def _all(self, method: str, *args: Any) -> list[Any]:
        return await asyncio.to_thread(self._each, [(method, *args)] * self._world())

    def _all_now(self, method: str, *args: Any) -> list[Any]:
        return self._each([(method, *args)] * self._world())

    def _world(self) -> int:
        raise NotImplementedError

    def _shared(self, value: Any) -> Any:
        """`value` as it travels to every rank (Ray: one object in its store)."""
        return value

    def _master_address(self, engines: Any) -> str | None:
        """The address the engines reach rank 0 at for the weight-update group (None: rank 0 finds its own)."""
        return None

    @property
    def step_count(self) -> int:
        return self._steps

    def channel(self, engines: Any) -> Any:
        """The channel's spec (rank 0 builds the channel in its process) and the engines it reaches."""
        if engines.cfg.kind == "vllm":
            raise InvalidInput(f"engine.kind vllm is not offered with cluster.backend {self.backend} yet (its channels "
                               "run in the driver's process); use cluster.backend local / torchrun")
        kind = "inplace" if engines.embedded else engines.channel_kind(self._trainer_gpus())
        if kind not in self.channels:
            raise InvalidInput(f"engine.weight_sync {engines.cfg.weight_sync!r} ({kind}) is not offered with "
                               f"cluster.backend {self.backend} (offered: {list(self.channels)})")
        return _RemoteChannel(self, engines, {"kind": kind, "backend": engines.backend(),
                                              "bucket_bytes": engines.cfg.bucket_mb << 20,
                                              "master_address": self._master_address(engines),
                                              "folder": str(engines.sync_folder())})

    async def step(self, trajectories: list[Any], group_size: int) -> dict[str, float]:
        results = await self._all("step", self._shared(trajectories), group_size)
        self._steps += 1
        # rank 0's metrics, and every rank's view of its GPU (`memory/rank{r}_*`, gpu_memory.torch_view)
        return {**results[0], **{k: v for r in results[1:] for k, v in r.items() if k.startswith("memory/rank")}}

    async def sft_step(self, trajectories: list[Any], lr: float | None = None) -> dict[str, float]:
        return (await self._all("sft_step", self._shared(trajectories), lr))[0]

    async def sync(self, channel: Any, version: str) -> dict[str, float]:
        engines = [(e.url, id(e), self._pusher(channel, e.url)) for e in channel.engines.pool.targets()]
        pushed = [r for r in await self._all("sync", channel.spec, engines, version) if r]
        # the ranks pushed side by side: the slowest is the sync's time; each sent the same weights
        metrics = {k: max(r[k] for r in pushed if k in r) for k in {k for r in pushed for k in r}}
        return {**metrics, "sync/ranks": float(len(pushed))}

    def _trainer_gpus(self) -> set[int] | None:
        """The GPUs (the run's indices) of the trainer ranks, where the group knows them (None: the run's own)."""
        return None

    def _pusher(self, channel: Any, url: str) -> int:
        """The rank that pushes to the engine at `url` (rank 0, which alone holds the weight-update group)."""
        return 0

    def save(self, path: Any) -> None:
        self._all_now("save", str(path))

    def load(self, path: Any) -> None:
        self._all_now("load", str(path))
        self._steps = self._all_now("step_count")[0]

    def save_weights(self, path: Any) -> None:
        self._all_now("save_weights", str(path))  # every rank joins the gather; rank 0 writes

    def weights(self) -> dict[str, Any]:
        # every rank joins: TP, PP and EP gather the full weights collectively; rank 0's copy is returned
        return self._all_now("weights")[0]


class RayTrainerGroup(_RemoteTrainerGroup):
    """The trainer ranks as Ray actors (see the module docstring)."""

    backend = "ray"

    def __init__(self, placement: Placement, tc: Any, model_path: str, pad_id: int, device: str):
        from slime_env.trainers.run.placement import ray_module

        ray = ray_module()
        self.placement, self.tc = placement, tc
        cls = ray.remote(_TrainerRank)
        self.actors = [cls.options(**placement.trainer_options(r)).remote() for r in range(placement.cfg.ranks)]
        master = ray.get(self.actors[0].address.remote())
        try:  # every rank at once: the trainers' setup has collectives
            self._each([("setup", r, len(self.actors), master, asdict(tc), model_path, pad_id, device)
                        for r in range(len(self.actors))])
        except BaseException:
            self.close()
            raise

    @classmethod
    def make(cls, placement: Placement, tc: Any, engines: Any, pad_id: int, device: str) -> RayTrainerGroup:
        return cls(placement, tc, engines.model_path, pad_id, device)

    def _world(self) -> int:
        return len(self.actors)

    def _submit(self, calls: list[tuple[Any, ...]], pool: Executor) -> list[Future]:
        return [getattr(a, method).remote(*args).future() for a, (method, *args) in zip(self.actors, calls)]

    def _died(self, error: BaseException) -> bool:
        from slime_env.trainers.run.placement import ray_module

        return isinstance(error, ray_module().exceptions.RayActorError)

    def _cause(self, error: BaseException) -> BaseException:
        from slime_env.trainers.run.placement import ray_module

        cause = getattr(error, "cause", None) if isinstance(error, ray_module().exceptions.RayTaskError) else None
        return cause if isinstance(cause, BaseException) else error

    def _kill(self) -> None:
        from slime_env.trainers.run.placement import ray_module

        ray = ray_module()
        for a in self.actors:
            ray.kill(a)

    def _shared(self, value: Any) -> Any:
        from slime_env.trainers.run.placement import ray_module

        return ray_module().put(value)

    def close(self) -> None:
        self._kill()


class ProcessTrainerGroup(_RemoteTrainerGroup):
    """The trainer ranks as child processes of the run on this host (`cluster.backend: process`; rank r on GPU r),
    each a `RankProcess`: the run's process keeps the rollout manager, whose work no longer shares an interpreter
    lock with the trainer's step. Each rank writes its output to `trainer_rank{r}.log` in the run directory."""

    backend = "process"
    channels = ("distributed", "tensor", "disk", "none")

    def __init__(self, ranks: int, tc: Any, model_path: str, pad_id: int, device: str, run_dir: Path):
        from slime_env.trainers.distributed import _free_port

        self.ranks = [RankProcess(f"{__name__}:_TrainerRank", name=f"trainer rank {r}",
                                  log=Path(run_dir) / f"trainer_rank{r}.log") for r in range(ranks)]
        master = ("127.0.0.1", _free_port())
        try:  # every rank at once: the trainers' setup has collectives
            self._each([("setup", r, ranks, master, asdict(tc), model_path, pad_id, device, r) for r in range(ranks)])
        except BaseException:
            self.close()
            raise

    @classmethod
    def make(cls, placement: Placement, tc: Any, engines: Any, pad_id: int, device: str) -> ProcessTrainerGroup:
        return cls(placement.cfg.ranks, tc, engines.model_path, pad_id, device, engines.run_dir)

    def _world(self) -> int:
        return len(self.ranks)

    def _submit(self, calls: list[tuple[Any, ...]], pool: Executor) -> list[Future]:
        return [pool.submit(rank.call, *c) for rank, c in zip(self.ranks, calls)]

    def _died(self, error: BaseException) -> bool:
        return isinstance(error, RankDied)

    def _kill(self) -> None:
        for rank in self.ranks:
            rank.kill()

    def _master_address(self, engines: Any) -> str | None:
        return engines.cfg.master_address

    def _trainer_gpus(self) -> set[int] | None:
        return set(range(len(self.ranks)))  # rank r on GPU r

    def _pusher(self, channel: Any, url: str) -> int:
        # CUDA IPC from each rank to the engines on its GPU (colocated); one NCCL group or one folder: rank 0
        return channel.engines.pusher(url, len(self.ranks)) if channel.spec["kind"] == "tensor" else 0

    def close(self) -> None:
        for rank in self.ranks:
            if rank.proc.poll() is None and self.failed is None:
                try:
                    rank.call("close")  # rank 0's channel and engine clients
                except Exception:  # noqa: BLE001 - a rank that cannot close cleanly is stopped below all the same
                    pass
            rank.close()


@dataclass
class _RemoteChannel:
    """What the run holds for a trainer group whose ranks run elsewhere: rank 0 owns the real channel."""

    group: _RemoteTrainerGroup
    engines: Any
    spec: dict[str, Any]

    async def close(self) -> None:
        return None


# cluster.backend -> make(placement, TrainerConfig, engines, pad_id, device)
TRAINER_GROUPS: dict[str, Callable[..., Any]] = {"local": LocalTrainerGroup.make, "ray": RayTrainerGroup.make,
                                                 "process": ProcessTrainerGroup.make}
