"""`TorchBackend`: a Hugging Face causal LM on CPU or one GPU, the reference `Backend` of the RL step
(`slime_env.trainers.step`).

Log-probs with the right shift (logits at position p score token p + 1) over the trailing response columns, a VLM's
pixel inputs (`TrainBatch.vision`) passed to its forward, AdamW, gradient clipping; LoRA through peft (only the
adapter trains, the KL reference is the base model with the adapter off); PPO's critic (`trainers.critic`).
`save`/`load` checkpoint model, optimizer and step; `weights`/`adapter` are what a weight sync pushes.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, ContextManager

import torch

from slime_env.trainers import algorithms as alg
from slime_env.trainers import routing_replay as rr
from slime_env.trainers.batch import TrainBatch
from slime_env.trainers.distributed import padded_slices
from slime_env.trainers.split_step import Datum
from slime_env.trainers.step import frozen_logprobs, no_context
from slime_env.trainers.trainer_config import TrainerConfig
from slime_env.trajectory import Trajectory


class TorchBackend:
    """The `Backend` of `TorchTrainer`: `model` (a transformers causal LM) and its optimizer in this process."""

    pipelined = False

    def __init__(self, model: torch.nn.Module, config: TrainerConfig | None = None, *, pad_id: int,
                 ref_model: torch.nn.Module | None = None):
        self.config, self.pad_id = config or TrainerConfig(), pad_id
        c = self.config
        if c.lora is not None:  # only the adapter trains: the base weights are frozen inside the peft model
            from slime_env.trainers.lora import is_peft, wrap

            model = model if is_peft(model) else wrap(model, c.lora)
        self.model = model
        self.device = next(model.parameters()).device
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=c.lr,
                                           betas=c.betas, weight_decay=c.weight_decay)
        self.ref_model = ref_model
        if c.kl_coef > 0 and ref_model is None and c.lora is None:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)  # the initial policy
        self.critic = None
        if c.estimator == "ppo":
            from slime_env.trainers.critic import ValueModel

            self.critic = ValueModel(model).to(self.device)
            self.critic_optimizer = torch.optim.AdamW(self.critic.parameters(), lr=c.critic_lr, betas=c.betas,
                                                      weight_decay=c.weight_decay)
        self.role_baselines = alg.RoleBaselines(c.rae_decay) if c.estimator == "rae" else None
        self.step_count = 0
        self.routing_shape = rr.model_routing_shape(model) if c.routing_replay == "rollout" else None

    # --- log-probs --------------------------------------------------------------------------------
    def logprobs(self, model: torch.nn.Module, batch: TrainBatch, *, with_entropy: bool = False):
        """Log-probs aligned with `batch.input_ids` ([B, L]), computed for the trailing response columns only
        (0.0 elsewhere): logits at position p score token p + 1, so R response columns need R + 1 logits."""
        B, L = batch.input_ids.shape
        r = min(batch.response_columns(), L - 1)
        lp = torch.zeros((B, L), dtype=torch.float32, device=self.device)
        ent = torch.zeros_like(lp)
        if r > 0:
            ids = batch.input_ids.to(self.device)
            if self.routing_shape is not None:  # routing replay: the engine's experts where it recorded them
                rr.use_routes(model, None if batch.routed_experts is None else batch.routed_experts.to(self.device))
            dtype = next(model.parameters()).dtype
            pixels = {} if batch.vision is None else {  # a VLM's images, as its processor made them at rollout
                k: v.to(self.device, dtype if v.is_floating_point() else v.dtype) for k, v in batch.vision.items()}
            logits = model(input_ids=ids, attention_mask=batch.attention_mask.to(self.device),
                           position_ids=batch.position_ids.to(self.device), logits_to_keep=r + 1,
                           use_cache=False, **pixels).logits  # no KV cache: nothing generates, a checkpoint replays
            lp[:, L - r:] = alg.token_logprobs(logits[:, :-1], ids[:, L - r:])
            if with_entropy:  # its graph (a softmax over the vocabulary per token) is kept only for an entropy bonus
                with torch.set_grad_enabled(torch.is_grad_enabled() and bool(self.config.entropy_coef)):
                    ent[:, L - r:] = alg.entropy_from_logits(logits[:, :-1])
        return (lp, ent) if with_entropy else lp

    def frozen_logprobs(self, model: torch.nn.Module, batch: TrainBatch) -> torch.Tensor:
        """`model`'s log-probs of every row (CPU), no gradient, eval mode."""
        return frozen_logprobs(self, model, batch)

    def reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """The reference policy's log-probs (a KL term): `ref_model`, or with LoRA the base model itself, the
        adapter off (no second copy of the weights)."""
        if self.ref_model is not None:
            return self.frozen_logprobs(self.ref_model, batch)
        with self.model.disable_adapter():
            return self.frozen_logprobs(self.model, batch)

    def datum_logprobs(self, data: Sequence[Datum]) -> list[torch.Tensor]:
        """Each datum's log-probs of its targets ([n]), the data right-padded into one forward."""
        width = max(len(d.tokens) for d in data)
        ids = torch.full((len(data), width), self.pad_id, dtype=torch.long)
        targets, attention = torch.zeros_like(ids), torch.zeros_like(ids)
        for row, d in enumerate(data):
            ids[row, :len(d.tokens)], targets[row, :len(d.tokens)] = d.tokens, d.targets
            attention[row, :len(d.tokens)] = 1
        logits = self.model(input_ids=ids.to(self.device), attention_mask=attention.to(self.device),
                            use_cache=False).logits
        logp = alg.token_logprobs(logits, targets.to(self.device))
        return [logp[row, :len(d.tokens)] for row, d in enumerate(data)]

    # --- PPO's critic -----------------------------------------------------------------------------------
    def values(self, batch: TrainBatch) -> torch.Tensor:
        """The critic's [B, L] values, aligned like `logprobs` (with gradient)."""
        return self.critic(batch, self.device)

    def all_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Every row is computed here."""
        return x

    def critic_step(self) -> float:
        """Clip and step the critic; its gradient norm."""
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.critic.parameters(), self.config.max_grad_norm))
        if math.isfinite(grad_norm):
            self.critic_optimizer.step()
        self.critic_optimizer.zero_grad(set_to_none=True)
        return grad_norm

    # --- the step's passes -------------------------------------------------------------------------------
    def prepare(self, trajectories: Sequence[Trajectory]) -> None:
        """Nothing to bring back or refuse."""

    def finish(self) -> None:
        """Nothing to release."""

    def update_context(self) -> ContextManager[Any]:
        """Nothing held around an update."""
        return no_context()

    def pipeline_passes(self, mini, slices, loss_of, stats):
        raise NotImplementedError("TorchBackend is not pipelined")

    def micro_slices(self, batch: TrainBatch) -> list[slice]:
        """Row ranges of the micro-batches (all rows, `micro_batch_size` at a time, fewer where their padded size
        would pass `max_tokens_per_micro_batch`: a step's activations grow with it)."""
        return padded_slices(batch.attention_mask.sum(-1).tolist(), 0, batch.size, self.config.micro_batch_size,
                             self.config.max_tokens_per_micro_batch)

    def train_mode(self) -> None:
        """The mode of the gradient passes: eval (dropout off: the importance ratio must compare the same function
        the engine sampled). A LoRA `dropout` acts in supervised steps (`loss: sft`) only."""
        lora = self.config.lora
        self.model.train(bool(lora and lora.dropout > 0 and self.config.loss == "sft"))

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor, share: float) -> None:
        """Backward of one micro-batch's loss weighted by its `share` of the mini-batch."""
        (loss * share).backward()

    def idle_micro_batch(self) -> None:
        """A micro-batch without loss tokens: nothing to do in one process."""

    def reduce_stats(self, stats: dict[str, float]) -> dict[str, float]:
        """One process: the statistics are whole."""
        return stats

    def optimizer_step(self) -> float:
        """Clip, step (skipped on a non-finite norm), return the gradient norm."""
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm))
        if math.isfinite(grad_norm):
            self.optimizer.step()
        return grad_norm

    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's parameter groups."""
        return list(self.optimizer.param_groups)

    def split_share(self) -> float:
        """One process: a split-step backward is not reweighted."""
        return 1.0

    # --- checkpoints and weights ------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Model (safetensors, `save_pretrained`), optimizer, step and config under `path` (and PPO's critic)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if self.config.lora is not None:  # the adapter alone, in PEFT's format (no base weights)
            self.adapter().save(path / "adapter")
        else:
            self.model.save_pretrained(path / "model", safe_serialization=True)
        torch.save({"optimizer": self.optimizer.state_dict(), "step": self.step_count,
                    "role_baselines": self.role_baselines.state_dict() if self.role_baselines else None},
                   path / "trainer.pt")
        if self.critic is not None:  # PPO: the critic resumes too
            torch.save({"critic": self.critic.state_dict(), "optimizer": self.critic_optimizer.state_dict()},
                       path / "critic.pt")
        (path / "config.json").write_text(json.dumps(asdict(self.config)))
        return path

    def load(self, path: str | Path, *, optimizer: bool = True) -> None:
        """Weights from `path/model` (safetensors); optimizer state and step too when `path` holds them and
        `optimizer`."""
        path = Path(path)
        from safetensors.torch import load_file

        from slime_env.agents.weight_layout import load_state

        if self.config.lora is not None:
            self.load_adapter(path)
        else:
            state = {}
            for f in sorted((path / "model").glob("*.safetensors")):
                state.update(load_file(str(f)))
            load_state(self.model, state)  # either layout: checkpoints hold MoE experts one matrix each
        # a MegatronTrainer checkpoint holds the same HF weights, not this state
        if optimizer and (path / "trainer.pt").exists():
            saved = torch.load(path / "trainer.pt", map_location=self.device, weights_only=False)
            self.optimizer.load_state_dict(saved["optimizer"])
            self.step_count = int(saved["step"])
            if self.role_baselines is not None and saved.get("role_baselines"):
                self.role_baselines.load_state_dict(saved["role_baselines"])
        if self.critic is not None and (path / "critic.pt").exists():
            saved = torch.load(path / "critic.pt", map_location=self.device, weights_only=False)
            self.critic.load_state_dict(saved["critic"])
            if optimizer:
                self.critic_optimizer.load_state_dict(saved["optimizer"])

    def load_adapter(self, path: Path) -> None:
        """The adapter of checkpoint `path` (`path/adapter`, PEFT's format) into this backend's peft model."""
        from slime_env.agents.lora_adapter import LoRAAdapter
        from slime_env.trainers.lora import adapter_names

        folder = path / "adapter" if (path / "adapter").is_dir() else path
        if not (folder / "adapter_config.json").exists():
            raise FileNotFoundError(f"{path}: a LoRA trainer resumes from an adapter checkpoint (adapter/ in PEFT's "
                                    "format); this one holds none")
        saved = LoRAAdapter.load(folder)
        names = adapter_names(self.model)
        unknown = sorted(set(saved.tensors) - set(names))
        if unknown:
            raise ValueError(f"{folder}: adapter tensors {unknown[:3]} match no module of this model")
        self.load_model_state({names[k]: v for k, v in saved.tensors.items()})

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        """Full tensors under the model's own state-dict names into it (the others unchanged)."""
        self.model.load_state_dict({k: v.to(self.device) for k, v in state.items()}, strict=False)

    def model_state(self, adapter_only: bool = False) -> dict[str, torch.Tensor]:
        """The model's state dict as full tensors (views here; a sharded backend gathers them, a collective), or
        only its LoRA tensors."""
        return {k: v.detach() for k, v in self.model.state_dict().items() if not adapter_only or ".lora_" in k}

    def adapter(self) -> Any:
        """The current LoRA adapter (`slime_env.trainers.lora.LoRAAdapter`: PEFT names, copies); LoRA only."""
        from slime_env.trainers.lora import adapter_of

        if self.config.lora is None:
            raise ValueError("adapter(): this trainer has no trainer.lora section")
        return adapter_of(self.model, self.config.lora.name, self.model_state(adapter_only=True))

    @property
    def pushes(self) -> bool:
        """Whether this process sends the weights to engines (one process: always)."""
        return True

    def weight_layout(self) -> Any:
        """How these weights reach an engine (`slime_env.agents.weight_layout.WeightLayout` of the model's config)."""
        from slime_env.agents.weight_layout import WeightLayout

        return WeightLayout.of(self.model.config)

    def weights(self) -> dict[str, torch.Tensor]:
        """The current weights with Hugging Face names (views; with LoRA the adapter merged in)."""
        if self.config.lora is not None:
            from slime_env.trainers.lora import merged_weights

            return merged_weights(self.model, self.config.lora.name, self.model_state())
        return self.model_state()

    def save_weights(self, path: str | Path) -> Path:
        """Only the Hugging Face model folder (safetensors + config.json; with LoRA the merged weights)."""
        if self.config.lora is not None:
            self.model.get_base_model().save_pretrained(path, state_dict=self.weights(), safe_serialization=True)
        else:
            self.model.save_pretrained(path, safe_serialization=True)
        return Path(path)
