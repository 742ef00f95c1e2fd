"""The trainer group of a run: the trainer backend in this process, or its ranks as Ray actors or child processes.

Both keep the `TrainerGroup` contract (`slime_env.trainers.run.roles`): `step`, `sft_step`, `sync(version)`, `save` /
`load`, `weights`, `step_count`, `close_channel`, `close`. `TRAINER_GROUPS` picks one by `cluster.backend`;
`BACKENDS` builds the trainer of `trainer.backend` (`TorchTrainer`, `FSDPTrainer`, `MegatronTrainer`) from a model
folder.

A group owns the run's weight channel. It asks the engines once which channel reaches them from its ranks
(`Engines.channel_spec`, a picklable `slime_env.trainers.run.channel.ChannelSpec`) and makes it with `make_channel`:
in this process for `LocalTrainerGroup`; in each pushing rank's process for ranks elsewhere, where the spec travels
with every `sync`. `slime_env.trainers.weight_sync.push_trainer` decides what a push carries (weights or adapter).

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
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Self

from slime_env.errors import InvalidInput
from slime_env.trainers.run.channel import ChannelSpec, make_channel
from slime_env.trainers.run.rank_process import RankDied, RankProcess
from slime_env.trainers.weight_sync import push_trainer

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from slime_env.agents.transformers_policy import TransformersPolicy
    from slime_env.clients.sglang import SGLangPolicy
    from slime_env.trajectory import Trajectory
    from slime_env.trainers.run.engines import Engines
    from slime_env.trainers.run.placement import Placement
    from slime_env.trainers.run.roles import TrainerGroup, WeightChannel
    from slime_env.trainers.torch_trainer import TorchTrainer, TrainerConfig

# One call of a rank's method: (method name, *its arguments).
Call = tuple[object, ...]


# --- the trainer backends ------------------------------------------------------------------------------------
def _torch(source: PreTrainedModel, tc: TrainerConfig, pad_id: int, policy: TransformersPolicy | None,
           device: str) -> TorchTrainer:
    from slime_env.trainers.torch_trainer import TorchTrainer

    if policy is not None and getattr(policy, "device", None) is not None:
        target = policy.device
    else:
        from slime_env.agents.default_model import resolve_device

        target = resolve_device(device)[0]
    # TorchTrainer updates its model in place: it must not be the engine's
    return TorchTrainer((copy.deepcopy(source) if policy is not None and source is getattr(policy, "model", None)
                         else source).to(target), tc, pad_id=pad_id)


def _fsdp(source: PreTrainedModel, tc: TrainerConfig, pad_id: int, policy: TransformersPolicy | None,
          device: str) -> TorchTrainer:
    from slime_env.trainers.fsdp_trainer import FSDPTrainer

    # FSDP shards its model in place: never the engine's
    return FSDPTrainer(copy.deepcopy(source) if source is getattr(policy, "model", None) else source, tc, pad_id=pad_id)


def _megatron(source: PreTrainedModel, tc: TrainerConfig, pad_id: int, policy: TransformersPolicy | None,
              device: str) -> TorchTrainer:
    from slime_env.trainers.megatron_trainer import MegatronTrainer

    return MegatronTrainer(source, tc, pad_id=pad_id)  # reads the weights; keeps no reference to `source`


# trainer.backend -> fn(float32 HF model, TrainerConfig, pad_id, embedded policy or None, device) -> trainer
BACKENDS: dict[str, Callable[[PreTrainedModel, TrainerConfig, int, TransformersPolicy | None, str], TorchTrainer]] = {
    "torch": _torch, "fsdp": _fsdp, "megatron": _megatron}


def make_trainer(tc: TrainerConfig, model_path: str, policy: TransformersPolicy | None, pad_id: int,
                 device: str = "auto") -> TorchTrainer:
    """The trainer of `tc.backend` (`BACKENDS`) from float32 weights of `model_path`; next to an embedded `policy` it
    trains on the engine's device and reuses its float32 weights as the starting point (no second read)."""
    import torch
    from transformers import AutoModelForCausalLM

    if policy is not None and getattr(policy, "model", None) is not None and policy.model.dtype == torch.float32:
        source = policy.model  # already the float32 weights: no second read
    else:
        source = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return BACKENDS[tc.backend](source, tc, pad_id, policy, device)


