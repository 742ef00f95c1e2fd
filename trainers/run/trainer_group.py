"""The trainer group of a run: the trainer backend in this process, or its ranks as Ray actors.

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
import copy
import os
import socket
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from slime_env.errors import InvalidInput

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
        return await asyncio.to_thread(self.trainer.step, trajectories, group_size)

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

    def weights(self) -> dict[str, Any]:
        return self.trainer.weights()

    def close(self) -> None:
        return None


# --- Ray actors ----------------------------------------------------------------------------------------------
def _rank_channel(kind: str, spec: dict[str, Any], engines: Callable[[], list[Any]], layout: Any) -> Any:
    """Rank 0's channel of `kind` to `engines()` (what `RayTrainerGroup.channel` announced in `spec`)."""
    from slime_env.trainers import weight_sync as ws

    if kind == "distributed":
        import ray

        return ws.Distributed(engines, backend=spec["backend"], layout=layout,
                              master_address=ray.util.get_node_ip_address(), bucket_bytes=spec["bucket_bytes"])
    if kind == "tensor":
        return ws.FromTensor(engines, layout)
    return ws.Frozen()


class _TrainerRank:
    """One trainer rank (a Ray actor body): torch.distributed among the ranks, then the trainer of the config."""

    def address(self) -> tuple[str, int]:
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, rank: int, world: int, master: tuple[str, int], tc: dict[str, Any], model_path: str, pad_id: int,
              device: str) -> None:
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0",
                           "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1])})
        from slime_env.trainers.torch_trainer import TrainerConfig

        self.rank = rank
        self.trainer = make_trainer(TrainerConfig(**tc), model_path, None, pad_id, device)
        self.channel = None

    def step(self, trajectories: list[Any], group_size: int) -> dict[str, float]:
        return self.trainer.step(trajectories, group_size)

    def sft_step(self, trajectories: list[Any], lr: float | None) -> dict[str, float]:
        return self.trainer.sft_step(trajectories, lr=lr)

    def step_count(self) -> int:
        return self.trainer.step_count

    async def sync(self, spec: dict[str, Any], engines: list[tuple[str, int]], version: str) -> dict[str, float]:
        """Every rank gathers the weights (a collective under TP); rank 0 pushes them to `engines` ((url, token)
        pairs: a new token at a known URL is a restarted engine, which the channel's group must take in anew)."""
        adapter = getattr(self.trainer, "syncs_adapter", False)  # LoRA: the adapter alone
        weights = self.trainer.adapter() if adapter else self.trainer.weights()
        if self.rank != 0:
            return {}
        from slime_env.clients.sglang import SGLangPolicy

        if self.channel is None:
            self.clients: dict[tuple[str, int], Any] = {}
            self.channel = _rank_channel(spec["kind"], spec, lambda: self.current, self.trainer.weight_layout())
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

    def load(self, path: str) -> None:
        self.trainer.load(path)


class RayTrainerGroup:
    """The trainer ranks as Ray actors (see the module docstring)."""

    def __init__(self, placement: Placement, tc: Any, model_path: str, pad_id: int, device: str):
        from slime_env.trainers.run.placement import ray_module

        ray = ray_module()
        self.placement, self.tc = placement, tc
        cls = ray.remote(_TrainerRank)
        self.actors = [cls.options(**placement.trainer_options(r)).remote() for r in range(placement.cfg.ranks)]
        master = ray.get(self.actors[0].address.remote())
        ray.get([a.setup.remote(r, len(self.actors), master, asdict(tc), model_path, pad_id, device)
                 for r, a in enumerate(self.actors)])
        self._steps = 0

    @classmethod
    def make(cls, placement: Placement, tc: Any, engines: Any, pad_id: int, device: str) -> RayTrainerGroup:
        return cls(placement, tc, engines.model_path, pad_id, device)

    @property
    def step_count(self) -> int:
        return self._steps

    def channel(self, engines: Any) -> Any:
        """The channel's spec (rank 0 builds the channel in its process) and the engines it reaches."""
        if engines.cfg.kind == "vllm":
            raise InvalidInput("engine.kind vllm is not offered with cluster.backend ray yet (its channels run in the "
                               "driver's process); use cluster.backend local / torchrun")
        kind = "inplace" if engines.embedded else engines.channel_kind()
        if kind not in ("distributed", "tensor", "none"):
            raise InvalidInput(f"engine.weight_sync {engines.cfg.weight_sync!r} is not offered with cluster.backend "
                               "ray")
        return _RemoteChannel(self, engines, {"kind": kind, "backend": engines.backend(),
                                              "bucket_bytes": engines.cfg.bucket_mb << 20})

    async def step(self, trajectories: list[Any], group_size: int) -> dict[str, float]:
        from slime_env.trainers.run.placement import ray_module

        ref = ray_module().put(trajectories)
        results = await asyncio.gather(*(a.step.remote(ref, group_size) for a in self.actors))
        self._steps += 1
        return results[0]

    async def sft_step(self, trajectories: list[Any], lr: float | None = None) -> dict[str, float]:
        from slime_env.trainers.run.placement import ray_module

        ref = ray_module().put(trajectories)
        return (await asyncio.gather(*(a.sft_step.remote(ref, lr) for a in self.actors)))[0]

    async def sync(self, channel: Any, version: str) -> dict[str, float]:
        engines = [(e.url, id(e)) for e in channel.engines.pool.targets()]
        results = await asyncio.gather(*(a.sync.remote(channel.spec, engines, version) for a in self.actors))
        return results[0]

    def save(self, path: Any) -> None:
        from slime_env.trainers.run.placement import ray_module

        ray_module().get([a.save.remote(str(path)) for a in self.actors])

    def load(self, path: Any) -> None:
        from slime_env.trainers.run.placement import ray_module

        ray = ray_module()
        ray.get([a.load.remote(str(path)) for a in self.actors])
        self._steps = ray.get(self.actors[0].step_count.remote())

    def weights(self) -> dict[str, Any]:
        from slime_env.trainers.run.placement import ray_module

        # every rank joins: TP, PP and EP gather the full weights collectively; rank 0's copy is returned
        return ray_module().get([a.weights.remote() for a in self.actors])[0]

    def close(self) -> None:
        from slime_env.trainers.run.placement import ray_module

        ray = ray_module()
        for a in self.actors:
            ray.kill(a)


@dataclass
class _RemoteChannel:
    """What the run holds for a Ray trainer group: rank 0 owns the real channel."""

    group: RayTrainerGroup
    engines: Any
    spec: dict[str, Any]

    async def close(self) -> None:
        return None


# cluster.backend -> make(placement, TrainerConfig, engines, pad_id, device)
TRAINER_GROUPS: dict[str, Callable[..., Any]] = {"local": LocalTrainerGroup.make, "ray": RayTrainerGroup.make}
