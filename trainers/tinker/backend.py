"""The model side of `slime-env serve-tinker`: a thin adapter from Tinker's calls to our trainers and our engine.

- A training client is a trainer of `--backend` that implements `slime_env.trainers.split_step.SplitStepTrainer`,
  with a LoRA (`trainer.lora`) of the requested rank over the base model (`TRAINERS`): `TorchTrainer` (each client
  has its own module tree; the base weights are one frozen copy), `FSDPTrainer` over one rank or several,
  `MegatronTrainer` at DP x TP (each of these two holds its own copy of the base). `forward` /
  `forward_backward` / `optim_step` are the trainer's, with Tinker's losses (`losses.py`) and Tinker's per-call Adam
  parameters. Over several ranks (torchrun) every rank holds this backend and runs each training call (`ranks.py`).
- `save_state` / `load_state` are the trainer's checkpoint (`save` / `load`: the adapter in PEFT's format,
  optimizer, step) plus the client's LoRA request (`tinker.json`, to recreate it from the checkpoint).
- A checkpoint or sampler path saved with `ttl_seconds` records when it expires (`expires.json` in its folder, read
  again after a restart on the same `--root`); once that time has passed, the next save sweeps every expired folder
  away and an access to the path removes it, then is refused as `CheckpointGone` (the server's 404).
- `save_weights_for_sampler` writes the trainer's adapter as a PEFT folder (a name saved again is a new version of
  that path: engines holding the old one reload it); `sample` pushes it to an embedded
  `TransformersPolicy` through the weight-sync channel (`trainers.weight_sync.channel_for` -> `InPlace.push_adapter`:
  the engine merges it), the path an RL run's weights take. `samplers_kept` engines, each on its own copy of the
  base, hold one sampler's weights each; a miss reloads the least recently used idle one. With `sampler_url` an
  engine server samples instead (`sampler.ServerSampler`, the adapters pushed to it through the same channel).

Training methods are synchronous and run on the server's one worker thread, in arrival order; sampling runs on the
server's event loop. The LoRA of the unembedding (`train_unembed`) is not built: the served models tie it to the
embedding.
"""

from __future__ import annotations

import asyncio
import copy
import json
import shutil
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slime_env.errors import InvalidInput
from slime_env.trainers.lora import LoRAOptions
from slime_env.trainers.split_step import AdamParams, Datum, SplitStepTrainer
from slime_env.trainers.tinker import wire
from slime_env.trainers.tinker.losses import loss_for

EXPIRY = "expires.json"  # in a checkpoint's folder saved with a TTL: {"expires_at": unix time, "ttl_seconds": n}


class CheckpointGone(InvalidInput):
    """A checkpoint saved with `ttl_seconds` whose time has passed: removed, answered 404 (the SDK's NotFoundError)."""


ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
LORA_ALPHA = 32.0


def shared_base(base: torch.nn.Module) -> torch.nn.Module:
    """A module tree of its own over `base`'s parameters (the weights are not copied): a LoRA wraps its linear layers
    without touching `base`'s modules."""
    return copy.deepcopy(base, memo={id(p): p for p in base.parameters()})


def torch_trainer(base: torch.nn.Module, lora: LoRAOptions, pad_id: int, tp: int) -> SplitStepTrainer:
    from slime_env.trainers.torch_trainer import TorchTrainer, TrainerConfig

    return TorchTrainer(shared_base(base), TrainerConfig(lora=lora), pad_id=pad_id)


def fsdp_trainer(base: torch.nn.Module, lora: LoRAOptions, pad_id: int, tp: int) -> SplitStepTrainer:
    from slime_env.trainers.fsdp_trainer import FSDPTrainer
    from slime_env.trainers.torch_trainer import TrainerConfig

    # FSDP2 shards (so copies) the base weights it is given: each client holds its own copy of the base
    return FSDPTrainer(shared_base(base), TrainerConfig(backend="fsdp", lora=lora), pad_id=pad_id)