def _keep_adapters(tc: TrainerConfig) -> int:
    """LoRA adapter versions each engine keeps loaded (`trainer.lora.keep_loaded`; 2 without LoRA, unused)."""
    return tc.lora.keep_loaded if tc.lora is not None else 2


# --- one process ---------------------------------------------------------------------------------------------
class LocalTrainerGroup:
    """The trainer in this process (its own worker thread runs each step: the event loop never does), and the weight
    channel it pushes through."""

    def __init__(self, trainer: TorchTrainer, channel: WeightChannel):
        self.trainer, self.channel = trainer, channel

    @classmethod
    def make(cls, placement: Placement, tc: TrainerConfig, engines: Engines, pad_id: int,
             device: str) -> LocalTrainerGroup:
        trainer = make_trainer(tc, engines.model_path, engines.policy if engines.embedded else None, pad_id, device)
        spec = engines.channel_spec(keep_adapters=_keep_adapters(tc))
        return cls(trainer, make_channel(spec, engines.targets, layout=trainer.weight_layout(), policy=engines.policy))

    @property
    def step_count(self) -> int:
        return self.trainer.step_count

    async def step(self, trajectories: Sequence[Trajectory], group_size: int) -> dict[str, float]:
        from slime_env.trainers.run.gpu_memory import torch_view

        metrics = await asyncio.to_thread(self.trainer.step, trajectories, group_size)
        return {**metrics, **torch_view("memory/rank0_")}  # the GPU since the last step (an embedded engine's too)

    async def sft_step(self, trajectories: Sequence[Trajectory], lr: float | None = None) -> dict[str, float]:
        return await asyncio.to_thread(lambda: self.trainer.sft_step(trajectories, lr=lr))

    async def sync(self, version: str) -> dict[str, float]:
        return await push_trainer(self.trainer, self.channel, version)

    def save(self, path: str | Path) -> None:
        self.trainer.save(path)

    def load(self, path: str | Path) -> None:
        self.trainer.load(path)

    def save_weights(self, path: str | Path) -> None:
        self.trainer.save_weights(path)

    def weights(self) -> dict[str, torch.Tensor]:
        return self.trainer.weights()

    async def close_channel(self) -> None:
        await self.channel.close()

    def close(self) -> None:
        return None


