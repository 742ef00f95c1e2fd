"""The roles of a training run, stated as contracts: what `slime_env.trainers.run.loop` may rely on, and all it uses.

A run is four roles and the loop between them (DESIGN.md, "three roles and one channel"):

- `Engines` generate (the embedded engine, or servers speaking SGLang's or OpenAI's API);
- the `TrainerGroup` turns batches into gradient steps (one process, or ranks as Ray actors);
- a `WeightChannel` carries the trainer's weights to the engines (the trainer group owns it: `sync(version)`);
- the `BatchSource` hands the trainer its batches — the async mode lives in it and nowhere else.

Each kind is picked from a small registry: `engines.STARTS` (by `engine.kind`), `channel.make_channel` (by the
`ChannelSpec` that `Engines.channel_spec` resolves from `engine.weight_sync`), `trainer_group.TRAINER_GROUPS` /
`trainer_group.BACKENDS` (by `cluster.backend` / `trainer.backend`), `sources.SOURCES` (by `async.mode`). These
Protocols are checked by nothing at run time; they are the documentation of what an implementation must do, and
`isinstance` works on them (`runtime_checkable`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from slime_env.agents.lora_adapter import LoRAAdapter
    from slime_env.policy import Policy
    from slime_env.rollout import Batch, RolloutManager
    from slime_env.trajectory import Trajectory
    from slime_env.types import Task


@runtime_checkable
class WeightChannel(Protocol):
    """Carries one trainer's weights to every engine (`slime_env.trainers.weight_sync`)."""

    async def push(self, weights: Mapping[str, torch.Tensor], version: str) -> dict[str, float]:
        """Make `weights` (HF names, the trainer model's own layout) the engines' weights, as version `version`.

        When it returns, every engine the channel reaches generates with the new weights, and no request saw half of
        them (a multi-call update pauses generation; a one-call update is atomic on the engine). Whatever leaves the
        trainer's process is sent in the engine-bound layout (`slime_env.agents.weight_layout`: per-expert MoE
        names, one copy of tied tensors, the layout's dtype) — the same tensors as the trainer's checkpoint. Returns
        metrics (`sync/s`, and per channel `sync/bytes`, `sync/group_s`, `sync/save_s`). Raises on failure; the
        engines may then hold either version, and the next push starts over."""
        ...

    async def push_adapter(self, adapter: LoRAAdapter, version: str) -> dict[str, float]:
        """Make `adapter` (a LoRA adapter over the engines' base weights) the engines' as version `version`: loaded by
        name and version (`{name}@{version}`), the older ones beyond the newest few unloaded. Same guarantees as
        `push`."""
        ...

    async def close(self) -> None:
        """Release what the channel holds (a torch.distributed group, a folder); idempotent."""
        ...


@runtime_checkable
class Engines(Protocol):
    """The engines of a run (`slime_env.trainers.run.engines.Engines`)."""

    policy: Policy
    """The `slime_env.Policy` the rollout manager and the evaluation generate with (one engine, or a pool)."""
    tokenizer: PreTrainedTokenizerBase
    """The model's tokenizer (the renderer's, the trainer's pad id)."""
    model_path: str
    """The model folder the trainer starts from (the same weights the engines serve)."""
    embedded: bool
    """The engine runs in this process (its model can be snapshotted, its K/V memory released)."""

    async def start(self) -> None:
        """Start or reach every engine. Returns once each answers and serves the trainer's model; otherwise an
        `InvalidInput` naming the config field (`engine.urls[0]: ...`), before any training."""
        ...

    def targets(self) -> Sequence[Policy]:
        """The engine servers a weight sync must reach now (a restarted one included; none when embedded). Which
        channel reaches them is the engines' to say (`slime_env.trainers.run.engines.Engines.channel_spec`), the
        trainer group's to make (`slime_env.trainers.run.channel.make_channel`)."""
        ...

    def synced(self) -> None:
        """A push reached every target: engines that came back (restarted, stale) rejoin the rotation."""
        ...

    async def wait_restarts(self) -> None:
        """Return once the engine restarts under way are done (those engines then wait for the next push)."""
        ...

    def gone(self) -> str | None:
        """Why no engine is left to generate with (the engines' last errors), or None while one is up."""
        ...

    def metrics(self) -> dict[str, float]:
        """Health of the engines for the step's row (`engines/up`, `engines/failovers`; empty when embedded)."""
        ...

    async def release_memory(self) -> None:
        """The engines give their memory back while a colocated trainer steps (the embedded engine's K/V pool, engine
        servers' `/release_memory_occupation`; a no-op for engines without it)."""
        ...

    async def resume_memory(self) -> None:
        """Engine servers take their memory back, before the weights arrive (the embedded engine does on its own)."""
        ...

    async def close(self) -> None:
        """Stop what this run started and close every client; idempotent."""
        ...


