"""`FSDPBackend`: the RL step's `Backend` for any Hugging Face causal LM sharded with FSDP2 over every rank.

The path for model families Megatron conversion does not cover (slime's `--train-backend fsdp`): no conversion,
the model's own forward. `torch.distributed.fsdp.fully_shard` shards each decoder layer (the classes the model
names in `_no_split_modules`) and then the rest; the parameters stay float32 (the optimizer's master weights),
and on CUDA each layer computes in bfloat16 with float32 gradient reduction (`MixedPrecisionPolicy`). Optional:
parameters, gradients and optimizer state in CPU memory (`fsdp_cpu_offload`), activation checkpointing of every
decoder layer (`recompute: full`).

Data parallel as in megatron's backend: every rank receives the same trajectories and computes a contiguous,
token-balanced share of each mini-batch's rows, `micro_batch_size` rows at a time; each micro-batch's loss is
weighted by its tokens over the whole mini-batch's, and gradients are summed over ranks, so the gradient is the
one-process gradient. Ranks run the same number of passes (an idle rank runs a zero-weighted one): FSDP gathers
parameters in every forward. Weights leave as full tensors gathered one at a time (`weights()`, `sync`, `save`).

With `lora` the model is wrapped with peft before sharding: only the adapter trains (the optimizer holds its shards),
the KL reference is the same model with the adapter off, and `adapter()` / `save` / `sync` gather the adapter alone
into the `LoRAAdapter` `TorchTrainer` gives (docs/lora.md).
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from slime_env.trainers.batch import TrainBatch
from slime_env.trainers.distributed import balanced_ranges, init_process_group, lockstep, padded_slices
from slime_env.trainers.backends.torch import TorchBackend
from slime_env.trainers.step import sum_stats
from slime_env.trainers.torch_trainer import TrainerConfig, read_hf_weights


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: modules of the classes it lists in `_no_split_modules` (HF's own unit of
    sharding); refused by name when it lists none."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class (_no_split_modules): FSDPTrainer "
                         "shards a model layer by layer")
    return layers


class FSDPBackend(TorchBackend):
    """`TorchBackend`'s model sharded with FSDP2 over every rank (see the module docstring); it replaces the
    public `Backend` methods that depend on the sharding."""

    def __init__(self, model: torch.nn.Module, config: TrainerConfig | None = None, *, pad_id: int):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        c = config or TrainerConfig(backend="fsdp")
        if c.estimator == "ppo":
            raise ValueError("estimator ppo (a critic) is not offered by the fsdp backend: use torch or megatron")
        self.rank, self.world = init_process_group()
        self.cuda = torch.cuda.is_available()
        device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        compute = {"auto": torch.bfloat16 if self.cuda else torch.float32, "bfloat16": torch.bfloat16,
                   "float32": torch.float32}[c.dtype]
        model = model.to(device=device, dtype=torch.float32)
        if c.lora is not None:  # the adapter goes in before sharding (below); the KL reference is the adapter off
            from slime_env.trainers.lora import is_peft, wrap

            model = model if is_peft(model) else wrap(model, c.lora)
        ref = copy.deepcopy(model).eval().requires_grad_(False) if c.kl_coef > 0 and c.lora is None else None
        kw: dict[str, Any] = {"mp_policy": MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)}
        if c.fsdp_cpu_offload:
            kw["offload_policy"] = CPUOffloadPolicy()
        if c.recompute == "full":  # each decoder layer keeps only its input; its forward is redone in the backward
            # torch's composable checkpoint (forward hooks) rather than a wrapper module, which would put
            # `_checkpoint_wrapped_module.` into parameter names: peft finds an adapter's tensors by module names
            from torch.distributed._composable import checkpoint

            for layer in decoder_layers(model):
                checkpoint(layer)
        # With LoRA a decoder layer's unit holds its frozen base weights and its adapter: FSDP2 shards each parameter
        # on its own and reduce-scatters only the gradients that exist (the units torchtune's LoRA recipes use).
        for module in (model, ref) if ref is not None else (model,):
            layers = decoder_layers(module)
            for layer in layers:
                fully_shard(layer, **kw)
            fully_shard(module, **kw)
        TorchBackend.__init__(self, model, c, pad_id=pad_id, ref_model=ref)
        self.device = device
        if c.lora is not None:
            # FSDP fixes each unit's gradient dtypes (float32 master, reduce dtype) at its first forward from the
            # parameters that require a gradient then; the reference's first forward would run with the adapter off,
            # when none does
            with torch.no_grad():
                self.dummy_forward(self.model)
            self.model.reshard()  # the root unit keeps its parameters gathered after a forward without backward

    # --- this rank's rows, lockstep -------------------------------------------------------------------------
    def micro_slices(self, batch: TrainBatch) -> list[slice]:
        """This rank's token-balanced share of the rows, as many micro-batches as every other rank's."""
        lengths, c = batch.attention_mask.sum(-1).tolist(), self.config
        per_rank = [padded_slices(lengths, a, b, c.micro_batch_size, c.max_tokens_per_micro_batch)
                    for a, b in balanced_ranges(lengths, self.world)]
        return lockstep(per_rank, self.rank)

    def dummy_forward(self, model: torch.nn.Module) -> torch.Tensor:
        """A one-token forward: a rank with nothing to score still joins FSDP's parameter gathers."""
        ids = torch.full((1, 1), self.pad_id, dtype=torch.long, device=self.device)
        return model(input_ids=ids, use_cache=False).logits

    def logprobs(self, model: torch.nn.Module, batch: TrainBatch, *, with_entropy: bool = False):
        """`TorchBackend.logprobs`; a rank with nothing to score runs a dummy forward (FSDP gathers in each)."""
        if batch.size == 0 or batch.response_columns() == 0:  # nothing to score: still join the parameter gathers
            with torch.no_grad():
                self.dummy_forward(model)
        return TorchBackend.logprobs(self, model, batch, with_entropy=with_entropy)

    def idle_micro_batch(self) -> None:
        """A zero-weighted pass: every rank joins each gather and gradient reduction."""
        (self.dummy_forward(self.model).float().sum() * 0.0).backward()

    def backward(self, loss: torch.Tensor, share: float) -> None:
        """`share` of `loss`, scaled by the world size against FSDP's gradient average."""
        # FSDP averages gradients over ranks; `share` is already over the whole mini-batch, so the sum is wanted
        (loss * self.world * share).backward()

    def split_share(self) -> float:
        """The inverse world size (every rank backs a call's whole data)."""
        # every rank backs the same data and `_backward` scales by `world` against FSDP's average: undo that here
        return 1.0 / self.world

    def optimizer_step(self) -> float:
        """Clip by the global norm of the sharded gradients, step (skipped on a non-finite norm)."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if math.isfinite(grad_norm):
            self.optimizer.step()
        return grad_norm

    def reduce_stats(self, stats: dict[str, float]) -> dict[str, float]:
        """The statistics summed over every rank."""
        return stats if self.world == 1 else sum_stats(self.config, stats, None, self.device)

    # --- weights, checkpoints, sync ----------------------------------------------------------------------------
    @torch.no_grad()
    def model_state(self, adapter_only: bool = False) -> dict[str, torch.Tensor]:
        """Full tensors on every rank, gathered one at a time (a collective; with `adapter_only`, the adapter alone)."""
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach()
                for k, v in self.model.state_dict().items() if not adapter_only or ".lora_" in k}

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        """Full tensors into the shards (every rank)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        self.model.reshard()  # loading writes the shards: none may be gathered (the root unit after a no-grad forward)
        set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True, strict=False))

    def save_weights(self, path: str | Path) -> Path:
        """The HF model folder (safetensors + config.json; with LoRA the merged weights), written by rank 0; every
        rank calls it."""
        state = self.weights()
        if self.rank == 0:
            model = self.model.get_base_model() if self.config.lora is not None else self.model
            model.save_pretrained(path, state_dict={k: v.cpu() for k, v in state.items()}, safe_serialization=True)
        if self.world > 1:
            dist.barrier()
        return Path(path)

    def save(self, path: str | Path) -> Path:
        """`path/model` (HF; with LoRA `path/adapter`, the adapter alone in PEFT's format), each rank's optimizer
        shard, step and config; every rank calls it."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)  # every rank writes its shard, whatever rank 0 has written yet
        if self.config.lora is not None:  # the adapter alone, in PEFT's format, as TorchTrainer writes it
            adapter = self.adapter()
            if self.rank == 0:
                adapter.save(path / "adapter")
        else:
            self.save_weights(path / "model")
        local = {i: {k: (v.to_local() if hasattr(v, "to_local") else v).cpu() for k, v in st.items()}
                 for i, st in self.optimizer.state_dict()["state"].items()}
        torch.save({"state": local, "param_groups": self.optimizer.state_dict()["param_groups"],
                    "step": self.step_count, "world": self.world}, path / f"trainer_rank{self.rank}.pt")
        if self.rank == 0:
            (path / "config.json").write_text(json.dumps(asdict(self.config)))
        return path

    def load(self, path: str | Path, *, optimizer: bool = True) -> None:
        """Weights of an HF folder (ours, any trainer's, or the model's own) — with LoRA the adapter of a LoRA
        checkpoint (ours, `TorchTrainer`'s, or a PEFT folder) — then, when `optimizer`, this rank's optimizer shard
        and the step when `path` holds them (same number of ranks, else refused by name)."""
        from torch.distributed.tensor import DTensor

        path = Path(path)
        if self.config.lora is not None:
            self.load_adapter(path)
        else:
            self.load_model_state(read_hf_weights(path))
        shard = path / f"trainer_rank{self.rank}.pt"
        if not optimizer or not shard.exists():
            return
        saved = torch.load(shard, map_location="cpu", weights_only=False)
        if saved["world"] != self.world:
            raise ValueError(f"{shard}: saved by {saved['world']} ranks, this run has {self.world}")
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        state = {}
        for i, st in saved["state"].items():
            p = params[int(i)]
            state[i] = {k: (DTensor.from_local(v.to(p.to_local().device), p.device_mesh, p.placements)
                            if isinstance(p, DTensor) and v.dim() > 0 else v) for k, v in st.items()}
        self.optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})
        self.step_count = int(saved["step"])

    @property
    def pushes(self) -> bool:
        """Rank 0."""
        return self.rank == 0  # every rank gathers the weights in `sync`; rank 0 pushes them