# --- ranks in other processes: Ray actors or child processes -------------------------------------------------
class _TrainerRank:
    """One trainer rank (a Ray actor's or a child process's body): torch.distributed among the ranks, then the
    trainer of the config."""

    def address(self) -> tuple[str, int]:
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, rank: int, world: int, master: tuple[str, int], tc: dict[str, object], model_path: str,
              pad_id: int, device: str, local_rank: int = 0) -> None:
        """`local_rank`: this rank's GPU among those this process sees (a Ray actor sees its own alone: 0)."""
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank),
                           "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1])})
        import torch

        from slime_env.trainers.torch_trainer import TrainerConfig

        if torch.cuda.is_available() and device != "cpu":
            torch.cuda.set_device(local_rank)  # a one-device trainer ("cuda") takes the current device
        self.rank = rank
        self.trainer = make_trainer(TrainerConfig(**tc), model_path, None, pad_id, device)
        self.channel: WeightChannel | None = None
        self.clients: dict[tuple[str, int], SGLangPolicy] = {}
        self.current: list[SGLangPolicy] = []

    def step(self, trajectories: Sequence[Trajectory], group_size: int) -> dict[str, float]:
        from slime_env.trainers.run.gpu_memory import torch_view

        return {**self.trainer.step(trajectories, group_size), **torch_view(f"memory/rank{self.rank}_")}

    def sft_step(self, trajectories: Sequence[Trajectory], lr: float | None) -> dict[str, float]:
        return self.trainer.sft_step(trajectories, lr=lr)

    def step_count(self) -> int:
        return self.trainer.step_count

    async def sync(self, spec: ChannelSpec, engines: list[tuple[str, int, int]], version: str) -> dict[str, float]:
        """Every rank gathers the weights (a collective under TP); each rank pushes them to its `engines` ((url,
        token, pushing rank): a new token at a known URL is a restarted engine, which the channel's group must take
        in anew) through the channel it made of `spec` (`make_channel`, at its first push). {} from a rank other
        than 0 with none to push to."""
        mine = [(url, token) for url, token, pusher in engines if pusher == self.rank]
        if not mine and self.rank != 0:  # rank 0 goes on: its channel lets go of engines that are gone
            return await push_trainer(self.trainer, None, version)
        from slime_env.clients.sglang import SGLangPolicy

        if self.channel is None:
            node = None
            if spec.master_address is None:  # Ray: this rank's node, as the engines reach it
                import ray

                node = ray.util.get_node_ip_address()
            self.channel = make_channel(spec.for_rank(self.rank, node), lambda: self.current,
                                        layout=self.trainer.weight_layout())
        for key in set(self.clients) - set(mine):
            await self.clients.pop(key).close()
        self.current = [self.clients.setdefault(key, SGLangPolicy(key[0])) for key in mine]
        return await push_trainer(self.trainer, self.channel, version)

    def weights(self) -> dict[str, torch.Tensor] | None:
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
    `_all_now` blocking), rank 0's answer is the group's, and the pushing ranks make the weight channel of the
    group's `spec` in their own processes."""

    backend = ""  # cluster.backend, for messages
    channels: tuple[str, ...] = ("distributed", "tensor", "none")  # weight_sync kinds a rank can build here
    on_ray_node = False  # the engines reach a pushing rank at its Ray node's address (not engine.master_address)
    grace_s = 60.0  # how long the other ranks get to finish a call one rank failed
    failed: str | None = None  # why the ranks were stopped (every later call raises it)
    _steps = 0

    def _submit(self, calls: list[Call], pool: Executor) -> list[Future]:
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

    def _each(self, calls: list[Call]) -> list[object]:
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

    async def _all(self, method: str, *args: object) -> list[object]:
        return await asyncio.to_thread(self._each, [(method, *args)] * self._world())

    def _all_now(self, method: str, *args: object) -> list[object]:
        return self._each([(method, *args)] * self._world())

    def _world(self) -> int:
        raise NotImplementedError

    def _shared(self, value: object) -> object:
        """`value` as it travels to every rank (Ray: one object in its store)."""
        return value

    def _connected(self, engines: Engines, tc: TrainerConfig) -> Self:
        """This group with its ranks joined to the run's weight channel; closed (its ranks stopped) if that fails."""
        try:
            self._connect(engines, tc)
        except BaseException:
            self.close()
            raise
        return self

    def _connect(self, engines: Engines, tc: TrainerConfig) -> None:
        """The group's channel: `engines.channel_spec` from its ranks, refused by name where a rank cannot make it."""
        if engines.cfg.kind == "vllm":
            raise InvalidInput(f"engine.kind vllm is not offered with cluster.backend {self.backend} yet (its channels "
                               "run in the driver's process); use cluster.backend local / torchrun")
        spec = engines.channel_spec(self._trainer_gpus(), keep_adapters=_keep_adapters(tc),
                                    ray_node=self.on_ray_node)
        if spec.kind not in self.channels:
            raise InvalidInput(f"engine.weight_sync {engines.cfg.weight_sync!r} ({spec.kind}) is not offered with "
                               f"cluster.backend {self.backend} (offered: {list(self.channels)})")
        self.engines, self.spec = engines, spec

    @property
    def step_count(self) -> int:
        return self._steps

    async def step(self, trajectories: Sequence[Trajectory], group_size: int) -> dict[str, float]:
        results = await self._all("step", self._shared(trajectories), group_size)
        self._steps += 1
        # rank 0's metrics, and every rank's view of its GPU (`memory/rank{r}_*`, gpu_memory.torch_view)
        return {**results[0], **{k: v for r in results[1:] for k, v in r.items() if k.startswith("memory/rank")}}

    async def sft_step(self, trajectories: Sequence[Trajectory], lr: float | None = None) -> dict[str, float]:
        return (await self._all("sft_step", self._shared(trajectories), lr))[0]

    async def sync(self, version: str) -> dict[str, float]:
        engines = [(e.url, id(e), self._pusher(e.url)) for e in self.engines.targets()]
        pushed = [r for r in await self._all("sync", self.spec, engines, version) if r]
        # the ranks pushed side by side: the slowest is the sync's time; each sent the same weights
        metrics = {k: max(r[k] for r in pushed if k in r) for k in {k for r in pushed for k in r}}
        return {**metrics, "sync/ranks": float(len(pushed))}

    def _trainer_gpus(self) -> set[int] | None:
        """The GPUs (the run's indices) of the trainer ranks, where the group knows them (None: the run's own)."""
        return None

    def _pusher(self, url: str) -> int:
        """The rank that pushes to the engine at `url` (rank 0, which alone holds the weight-update group)."""
        return 0

    def save(self, path: str | Path) -> None:
        self._all_now("save", str(path))

    def load(self, path: str | Path) -> None:
        self._all_now("load", str(path))
        self._steps = self._all_now("step_count")[0]

    def save_weights(self, path: str | Path) -> None:
        self._all_now("save_weights", str(path))  # every rank joins the gather; rank 0 writes

    def weights(self) -> dict[str, torch.Tensor]:
        # every rank joins: TP, PP and EP gather the full weights collectively; rank 0's copy is returned
        return self._all_now("weights")[0]

    async def close_channel(self) -> None:
        """The channel lives in the ranks: it closes with them (`close`)."""
        return None