@runtime_checkable
class TrainerGroup(Protocol):
    """The trainer of a run over one process or many ranks (`slime_env.trainers.run.trainer_group`)."""

    @property
    def step_count(self) -> int:
        """RL steps taken (a resumed run continues from its checkpoint's)."""
        ...

    async def step(self, trajectories: Sequence[Trajectory], group_size: int) -> dict[str, float]:
        """One RL update on consecutive groups of `group_size` trajectories; its `train/*` metrics (at least
        `train/reward_mean` and `train/step_s`). Every rank takes the same trajectories; the event loop is never
        blocked (the step runs in a thread or in the actors)."""
        ...

    async def sft_step(self, trajectories: Sequence[Trajectory], lr: float | None = None) -> dict[str, float]:
        """One supervised step on the trajectories' loss-masked tokens (not counted in `step_count`); `sft/*`."""
        ...

    async def sync(self, version: str) -> dict[str, float]:
        """Push the current weights to the engines as `version` through the group's own weight channel, made once when
        the group was (`make_channel`): the LoRA adapter alone under `trainer.lora.sync: adapter`
        (`weight_sync.push_trainer`). Every rank gathers; the pushing ranks send. Returns the channel's metrics."""
        ...

    def weights(self) -> dict[str, torch.Tensor]:
        """The current full weights with HF names, in the model's own layout (a collective under TP / PP / EP)."""
        ...

    def save(self, path: str | Path) -> None:
        """A checkpoint under `path`: `path/model` (an HF folder in the engine-bound layout), optimizer, step."""
        ...

    def load(self, path: str | Path) -> None:
        """Resume from a `save` (or weights alone from any HF folder of the architecture)."""
        ...

    def save_weights(self, path: str | Path) -> None:
        """The HF model folder alone at `path`: what an engine loads (with LoRA, the merged weights)."""
        ...

    async def close_channel(self) -> None:
        """Close the weight channel (before `close`); the engines keep the weights they hold."""
        ...

    def close(self) -> None:
        """Give the trainer's processes back."""
        ...


@runtime_checkable
class BatchSource(Protocol):
    """Where each step's batch comes from (`slime_env.trainers.run.sources`): the async mode lives here only."""

    @property
    def generates_while_training(self) -> bool:
        """Whether the engines generate while the trainer steps (an async mode: their memory stays)."""
        ...

    def tasks(self, train_tasks: Sequence[Task], steps: int, start: int) -> list[Task]:
        """The tasks the rollout manager runs, in order, for steps `start + 1 .. steps`."""
        ...

    def manager_options(self) -> dict[str, Any]:
        """The `RolloutManager` keywords the mode decides (groups to skip, partial rollouts)."""
        ...

    def attach(self, manager: RolloutManager, version: int) -> None:
        """Generate with `manager`; the engines hold weight version `version`. Called once, before `next`."""
        ...

    async def next(self, step: int, last: bool) -> Batch:
        """Step `step`'s batch (a `slime_env.rollout.Batch` of `prompts_per_step` groups); `last`: no step follows,
        so nothing is generated ahead."""
        ...

    def trained(self, batch: Batch) -> None:
        """`batch` is in the trainer's weights now."""
        ...

    async def before_sync(self) -> None:
        """A weight update is about to start: generation in flight finishes or pauses, as the mode says."""
        ...

    def after_sync(self, version: int) -> None:
        """The engines hold `version`: generation goes on with it."""
        ...

    def metrics(self, batch: Batch, step: int) -> dict[str, Any]:
        """The mode's metrics of the batch trained at `step` (staleness, stale groups)."""
        ...

    def state(self) -> dict[str, Any] | None:
        """What a checkpoint keeps for a resumed run of this mode (None: nothing)."""
        ...

    def restore(self, state: Mapping[str, Any]) -> None:
        """Take back a checkpoint's `state()` (before `tasks`)."""
        ...

    async def close(self) -> None:
        """Stop generating (in-flight episodes are aborted); idempotent."""
        ...