def megatron_trainer(base: torch.nn.Module, lora: LoRAOptions, pad_id: int, tp: int) -> SplitStepTrainer:
    from slime_env.trainers.megatron_trainer import MegatronTrainer
    from slime_env.trainers.torch_trainer import TrainerConfig

    # PP = 1, DP = world / TP; the GPTModel takes a copy of the base weights (per client)
    return MegatronTrainer(base, TrainerConfig(backend="megatron", lora=lora, tp=tp), pad_id=pad_id)


# --backend -> a training client's trainer over the base model (its TP size: megatron's alone)
TRAINERS: dict[str, Callable[[torch.nn.Module, LoRAOptions, int, int], SplitStepTrainer]] = {
    "torch": torch_trainer, "fsdp": fsdp_trainer, "megatron": megatron_trainer}


def world_size() -> int:
    """The ranks `serve-tinker` runs on: torchrun's `WORLD_SIZE`, or a process group's size."""
    import os

    import torch.distributed as dist

    return max(int(os.environ.get("WORLD_SIZE", "1")), dist.get_world_size() if dist.is_initialized() else 1)


def check_backend(name: str, *, tp: int = 1, pp: int = 1) -> None:
    """`name` is a trainer `serve-tinker` runs on at this world size, or an `InvalidInput` naming what is not: an
    unknown name, torch over several ranks, TP with fsdp or torch, Megatron's pipeline parallel (its schedule owns
    the backward), a TP size that does not divide the ranks."""
    from slime_env.trainers.torch_trainer import BACKENDS

    if name not in TRAINERS:
        raise InvalidInput(f"--backend {name!r}: one of {list(BACKENDS)}")
    world = world_size()
    supported = "(fsdp on any number of ranks, megatron with DP x TP; torch in one process)"
    if name == "torch" and world > 1:
        raise InvalidInput(f"--backend torch over {world} ranks: the torch trainer runs in one process; use --backend "
                           f"fsdp or megatron under torchrun {supported}")
    if pp != 1:
        raise InvalidInput(f"--pp {pp}: Megatron's pipeline schedule owns the backward, so the split step (Tinker's "
                           f"forward_backward) runs without pipeline parallel {supported}")
    if tp < 1 or (tp > 1 and name != "megatron") or world % tp:
        raise InvalidInput(f"--tp {tp} with --backend {name} over {world} ranks: tensor parallel is megatron's, and "
                           f"TP must divide the ranks {supported}")


@dataclass
class TrainingModel:
    model_id: str
    trainer: SplitStepTrainer
    lora: dict[str, Any]  # the SDK's LoRA request (rank, seed, train_attn, train_mlp, ...)


@dataclass
class _Engine:
    """One embedded engine and the sampler weights it holds (`key`; None while loading)."""
    policy: Any
    key: str | None = None
    busy: int = 0  # sample calls generating on it: it is not reloaded under them