class RayTrainerGroup(_RemoteTrainerGroup):
    """The trainer ranks as Ray actors (see the module docstring)."""

    backend = "ray"
    on_ray_node = True

    def __init__(self, placement: Placement, tc: TrainerConfig, model_path: str, pad_id: int, device: str):
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
    def make(cls, placement: Placement, tc: TrainerConfig, engines: Engines, pad_id: int,
             device: str) -> RayTrainerGroup:
        return cls(placement, tc, engines.model_path, pad_id, device)._connected(engines, tc)

    def _world(self) -> int:
        return len(self.actors)

    def _submit(self, calls: list[Call], pool: Executor) -> list[Future]:
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

    def _shared(self, value: object) -> object:
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

    def __init__(self, ranks: int, tc: TrainerConfig, model_path: str, pad_id: int, device: str, run_dir: Path):
        from slime_env.trainers.distributed import free_port

        self.ranks = [RankProcess(f"{__name__}:_TrainerRank", name=f"trainer rank {r}",
                                  log=Path(run_dir) / f"trainer_rank{r}.log") for r in range(ranks)]
        master = ("127.0.0.1", free_port())
        try:  # every rank at once: the trainers' setup has collectives
            self._each([("setup", r, ranks, master, asdict(tc), model_path, pad_id, device, r) for r in range(ranks)])
        except BaseException:
            self.close()
            raise

    @classmethod
    def make(cls, placement: Placement, tc: TrainerConfig, engines: Engines, pad_id: int,
             device: str) -> ProcessTrainerGroup:
        return cls(placement.cfg.ranks, tc, engines.model_path, pad_id, device, engines.run_dir)._connected(engines, tc)

    def _world(self) -> int:
        return len(self.ranks)

    def _submit(self, calls: list[Call], pool: Executor) -> list[Future]:
        return [pool.submit(rank.call, *c) for rank, c in zip(self.ranks, calls)]

    def _died(self, error: BaseException) -> bool:
        return isinstance(error, RankDied)

    def _kill(self) -> None:
        for rank in self.ranks:
            rank.kill()

    def _trainer_gpus(self) -> set[int] | None:
        return set(range(len(self.ranks)))  # rank r on GPU r

    def _pusher(self, url: str) -> int:
        # CUDA IPC from each rank to the engines on its GPU (colocated); one NCCL group or one folder: rank 0
        return self.engines.pusher(url, len(self.ranks)) if self.spec.kind == "tensor" else 0

    def close(self) -> None:
        for rank in self.ranks:
            if rank.proc.poll() is None and self.failed is None:
                try:
                    rank.call("close")  # rank 0's channel and engine clients
                except Exception:  # noqa: BLE001 - a rank that cannot close cleanly is stopped below all the same
                    pass
            rank.close()


# cluster.backend -> make(placement, TrainerConfig, engines, pad_id, device): the group, its weight channel made
TRAINER_GROUPS: dict[str, Callable[[Placement, TrainerConfig, Engines, int, str], TrainerGroup]] = {
    "local": LocalTrainerGroup.make, "ray": RayTrainerGroup.make, "process": ProcessTrainerGroup.make}
