"""Where a training run's roles run, from the run config's `cluster:` section: this process, child processes on this
host, or a Ray cluster.

```yaml
cluster:
  backend: ray              # local (one process: the trainer beside the rollout manager) | process (the trainer's
                            # ranks in child processes of the run, rank r on GPU r; engines on this host) | ray
  address: auto             # an existing cluster (`ray start --head` on one node, `ray start --address=HEAD:6379`
                            # on the others); empty: a local Ray started here
  trainer: {nodes: 1, gpus_per_node: 2}   # trainer ranks = nodes x gpus_per_node, one Ray actor each (Megatron TP x DP)
  rollout: {gpus: 2, gpus_per_engine: 1}  # engines this run starts (engine.kind serve), one Ray actor each
  colocate: false           # true: engines share the trainer's GPUs (fractions of the same bundles)
  num_gpus: 2               # a local Ray only: GPUs to declare (CPU hosts declare them to test placement)
```

One placement group holds a bundle per trainer rank and one per engine (`colocate`: one per GPU, shared), spread
over the nodes. This module only places: trainer ranks go on their bundles (`trainer_options`; the ranks themselves
are `slime_env.trainers.run.trainer_group`'s), engines are `_EngineHost` actors, each running a `slime-env
serve-engine` process on its bundle's node (its GPUs are the actor's), reachable at that node's address. The driver
runs the rollout manager.

Multi-node needs, from every node: the head's Ray port (6379 by default), and the trainer's and engines' ports open
between nodes (the engines' HTTP ports; the weight-update group's rendezvous port on rank 0's node; NCCL's).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from slime_env.errors import InvalidInput
from slime_env.trainers.config_fields import parse_section

if TYPE_CHECKING:
    from slime_env.agents.launcher import ServeProcess
    from slime_env.trainers.run.engines import EngineConfig
    from slime_env.trainers.torch_trainer import TrainerConfig


BACKENDS = ("local", "process", "ray")


@dataclass(frozen=True)
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
    def from_dict(cls, raw: object, where: str = "cluster") -> ClusterConfig:
        cfg = parse_section(cls, raw, where)
        if cfg.backend not in BACKENDS:
            raise InvalidInput(f"{where}.backend: {cfg.backend!r} is not one of {list(BACKENDS)}")
        cfg = replace(cfg, trainer={"nodes": 1, "gpus_per_node": 1, **(cfg.trainer or {})},
                      rollout={"gpus": 0, "gpus_per_engine": 1, **(cfg.rollout or {})})
        for section, keys in (("trainer", ("nodes", "gpus_per_node")), ("rollout", ("gpus", "gpus_per_engine"))):
            values = getattr(cfg, section)
            bad = sorted(set(values) - set(keys))
            if bad:
                raise InvalidInput(f"{where}.{section}: unknown field(s) {bad}; known: {list(keys)}")
            for k in keys:
                if (not isinstance(values[k], int) or isinstance(values[k], bool)
                        or values[k] < (0 if k == "gpus" else 1)):
                    raise InvalidInput(f"{where}.{section}.{k}: expected an integer >= {0 if k == 'gpus' else 1}, "
                                       f"got {values[k]!r}")
        return cfg

    @property
    def ranks(self) -> int:
        return self.trainer["nodes"] * self.trainer["gpus_per_node"]

    @property
    def engines(self) -> int:
        return self.rollout["gpus"] // self.rollout["gpus_per_engine"]

    def _check_sizes(self, trainer: TrainerConfig, where: str) -> None:
        if self.ranks > 1 and trainer.backend == "torch":
            raise InvalidInput(f"{where}: cluster.trainer has {self.ranks} ranks; trainer.backend "
                               f"{trainer.backend!r} runs on one device (use backend: megatron or fsdp)")
        sizes = {"tp": trainer.tp, "ep": trainer.ep, "cp": trainer.cp, "pp": trainer.pp,
                 "tp x cp x pp": trainer.tp * trainer.cp * trainer.pp}
        for name, n in sizes.items():
            if self.ranks % n:
                raise InvalidInput(f"{where}: trainer.{name} {n} does not divide the "
                                   f"{self.ranks} trainer ranks (cluster.trainer nodes x gpus_per_node)")

    def check(self, engine: EngineConfig, trainer: TrainerConfig, where: str = "config") -> None:
        """Sizes that must agree between the sections, refused with the numbers named before anything starts."""
        if self.backend == "local":
            if self.ranks > 1:
                raise InvalidInput(f"{where}: cluster.trainer asks for {self.ranks} trainer ranks; backend 'local' "
                                   "runs one (use backend: process or ray)")
            return
        if engine.kind == "embedded":
            raise InvalidInput(f"{where}: cluster.backend {self.backend} runs the trainer in other processes; "
                               "engine.kind 'embedded' runs in the run's own (use kind: serve)")
        if engine.kind == "vllm":
            raise InvalidInput(f"{where}: engine.kind vllm is not offered with cluster.backend {self.backend} yet "
                               "(its weight channels run in the driver's process); use cluster.backend local")
        if self.backend == "process":
            if self.trainer["nodes"] != 1:
                raise InvalidInput(f"{where}: cluster.trainer.nodes {self.trainer['nodes']}: backend 'process' runs "
                                   "on this host (use backend: ray across nodes)")
            if self.rollout["gpus"] or self.colocate:
                raise InvalidInput(f"{where}: cluster.rollout and cluster.colocate place engines on Ray bundles; with "
                                   "backend 'process' engines go on this host's GPUs by engine.gpus")
            self._check_sizes(trainer, where)
            return
        if engine.gpus:
            raise InvalidInput(f"{where}: engine.gpus places engines on this host; cluster.backend ray places them "
                               "on its bundles (cluster.rollout)")
        self._check_sizes(trainer, where)
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
    """The cluster of one run: `spawn_engine` starts an engine process where it belongs, `trainer_options` places a
    trainer rank (`slime_env.trainers.run.trainer_group`); `close()` gives everything back."""

    def __init__(self, cfg: ClusterConfig, engines: int = 0):
        """`engines`: how many engine processes this run starts (a bundle each unless colocated)."""
        self.cfg = cfg
        self.group = None  # the Ray placement group
        self._bundle = 0
        if cfg.backend == "ray":
            ray = ray_module()
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
    def spawn_engine(self, index: int, **kwargs: Any) -> ServeProcess | _RayServeProcess:
        """A process-like engine (`slime_env.agents.launcher.ServeProcess`'s interface) for engine `index`."""
        if self.cfg.backend != "ray":
            from slime_env.agents.launcher import ServeProcess

            return ServeProcess(**kwargs)
        return _RayServeProcess(self, index, kwargs)

    def _actor_options(self, bundle: int, gpus: float) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"num_cpus": 0.5 if self.cfg.colocate else 1, "num_gpus": gpus,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=self.group,
                                                                        placement_group_bundle_index=bundle)}

    # --- the trainer ranks (slime_env.trainers.run.trainer_group) ---------------------------------------------------
    def trainer_options(self, rank: int) -> dict[str, Any]:
        """Ray actor options of trainer rank `rank`: its bundle, a GPU (half of one when colocated) where there are."""
        gpu = (0.5 if self.cfg.colocate else 1) if self.gpus else 0
        return self._actor_options(rank, gpu)

    def close(self) -> None:
        if self.group is not None:
            ray = ray_module()
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)
            self.group = None
            if not self.cfg.address:
                ray.shutdown()


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
        ray = ray_module()
        cfg = placement.cfg
        bundle = placement._engine_bundles[index % len(placement._engine_bundles)]
        gpus = (0.5 if cfg.colocate else cfg.rollout["gpus_per_engine"]) if placement.gpus else 0
        self.actor = ray.remote(_EngineHost).options(**placement._actor_options(bundle, gpus)).remote(kwargs)
        self.url: str | None = None

    async def start(self) -> str:
        self.url = await self.actor.start.remote()
        return self.url

    def alive(self) -> bool:
        return ray_module().get(self.actor.alive.remote(), timeout=30)

    def stop(self) -> None:
        ray_module().get(self.actor.stop.remote(), timeout=60)

    def kill(self) -> None:
        ray_module().get(self.actor.kill.remote(), timeout=60)


def ray_module():
    try:
        import ray
    except ImportError:
        raise InvalidInput("cluster.backend ray needs Ray: pip install 'slime_env[ray]'") from None
    return ray
