"""Where a training run's roles run, from the run config's `cluster:` section: this process, or a Ray cluster.

```yaml
cluster:
  backend: ray              # local (one process: the trainer beside the rollout manager) | ray
  address: auto             # an existing cluster (`ray start --head` on one node, `ray start --address=HEAD:6379`
                            # on the others); empty: a local Ray started here
  trainer: {nodes: 1, gpus_per_node: 2}   # trainer ranks = nodes x gpus_per_node, one Ray actor each (Megatron TP x DP)
  rollout: {gpus: 2, gpus_per_engine: 1}  # engines this run starts (engine.kind serve), one Ray actor each
  colocate: false           # true: engines share the trainer's GPUs (fractions of the same bundles)
  num_gpus: 2               # a local Ray only: GPUs to declare (CPU hosts declare them to test placement)
```

One placement group holds a bundle per trainer rank and one per engine (`colocate`: one per GPU, shared), spread
over the nodes. Trainer ranks are `_TrainerRank` actors: they set up torch.distributed among themselves (rank 0's
node address and a free port come from Ray, nothing is typed by hand) and every one takes the same trajectories
(Megatron splits the rows by DP rank); rank 0 pushes the weights to the engines through the channel. Engines are
`_EngineHost` actors, each running a `slime-env serve-engine` process on its bundle's node (its GPUs are the
actor's), reachable at that node's address. The driver runs the rollout manager.

Multi-node needs, from every node: the head's Ray port (6379 by default), and the trainer's and engines' ports open
between nodes (the engines' HTTP ports; the weight-update group's rendezvous port on rank 0's node; NCCL's).
"""

from __future__ import annotations

import asyncio
import copy
import os
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from slime_env.trainers.sections import parse_section

from slime_env.errors import InvalidInput

if TYPE_CHECKING:
    from slime_env.trainers.torch_trainer import TorchTrainer, TrainerConfig


@dataclass
class ClusterConfig:
    """`cluster:` of the run config (see the module docstring)."""

    backend: str = "local"
    address: str | None = None
    trainer: dict[str, int] = field(default_factory=lambda: {"nodes": 1, "gpus_per_node": 1})
    rollout: dict[str, int] = field(default_factory=lambda: {"gpus": 0, "gpus_per_engine": 1})
    colocate: bool = False
    num_gpus: int | None = None
    num_cpus: int | None = None

    @classmethod
    def from_dict(cls, raw: Any, where: str = "cluster") -> ClusterConfig:
        cfg = parse_section(cls, raw, where)
        if cfg.backend not in ("local", "ray"):
            raise InvalidInput(f"{where}.backend: {cfg.backend!r} is not 'local' or 'ray'")
        cfg.trainer = {"nodes": 1, "gpus_per_node": 1, **(cfg.trainer or {})}
        cfg.rollout = {"gpus": 0, "gpus_per_engine": 1, **(cfg.rollout or {})}
        for section, keys in (("trainer", ("nodes", "gpus_per_node")), ("rollout", ("gpus", "gpus_per_engine"))):
            values = getattr(cfg, section)
            bad = sorted(set(values) - set(keys))
            if bad:
                raise InvalidInput(f"{where}.{section}: unknown field(s) {bad}; known: {list(keys)}")
            for k in keys:
                if not isinstance(values[k], int) or values[k] < (0 if k == "gpus" else 1):
                    raise InvalidInput(f"{where}.{section}.{k}: expected an integer >= {0 if k == 'gpus' else 1}, "
                                       f"got {values[k]!r}")
        return cfg

    @property
    def ranks(self) -> int:
        return self.trainer["nodes"] * self.trainer["gpus_per_node"]

    @property
    def engines(self) -> int:
        return self.rollout["gpus"] // self.rollout["gpus_per_engine"]

    def check(self, engine: Any, trainer: Any, where: str = "config") -> None:
        """Sizes that must agree between the sections, refused with the numbers named before anything starts."""
        if self.backend == "local":
            if self.ranks > 1:
                raise InvalidInput(f"{where}: cluster.trainer asks for {self.ranks} trainer ranks; backend 'local' "
                                   "runs one (use backend: ray)")
            return
        if engine.gpus:
            raise InvalidInput(f"{where}: engine.gpus places engines on this host; cluster.backend ray places them "
                               "on its bundles (cluster.rollout)")
        if engine.kind == "embedded":
            raise InvalidInput(f"{where}: cluster.backend ray places engine servers; engine.kind 'embedded' runs in "
                               "the trainer's process (use kind: serve)")
        if self.ranks > 1 and trainer.backend == "torch":
            raise InvalidInput(f"{where}: cluster.trainer has {self.ranks} ranks; trainer.backend "
                               f"{trainer.backend!r} runs on one device (use backend: megatron or fsdp)")
        sizes = {"tp": trainer.tp, "ep": trainer.ep, "cp": trainer.cp, "pp": trainer.pp,
                 "tp x cp x pp": trainer.tp * trainer.cp * trainer.pp}
        for name, n in sizes.items():
            if self.ranks % n:
                raise InvalidInput(f"{where}: trainer.{name} {n} does not divide the "
                                   f"{self.ranks} trainer ranks (cluster.trainer nodes x gpus_per_node)")
        if self.rollout["gpus"] % self.rollout["gpus_per_engine"]:
            raise InvalidInput(f"{where}: cluster.rollout.gpus_per_engine {self.rollout['gpus_per_engine']} does "
                               f"not divide cluster.rollout.gpus {self.rollout['gpus']}")
        if engine.kind == "serve" and not engine.urls and self.rollout["gpus"] and self.engines != engine.count:
            raise InvalidInput(f"{where}: cluster.rollout gives {self.engines} engines (gpus {self.rollout['gpus']} "
                               f"/ gpus_per_engine {self.rollout['gpus_per_engine']}) but engine.count is "
                               f"{engine.count}")
        if engine.weight_sync == "disk":
            raise InvalidInput(f"{where}: engine.weight_sync disk is not offered with cluster.backend ray "
                               "(use distributed, or tensor with colocate: true)")


