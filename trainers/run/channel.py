"""The run's weight channel, made by one factory: `make_channel(spec, engines, ...)`.

`ChannelSpec` is `engine.weight_sync` as decided for this run (`Engines.channel_spec`: `auto` resolved against where
the engines and the trainer ranks are, see `slime_env.trainers.run.engines`), a small frozen value that pickles. The
trainer group makes its channel from it once: in the run's process (`cluster.backend: local`), or in each pushing
rank's process (Ray actors, child processes), where the spec travels. What a push sends — the weights, or the LoRA
adapter alone — is decided by `slime_env.trainers.weight_sync.push_trainer`, for every group and `trainer.sync`.

The channels themselves: `slime_env.trainers.weight_sync` (SGLang's routes: serve-engine, SGLang) and
`slime_env.trainers.vllm_sync` (vLLM's RL routes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slime_env.agents.weight_layout import WeightLayout
    from slime_env.trainers.run.roles import WeightChannel

KINDS = ("inplace", "distributed", "tensor", "disk", "none")
APIS = ("sglang", "vllm")

# The engine clients a channel reaches, asked at each push (a restarted engine is a new client).
Targets = Callable[[], Sequence[object]]
# The writer of a disk channel's model folder at a path, when not the layout's own (`WeightLayout.save_folder`).
FolderWriter = Callable[[Path], object]


@dataclass(frozen=True)
class ChannelSpec:
    """Which channel a run pushes through and how it is set up; picklable (it travels to the trainer ranks)."""

    kind: str                                   # inplace | distributed | tensor | disk | none
    folder: str                                 # the run's sync folder (disk: its versions; LoRA: `adapters`)
    api: str = "sglang"                         # the engines' weight routes: sglang (SGLang, serve-engine) | vllm
    backend: str = "gloo"                       # distributed: nccl | gloo
    master_address: str | None = "127.0.0.1"   # distributed: this host as the engines reach it (None: a Ray
    #                                             rank's node, found in its process)
    bucket_bytes: int = 512 << 20               # distributed: bytes per update call
    adapters: str = "adapters"                  # LoRA adapter versions: `folder/adapters`, the channel's alone
    keep_adapters: int = 2                      # LoRA adapter versions each engine keeps loaded
    pause_mode: str = "wait"                    # vllm: how a push pauses generation
    verify: bool = True                         # vllm: checksums compared after each push

    def __post_init__(self) -> None:
        if self.kind not in KINDS or self.api not in APIS:
            raise ValueError(f"ChannelSpec: kind {self.kind!r} / api {self.api!r}: one of {KINDS} / {APIS}")

    def for_rank(self, rank: int, node_address: str | None = None) -> ChannelSpec:
        """The spec as trainer rank `rank` builds it: its own adapter folder (ranks other than 0 push to engines on
        their GPU), and `node_address` where the master address is its node's (`None` in the spec)."""
        spec = self if rank == 0 else replace(self, adapters=f"adapters_rank{rank}")
        return spec if spec.master_address is not None else replace(spec, master_address=node_address)


def make_channel(spec: ChannelSpec, engines: Targets, *, layout: WeightLayout | None = None,
                 policy: object = None, save: FolderWriter | None = None) -> WeightChannel:
    """The channel `spec` names, to the engine clients `engines()` returns at each push (for `inplace`, the embedded
    `policy`), sending tensors in `layout` (default: as they are); `save(path)`: a writer of the disk channel's model
    folder other than the layout's. A channel that loads LoRA adapters on engine servers writes their versions in
    `spec.folder/spec.adapters` (emptied now) and keeps `spec.keep_adapters` loaded."""
    from slime_env.agents.weight_layout import WeightLayout

    channel = _MAKERS[spec.api, spec.kind](spec, engines, layout or WeightLayout(), policy, save)
    if hasattr(channel, "own_adapter_folder"):  # the channels over engine servers
        channel.own_adapter_folder(Path(spec.folder) / spec.adapters)
        channel.keep_adapters = spec.keep_adapters
    return channel


def _in_place(spec: ChannelSpec, engines: Targets, layout: WeightLayout, policy: object,
              save: FolderWriter | None) -> WeightChannel:
    from slime_env.trainers import weight_sync as ws

    return ws.InPlace(policy)


def _frozen(spec: ChannelSpec, engines: Targets, layout: WeightLayout, policy: object,
            save: FolderWriter | None) -> WeightChannel:
    from slime_env.trainers import weight_sync as ws

    return ws.Frozen()


def _distributed(spec: ChannelSpec, engines: Targets, layout: WeightLayout, policy: object,
                 save: FolderWriter | None) -> WeightChannel:
    from slime_env.trainers import weight_sync as ws

    return ws.Distributed(engines, backend=spec.backend, layout=layout, master_address=_address(spec),
                          bucket_bytes=spec.bucket_bytes)


def _tensor(spec: ChannelSpec, engines: Targets, layout: WeightLayout, policy: object,
            save: FolderWriter | None) -> WeightChannel:
    from slime_env.trainers import weight_sync as ws

    return ws.FromTensor(engines, layout)


def _disk(spec: ChannelSpec, engines: Targets, layout: WeightLayout, policy: object,
          save: FolderWriter | None) -> WeightChannel:
    from slime_env.trainers import weight_sync as ws

    return ws.FromDisk(engines, layout=layout, save=save, folder=spec.folder, scratch=True)


def _vllm_distributed(spec: ChannelSpec, engines: Targets, layout: WeightLayout, policy: object,
                      save: FolderWriter | None) -> WeightChannel:
    from slime_env.trainers import vllm_sync

    return vllm_sync.VLLMDistributed(engines, layout, master_address=_address(spec), bucket_bytes=spec.bucket_bytes,
                                     pause_mode=spec.pause_mode, verify=spec.verify)


def _vllm_tensor(spec: ChannelSpec, engines: Targets, layout: WeightLayout, policy: object,
                 save: FolderWriter | None) -> WeightChannel:
    from slime_env.trainers import vllm_sync

    return vllm_sync.VLLMFromTensor(engines, layout, pause_mode=spec.pause_mode, verify=spec.verify)


def _vllm_disk(spec: ChannelSpec, engines: Targets, layout: WeightLayout, policy: object,
               save: FolderWriter | None) -> WeightChannel:
    from slime_env.trainers import vllm_sync

    return vllm_sync.VLLMFromDisk(engines, layout=layout, save=save, folder=spec.folder, scratch=True,
                                  pause_mode=spec.pause_mode, verify=spec.verify)


def _address(spec: ChannelSpec) -> str:
    if spec.master_address is None:
        raise ValueError("ChannelSpec.master_address: None is a Ray rank's node; build it with for_rank")
    return spec.master_address


# (engine API, weight_sync kind) -> its channel. vLLM's engines are never embedded (kind vllm is a server).
_MAKERS: dict[tuple[str, str], Callable[..., WeightChannel]] = {
    ("sglang", "inplace"): _in_place, ("sglang", "distributed"): _distributed, ("sglang", "tensor"): _tensor,
    ("sglang", "disk"): _disk, ("sglang", "none"): _frozen,
    ("vllm", "distributed"): _vllm_distributed, ("vllm", "tensor"): _vllm_tensor, ("vllm", "disk"): _vllm_disk,
    ("vllm", "none"): _frozen,
}