class TinkerBackend:
    """One base model (`base_model` is the name clients ask for), training clients over it on `trainer`, and
    samplers (see the module docstring)."""

    def __init__(self, base_model: str, model: Any, tokenizer: Any, root: str | Path, *, trainer: str = "torch",
                 max_context_length: int = 32768, samplers_kept: int = 2, max_batch_size: int = 16, tp: int = 1,
                 sampler_url: str | None = None, sampler_kind: str = "sglang"):
        import torch.distributed as dist

        check_backend(trainer, tp=tp)
        self.tp = tp
        self.writes = not dist.is_initialized() or dist.get_rank() == 0  # rank 0 writes the files of every rank
        self.base_model = base_model
        self.base = model.eval().requires_grad_(False)  # frozen: clients train adapters over it
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.make_trainer = TRAINERS[trainer]
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_context_length = max_context_length
        self.vocab_size = int(model.config.vocab_size)
        self.models: dict[str, TrainingModel] = {}
        self._engines: list[_Engine] = []  # least recently used first
        self._engines_changed: asyncio.Condition | None = None
        self._samplers_kept = samplers_kept
        self._max_batch_size = max_batch_size
        self._ephemeral = 0
        self._versions: dict[str, int] = {}  # sampler path -> times saved: engines cache (path, version)
        self.clock: Callable[[], float] = time.time  # what checkpoint TTLs are measured against
        self._expired: dict[str, str] = {}  # path -> why it is gone (its TTL passed), until saved again
        self.server_sampler = None  # `sampler_url`: an engine server samples (trainers/tinker/sampler.py)
        if sampler_url is not None:
            from slime_env.agents.weight_layout import WeightLayout
            from slime_env.trainers.tinker.sampler import ServerSampler

            self.server_sampler = ServerSampler(sampler_url, sampler_kind, WeightLayout.of(model.config),
                                                self.root / "sampler_adapters")

    # --- training clients ----------------------------------------------------------------------------------------
    def check_base_model(self, name: str | None) -> None:
        if name is not None and name != self.base_model:
            raise InvalidInput(f"base_model {name!r} is not served here: this server was started with "
                               f"--model {self.base_model!r}")

    @staticmethod
    def check_optimizer(config: dict[str, Any] | None) -> None:
        """The SDK fixes a model's optimizer at its creation (`optimizer_config`); the trainers here run AdamW
        only, so another is refused then, not at the first `optim_step`."""
        kind = (config or {}).get("type", "adamw")
        if kind != "adamw":
            raise InvalidInput(f"optimizer_config {kind!r}: this server's trainers run AdamW only "
                               "(tinker.AdamOptimizerConfig, the default)")

    def free_session(self, session_id: str) -> list[str]:
        """Drop the training clients of a finished session (their adapters, optimizer states, gradients); the ids
        dropped. Their saved checkpoints and sampler weights stay on disk."""
        import gc

        gone = [m for m in self.models if m.partition(":train:")[0] == session_id]
        for model_id in gone:
            del self.models[model_id]
        gc.collect()  # the trainers' module trees hold reference cycles
        return gone

    def create_model(self, base_model: str, lora: dict[str, Any] | None, model_id: str) -> str:
        """A LoRA training client over the base (the SDK's id is `<session_id>:train:<model_seq_id>`)."""
        self.check_base_model(base_model)
        if not lora:
            raise InvalidInput("full fine-tuning is not served: create a LoRA training client "
                               "(create_lora_training_client with a rank)")
        rank = int(lora.get("rank") or 0)
        if rank < 1:
            raise InvalidInput(f"LoRA rank must be >= 1, got {rank}")
        targets = (ATTN if lora.get("train_attn", True) else ()) + (MLP if lora.get("train_mlp", True) else ())
        if not targets:
            raise InvalidInput("LoRA with train_attn=False and train_mlp=False trains nothing here "
                               "(train_unembed is not served)")
        if model_id in self.models:
            raise InvalidInput(f"training model {model_id!r} exists already")
        if lora.get("seed") is not None:  # the adapter's initial A matrices
            torch.manual_seed(int(lora["seed"]))
        options = LoRAOptions(rank=rank, alpha=LORA_ALPHA, target_modules=list(targets))
        trainer = self.make_trainer(self.base, options, self.pad_id, self.tp)
        self.models[model_id] = TrainingModel(model_id, trainer, dict(lora))
        return model_id

    def get(self, model_id: str | None) -> TrainingModel:
        if model_id not in self.models:
            raise InvalidInput(f"no training model {model_id!r} on this server")
        return self.models[model_id]

    def info(self, model_id: str) -> dict[str, Any]:
        m = self.get(model_id)
        arch = type(self.base).__name__
        return {"type": "get_info", "model_id": model_id, "is_lora": True, "lora_rank": int(m.lora["rank"]),
                "model_name": self.base_model,
                "model_data": {"arch": arch, "model_name": self.base_model, "tokenizer_id": self.base_model}}

    # --- forward / backward / optimizer --------------------------------------------------------------------------
    def forward_backward(self, model_id: str, loss_fn: str, config: dict[str, Any], data: list[wire.Datum],
                         forward_only: bool) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """Per-datum `logprobs` (and `elementwise_loss` for cross_entropy) and `loss:sum`; gradients accumulate in
        the client's trainer unless `forward_only`."""
        m = self.get(model_id)
        loss, needed = loss_for(loss_fn, config)
        if not data:
            raise InvalidInput("forward_backward got no data")
        batch = [self._datum(i, d, needed) for i, d in enumerate(data)]
        if forward_only:
            logps = m.trainer.forward(batch)
            with torch.no_grad():
                total = float(sum(loss(lp, d.inputs) for lp, d in zip(logps, batch)))
        else:
            logps, total = m.trainer.forward_backward(batch, loss)
        outputs = [{"logprobs": lp.float().numpy()} for lp in logps]
        if loss_fn == "cross_entropy":  # Tinker's per-token output of this loss
            for out, d in zip(outputs, batch):
                out["elementwise_loss"] = -d.inputs["weights"].numpy() * out["logprobs"]
        return outputs, {"loss:sum": total}

    def _datum(self, i: int, d: wire.Datum, needed: tuple[str, ...]) -> Datum:
        """The SDK's datum checked (named by its index and Tinker's field names), as the trainer's `Datum`."""
        n = len(d.tokens)
        if n == 0:
            raise InvalidInput(f"datum {i}: model_input is empty")
        if n > self.max_context_length:
            raise InvalidInput(f"datum {i}: {n} tokens exceed max_context_length {self.max_context_length}")
        if d.tokens.min() < 0 or d.tokens.max() >= self.vocab_size:
            raise InvalidInput(f"datum {i}: model_input has token ids outside [0, {self.vocab_size})")
        for name in ("target_tokens",) + needed:
            if name not in d.inputs:
                raise InvalidInput(f"datum {i}: loss_fn_inputs lacks {name!r} (has {sorted(d.inputs)})")
        for name, arr in d.inputs.items():
            if arr.ndim != 1 or len(arr) != n:
                raise InvalidInput(f"datum {i}: loss_fn_inputs[{name!r}] has shape {list(arr.shape)} but model_input "
                                   f"has {n} tokens (each input needs shape [{n}])")
        targets = d.inputs["target_tokens"]
        if targets.min() < 0 or targets.max() >= self.vocab_size:
            raise InvalidInput(f"datum {i}: target_tokens outside [0, {self.vocab_size})")
        return Datum(torch.from_numpy(d.tokens.astype(np.int64)), torch.from_numpy(targets.astype(np.int64)),
                     {k: torch.from_numpy(v.astype(np.float32)) for k, v in d.inputs.items() if k != "target_tokens"})

    def optim_step(self, model_id: str, adam: dict[str, Any]) -> dict[str, float]:
        """One AdamW step with this call's hyper-parameters (Tinker's AdamParams), then the gradients are zero."""
        return self.get(model_id).trainer.optim_step(AdamParams.parse(adam))

    # --- checkpoints ---------------------------------------------------------------------------------------------
    def _folder(self, path: str, kind: str, marker: str) -> Path:
        prefix = "tinker://"
        parts = path[len(prefix):].split("/") if path.startswith(prefix) else []
        if len(parts) != 3 or parts[1] != kind or not all(parts) or ".." in parts:
            raise InvalidInput(f"{path!r} is not a {kind} path of this server (tinker://<model_id>/{kind}/<name>)")
        folder = self.root / parts[0] / kind / parts[2]
        self._check_alive(path, folder)
        if not (folder / marker).is_file():
            raise InvalidInput(f"{path!r} does not exist on this server")
        return folder

    def _new_path(self, model_id: str, kind: str, name: str) -> tuple[str, Path]:
        if not name or "/" in name or name.startswith("."):
            raise InvalidInput(f"checkpoint name {name!r}: a plain file name is needed")
        return f"tinker://{model_id}/{kind}/{name}", self.root / model_id / kind / name

    def _check_alive(self, path: str, folder: Path) -> None:
        """CheckpointGone when `path` was saved with a TTL that has passed; its folder is removed then."""
        if path in self._expired:
            raise CheckpointGone(self._expired[path])
        marker = folder / EXPIRY
        if not marker.is_file():
            return
        record = json.loads(marker.read_text())
        if self.clock() < record["expires_at"]:
            return
        when = datetime.fromtimestamp(record["expires_at"], timezone.utc).isoformat(timespec="seconds")
        self._expired[path] = f"{path!r} expired at {when} (ttl_seconds {record['ttl_seconds']}) and was removed"
        if self.writes:
            shutil.rmtree(folder, ignore_errors=True)
        raise CheckpointGone(self._expired[path])

    def sweep_expired(self) -> list[str]:
        """Remove every checkpoint and sampler path under the root whose TTL has passed; the paths removed."""
        gone = []
        for marker in sorted(self.root.glob(f"*/*/*/{EXPIRY}")):
            folder = marker.parent
            path = f"tinker://{folder.parent.parent.name}/{folder.parent.name}/{folder.name}"
            try:
                self._check_alive(path, folder)
            except CheckpointGone:
                gone.append(path)
        return gone

    def check_not_expired(self, path: str) -> None:
        """CheckpointGone when checkpoint `path` expired (a path that does not exist is refused when it is loaded)."""
        try:
            self._folder(path, "weights", "tinker.json")
        except CheckpointGone:
            raise
        except InvalidInput:
            pass

    def _set_ttl(self, path: str, folder: Path, ttl_seconds: int | None) -> None:
        """`path` (just saved) expires `ttl_seconds` from now; saved without one, it stays until deleted by hand."""
        self._expired.pop(path, None)
        if not self.writes:
            return
        if ttl_seconds is None:
            (folder / EXPIRY).unlink(missing_ok=True)
        else:
            (folder / EXPIRY).write_text(json.dumps({"expires_at": self.clock() + ttl_seconds,
                                                     "ttl_seconds": ttl_seconds}))

    def save_state(self, model_id: str, name: str, *, overwrite: bool = False, ttl_seconds: int | None = None) -> str:
        """The trainer's checkpoint (adapter, optimizer, step) and the client's LoRA request; an existing name is
        refused unless `overwrite` (the SDK's `save_state(..., overwrite=False)` default). With `ttl_seconds` it is
        removed that many seconds from now (see the module docstring)."""
        m = self.get(model_id)
        path, folder = self._new_path(model_id, "weights", name)
        self.sweep_expired()  # an expired checkpoint of this name no longer exists
        if (folder / "tinker.json").is_file() and not overwrite:
            raise InvalidInput(f"checkpoint {path!r} exists already: save under another name, or pass "
                               "overwrite=True")
        m.trainer.save(folder)
        if self.writes:
            (folder / "tinker.json").write_text(json.dumps({"base_model": self.base_model, "lora": m.lora}))
        self._set_ttl(path, folder, ttl_seconds)
        return path

    def load_state(self, model_id: str, path: str, optimizer: bool, *, create: bool = False) -> str:
        """Load a `save_state` checkpoint into `model_id` (a new client of that id when `create`)."""
        folder = self._folder(path, "weights", "tinker.json")
        saved = json.loads((folder / "tinker.json").read_text())
        self.check_base_model(saved["base_model"])
        if create:
            self.create_model(saved["base_model"], saved["lora"], model_id)
        self.get(model_id).trainer.load(folder, optimizer=optimizer)
        return model_id

    def save_for_sampler(self, model_id: str, name: str | None, ttl_seconds: int | None = None) -> str:
        """The client's adapter, as a PEFT folder; unnamed ones are ephemeral (save_weights_and_get_sampling_client).
        With `ttl_seconds` it is removed that many seconds from now."""
        m = self.get(model_id)
        if name is None:
            self._ephemeral += 1
            name = f"ephemeral-{self._ephemeral}"
        path, folder = self._new_path(model_id, "sampler_weights", name)
        self.sweep_expired()
        adapter = m.trainer.adapter()  # a collective where the weights are sharded
        if self.writes:
            adapter.save(folder)
        self._versions[path] = self._versions.get(path, 0) + 1
        self._set_ttl(path, folder, ttl_seconds)
        return path

    def _cache_key(self, key: str) -> str:
        """What engines cache sampler `key` under: its path and how many times it was saved, so weights saved again
        under the same name are pushed again (a path alone would keep serving the first save's)."""
        return key if key == "base" else f"{key}#{self._versions.get(key, 0)}"

    # --- sampling ------------------------------------------------------------------------------------------------
    def check_sampler(self, model_path: str | None, base_model: str | None) -> str:
        """The sampler key for a model path or the base model (refused clearly when neither is served)."""
        from slime_env.agents.lora_adapter import ADAPTER_CONFIG

        if model_path:
            self._folder(model_path, "sampler_weights", ADAPTER_CONFIG)
            return model_path
        if base_model is None:
            raise InvalidInput("a sampling client needs model_path or base_model")
        self.check_base_model(base_model)
        return "base"

    @asynccontextmanager
    async def sampling(self, key: str) -> AsyncIterator[Any]:
        """An engine (`TransformersPolicy`, or a view of the `sampler_url` server) holding sampler `key`'s weights,
        not reloaded until the block ends."""
        if self.server_sampler is not None:
            folder = None if key == "base" else self._folder(key, "sampler_weights", "adapter_config.json")
            async with self.server_sampler.sampling(self._cache_key(key), folder) as view:
                yield view
            return
        if self._engines_changed is None:
            self._engines_changed = asyncio.Condition()
        async with self._engines_changed:
            engine = await self._engine_for(key)
            engine.busy += 1
        try:
            yield engine.policy
        finally:
            async with self._engines_changed:
                engine.busy -= 1
                self._engines_changed.notify_all()

    async def _engine_for(self, key: str) -> _Engine:
        """The engine holding `key` (most recently used now), else a new one or the least recently used idle one
        with `key` pushed to it; waits while every engine is busy with other weights."""
        from slime_env.agents.transformers_policy import TransformersPolicy

        while True:
            engine = next((e for e in self._engines if e.key == self._cache_key(key)), None)
            if engine is not None:
                self._engines.remove(engine)
                self._engines.append(engine)
                return engine
            if len(self._engines) < self._samplers_kept:
                model = await asyncio.to_thread(copy.deepcopy, self.base)  # its own weights: adapters merge into them
                engine = _Engine(TransformersPolicy(model, self.tokenizer, max_batch_size=self._max_batch_size,
                                                    batching="static"))
                self._engines.append(engine)
            else:
                engine = next((e for e in self._engines if e.busy == 0), None)
                if engine is None:
                    await self._engines_changed.wait()
                    continue
            await self._push(engine, key)

    async def _push(self, engine: _Engine, key: str) -> None:
        """Sampler `key`'s adapter into `engine` through the weight-sync channel (the base model: no adapter)."""
        from slime_env.agents.lora_adapter import LoRAAdapter
        from slime_env.agents.weight_layout import WeightLayout
        from slime_env.trainers.weight_sync import channel_for

        engine.key = None
        cached = self._cache_key(key)  # the version read before the load: a save during it pushes again
        if key == "base":  # an adapter with no matrices: every matrix back to the base's
            adapter = LoRAAdapter("base", {})
        else:
            adapter = await asyncio.to_thread(LoRAAdapter.load, self._folder(key, "sampler_weights",
                                                                             "adapter_config.json"))
        channel = channel_for(engine.policy, WeightLayout.of(engine.policy.model.config))
        await channel.push_adapter(adapter, key)
        await channel.close()
        engine.key = cached

    def close(self) -> None:
        if self.server_sampler is not None:
            try:  # on the server's loop (its cleanup), where the HTTP pool lives
                asyncio.get_running_loop().create_task(self.server_sampler.close())
            except RuntimeError:
                pass  # no loop: the pool was never opened on one that runs
        for engine in self._engines:
            engine.policy.close()
        self._engines.clear()