class Placement:
    """The cluster of one run: `spawn_engine` starts an engine process where it belongs, `trainer_group` makes
    the trainer group; `close()` gives everything back."""

    def __init__(self, cfg: ClusterConfig, engines: int = 0):
        """`engines`: how many engine processes this run starts (a bundle each unless colocated)."""
        self.cfg = cfg
        self.group = None  # the Ray placement group
        self._bundle = 0
        if cfg.backend == "ray":
            ray = _ray()
            if not ray.is_initialized():
                if cfg.address:
                    ray.init(address=cfg.address, include_dashboard=False, log_to_driver=False)
                else:
                    ray.init(num_gpus=cfg.num_gpus, num_cpus=cfg.num_cpus, include_dashboard=False,
                             log_to_driver=False)
            self.gpus = bool(ray.cluster_resources().get("GPU", 0))
            from ray.util.placement_group import placement_group

            trainer = [{"CPU": 1, **({"GPU": 1} if self.gpus else {})} for _ in range(cfg.ranks)]
            per_engine = cfg.rollout["gpus_per_engine"] if self.gpus else 0
            engines = [] if cfg.colocate else \
                [{"CPU": 1, **({"GPU": per_engine} if per_engine else {})} for _ in range(engines)]
            self.group = placement_group(trainer + engines, strategy="PACK")
            ray.get(self.group.ready(), timeout=600)
            self._engine_bundles = list(range(cfg.ranks)) if cfg.colocate else \
                list(range(cfg.ranks, cfg.ranks + len(engines)))

    # --- engines ---------------------------------------------------------------------------------------------
    def spawn_engine(self, index: int, **kwargs: Any) -> Any:
        """A process-like engine (`slime_env.agents.launcher.ServeProcess`'s interface) for engine `index`."""
        if self.cfg.backend == "local":
            from slime_env.agents.launcher import ServeProcess

            return ServeProcess(**kwargs)
        return _RayServeProcess(self, index, kwargs)

    def _actor_options(self, bundle: int, gpus: float) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"num_cpus": 0.5 if self.cfg.colocate else 1, "num_gpus": gpus,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=self.group,
                                                                        placement_group_bundle_index=bundle)}

    # --- the trainer group -------------------------------------------------------------------------------------
    def trainer_group(self, tc: Any, engines: Any, pad_id: int, device: str) -> Any:
        if self.cfg.backend == "local":
            return LocalTrainerGroup(make_trainer(tc, engines.model_path, engines.policy if engines.embedded else None,
                                                  pad_id, device))
        return RayTrainerGroup(self, tc, engines.model_path, pad_id, device)

    def close(self) -> None:
        if self.group is not None:
            ray = _ray()
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)
            self.group = None
            if not self.cfg.address:
                ray.shutdown()


class LocalTrainerGroup:
    """The trainer in this process."""

    def __init__(self, trainer: Any):
        self.trainer = trainer

    @property
    def step_count(self) -> int:
        return self.trainer.step_count

    def channel(self, engines: Any) -> Any:
        return engines.channel(save=self.trainer.save_weights)

    async def step(self, trajectories: list[Any], group_size: int) -> dict[str, float]:
        return await asyncio.to_thread(self.trainer.step, trajectories, group_size)

    async def sft_step(self, trajectories: list[Any], lr: float | None = None) -> dict[str, float]:
        return await asyncio.to_thread(lambda: self.trainer.sft_step(trajectories, lr=lr))

    async def sync(self, channel: Any, version: str) -> dict[str, float]:
        return await channel.push(self.trainer.weights(), version)

    def save(self, path: Any) -> None:
        self.trainer.save(path)

    def load(self, path: Any) -> None:
        self.trainer.load(path)

    def weights(self) -> dict[str, Any]:
        return self.trainer.weights()

    def close(self) -> None:
        return None


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
        weights = self.trainer.weights()
        if self.rank != 0:
            return {}
        from slime_env.agents.sglang_policy import SGLangPolicy
        from slime_env.trainers import weight_sync as ws

        if self.channel is None:
            self.clients: dict[tuple[str, int], Any] = {}
            if spec["kind"] == "distributed":
                import ray

                self.channel = ws.Distributed(lambda: self.current, backend=spec["backend"],
                                              master_address=ray.util.get_node_ip_address(),
                                              bucket_bytes=spec["bucket_bytes"])
            elif spec["kind"] == "tensor":
                self.channel = ws.FromTensor(lambda: self.current)
            else:
                self.channel = ws.Frozen()
        for key in set(self.clients) - set(engines):
            await self.clients.pop(key).close()
        self.current = [self.clients.setdefault(key, SGLangPolicy(key[0])) for key in engines]
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
        ray = _ray()
        from dataclasses import asdict

        self.placement, self.tc = placement, tc
        cls = ray.remote(_TrainerRank)
        cfg = placement.cfg
        gpu = (0.5 if cfg.colocate else 1) if placement.gpus else 0
        self.actors = [cls.options(**placement._actor_options(r, gpu)).remote() for r in range(cfg.ranks)]
        master = ray.get(self.actors[0].address.remote())
        ray.get([a.setup.remote(r, len(self.actors), master, asdict(tc), model_path, pad_id, device)
                 for r, a in enumerate(self.actors)])
        self._steps = 0

    @property
    def step_count(self) -> int:
        return self._steps

    def channel(self, engines: Any) -> Any:
        """The channel's spec (rank 0 builds the channel in its process) and the engines it reaches."""
        channel = engines.channel()
        kind = {"Distributed": "distributed", "FromTensor": "tensor", "Frozen": "none"}.get(type(channel).__name__)
        if kind is None:
            raise InvalidInput(f"engine.weight_sync {engines.cfg.weight_sync!r} is not offered with cluster.backend "
                               "ray")
        return _RemoteChannel(self, engines, {"kind": kind, "backend": getattr(channel, "backend", None),
                                              "bucket_bytes": getattr(channel, "bucket_bytes", 0)})

    async def step(self, trajectories: list[Any], group_size: int) -> dict[str, float]:
        ray = _ray()
        ref = ray.put(trajectories)
        results = await asyncio.gather(*(a.step.remote(ref, group_size) for a in self.actors))
        self._steps += 1
        return results[0]

    async def sft_step(self, trajectories: list[Any], lr: float | None = None) -> dict[str, float]:
        ref = _ray().put(trajectories)
        return (await asyncio.gather(*(a.sft_step.remote(ref, lr) for a in self.actors)))[0]

    async def sync(self, channel: Any, version: str) -> dict[str, float]:
        engines = [(e.url, id(e)) for e in channel.engines.pool.targets()]
        results = await asyncio.gather(*(a.sync.remote(channel.spec, engines, version) for a in self.actors))
        return results[0]

    def save(self, path: Any) -> None:
        _ray().get([a.save.remote(str(path)) for a in self.actors])

    def load(self, path: Any) -> None:
        ray = _ray()
        ray.get([a.load.remote(str(path)) for a in self.actors])
        self._steps = ray.get(self.actors[0].step_count.remote())

    def weights(self) -> dict[str, Any]:
        # every rank joins: TP, PP and EP gather the full weights collectively; rank 0's copy is returned
        return _ray().get([a.weights.remote() for a in self.actors])[0]

    def close(self) -> None:
        ray = _ray()
        for a in self.actors:
            ray.kill(a)


@dataclass
class _RemoteChannel:
    """What the train loop holds for a Ray trainer group: rank 0 owns the real channel."""
    group: RayTrainerGroup
    engines: Any
    spec: dict[str, Any]

    async def close(self) -> None:
        return None


class _EngineHost:
    """A Ray actor body that runs one `slime-env serve-engine` process on its node."""

    def __init__(self, kwargs: dict[str, Any]):
        import ray
        from slime_env.agents.launcher import ServeProcess

        self.process = ServeProcess(**{**kwargs, "host": ray.util.get_node_ip_address()})

    def start(self) -> str:
        return self.process._start()

    def alive(self) -> bool:
        return self.process.alive()

    def stop(self) -> None:
        self.process.stop()

    def kill(self) -> None:
        self.process.kill()


class _RayServeProcess:
    """`ServeProcess`'s interface over an `_EngineHost` actor on the engine's bundle."""

    def __init__(self, placement: Placement, index: int, kwargs: dict[str, Any]):
        ray = _ray()
        cfg = placement.cfg
        bundle = placement._engine_bundles[index % len(placement._engine_bundles)]
        gpus = (0.5 if cfg.colocate else cfg.rollout["gpus_per_engine"]) if placement.gpus else 0
        self.actor = ray.remote(_EngineHost).options(**placement._actor_options(bundle, gpus)).remote(kwargs)
        self.url: str | None = None

    async def start(self) -> str:
        self.url = await self.actor.start.remote()
        return self.url

    def alive(self) -> bool:
        return _ray().get(self.actor.alive.remote(), timeout=30)

    def stop(self) -> None:
        _ray().get(self.actor.stop.remote(), timeout=60)

    def kill(self) -> None:
        _ray().get(self.actor.kill.remote(), timeout=60)


def _ray():
    try:
        import ray
    except ImportError:
        raise InvalidInput("cluster.backend ray needs Ray: pip install 'slime_env[ray]'") from None
    return ray


def make_trainer(tc: TrainerConfig, model_path: str, policy: Any, pad_id: int, device: str = "auto") -> TorchTrainer:
    """`TorchTrainer`, `MegatronTrainer` or `FSDPTrainer` from float32 weights of `model_path`; next to an embedded `policy` it trains
    on the engine's device and reuses its float32 weights as the starting point (no second read)."""
    import torch
    from slime_env.trainers.torch_trainer import TorchTrainer
    from transformers import AutoModelForCausalLM

    if policy is not None and getattr(policy, "model", None) is not None and policy.model.dtype == torch.float32:
        source = policy.model  # already the float32 weights: no second read
    else:
        source = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    if tc.backend == "megatron":
        from slime_env.trainers.megatron_trainer import MegatronTrainer

        return MegatronTrainer(source, tc, pad_id=pad_id)  # reads the weights; keeps no reference to `source`
    if tc.backend == "fsdp":
        from slime_env.trainers.fsdp_trainer import FSDPTrainer

        # FSDP shards its model in place: never the engine's
        return FSDPTrainer(copy.deepcopy(source) if source is getattr(policy, "model", None) else source, tc,
                           pad_id=pad_id)
    if policy is not None and getattr(policy, "device", None) is not None:
        target = policy.device
    else:
        from slime_env.agents.default_model import resolve_device

        target = resolve_device(device)[0]
    # TorchTrainer updates its model in place: it must not be the engine's
    return TorchTrainer((copy.deepcopy(source) if policy is not None and source is getattr(policy, "model", None)
                         else source).to(target), tc, pad_id=pad_id)
