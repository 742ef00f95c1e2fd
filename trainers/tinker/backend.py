"""The model side of `slime-env serve-tinker`: LoRA training clients over one base model, and samplers.

A training client is the base model wrapped with `peft` LoRA (rank, seed, attention / MLP as the SDK asks) and an
AdamW over the adapter. `forward_backward` accumulates gradients (Tinker's losses in `losses.py`, log-probs from
`trainers.algorithms.token_logprobs`); `optim_step` applies Adam with the step's own hyper-parameters (learning rate,
betas, eps, weight decay, gradient clipping), then clears them. Sampler weights are the adapter merged into the base
weights, served by the embedded engine (`slime_env.agents.TransformersPolicy`), so sampled tokens and their log-probs
are the engine's own. Every method is synchronous and runs on the server's one worker thread, in arrival order.

LoRA is wrapped here with `peft` (isolated to this module); the LoRA of the unembedding (`train_unembed`) is not
built: the served models tie it to the embedding.
"""

from __future__ import annotations

import copy
import itertools
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slime_env.errors import InvalidInput
from slime_env.trainers.algorithms import token_logprobs
from slime_env.trainers.tinker.losses import loss_for

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass
class TrainingModel:
    model_id: str
    model: Any  # peft.PeftModel
    optimizer: torch.optim.Optimizer
    rank: int
    lora: dict[str, Any]
    steps: int = 0


class TinkerBackend:
    """One base model (`base_model` is the name clients ask for), LoRA training models over it, and samplers."""

    def __init__(self, base_model: str, model: Any, tokenizer: Any, root: str | Path, *,
                 max_context_length: int = 32768, samplers_kept: int = 2, max_batch_size: int = 16):
        self.base_model = base_model
        self.base = model.eval()
        self.tokenizer = tokenizer
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_context_length = max_context_length
        self.models: dict[str, TrainingModel] = {}
        self._samplers: OrderedDict[str, Any] = OrderedDict()
        self._samplers_kept = samplers_kept
        self._max_batch_size = max_batch_size
        self._ids = itertools.count()
        self.vocab_size = int(model.config.vocab_size)

    # --- training models ---------------------------------------------------------------------------------------
    def check_base_model(self, name: str | None) -> None:
        if name is not None and name != self.base_model:
            raise InvalidInput(f"base_model {name!r} is not served here: this server was started with "
                               f"--model {self.base_model!r}")

    def create_model(self, base_model: str, lora: dict[str, Any] | None, model_id: str | None = None) -> str:
        """A LoRA training model over the base (the SDK's id is `<session_id>:train:<model_seq_id>`); returns its id."""
        from peft import LoraConfig, get_peft_model

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
        if lora.get("seed") is not None:
            torch.manual_seed(int(lora["seed"]))
        model = get_peft_model(copy.deepcopy(self.base), LoraConfig(r=rank, lora_alpha=32, lora_dropout=0.0,
                                                                     target_modules=list(targets)))
        params = [p for p in model.parameters() if p.requires_grad]
        model_id = model_id or f"{uuid.uuid4().hex[:8]}-{next(self._ids)}"
        if model_id in self.models:
            raise InvalidInput(f"training model {model_id!r} exists already")
        self.models[model_id] = TrainingModel(model_id, model, torch.optim.AdamW(params, lr=1e-4), rank, dict(lora))
        return model_id

    def get(self, model_id: str | None) -> TrainingModel:
        if model_id not in self.models:
            raise InvalidInput(f"no training model {model_id!r} on this server")
        return self.models[model_id]

    def info(self, model_id: str) -> dict[str, Any]:
        m = self.get(model_id)
        arch = type(self.base).__name__
        return {"type": "get_info", "model_id": model_id, "is_lora": True, "lora_rank": m.rank,
                "model_name": self.base_model,
                "model_data": {"arch": arch, "model_name": self.base_model, "tokenizer_id": self.base_model}}

    # --- forward / backward / optimizer ------------------------------------------------------------------------
    def forward_backward(self, model_id: str, loss_fn: str, config: dict[str, Any], data: list[Any],
                         forward_only: bool) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """Per-datum `logprobs` (and `elementwise_loss` for cross_entropy) and `loss:sum`; gradients accumulate
        unless `forward_only`."""
        m = self.get(model_id)
        fn, needed = loss_for(loss_fn)
        if not data:
            raise InvalidInput("forward_backward got no data")
        batch = [self._check_datum(i, d, needed) for i, d in enumerate(data)]
        width = max(len(t) for t, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        targets = torch.zeros(len(batch), width, dtype=torch.long)
        attn = torch.zeros(len(batch), width, dtype=torch.long)
        for row, (tokens, inputs) in enumerate(batch):
            ids[row, :len(tokens)] = torch.from_numpy(tokens)
            targets[row, :len(tokens)] = torch.from_numpy(inputs["target_tokens"].astype(np.int64))
            attn[row, :len(tokens)] = 1
        m.model.train(not forward_only)
        with torch.set_grad_enabled(not forward_only):
            logits = m.model(input_ids=ids, attention_mask=attn, use_cache=False).logits
            logp = token_logprobs(logits, targets)
            total = logits.new_zeros(())
            outputs = []
            for row, (tokens, inputs) in enumerate(batch):
                n = len(tokens)
                tensors = {k: torch.tensor(v, dtype=torch.float32) for k, v in inputs.items()
                           if k != "target_tokens"}
                loss = fn(logp[row, :n], tensors, config)
                total = total + loss
                out = {"logprobs": logp[row, :n].detach().float().numpy()}
                if loss_fn == "cross_entropy":
                    out["elementwise_loss"] = (-tensors["weights"] * logp[row, :n].detach()).numpy()
                outputs.append(out)
            if not forward_only:
                total.backward()
        return outputs, {"loss:sum": float(total.detach())}

    def _check_datum(self, i: int, d: Any, needed: tuple[str, ...]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
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
        t = d.inputs["target_tokens"]
        if t.min() < 0 or t.max() >= self.vocab_size:
            raise InvalidInput(f"datum {i}: target_tokens outside [0, {self.vocab_size})")
        return d.tokens, d.inputs

    def optim_step(self, model_id: str, adam: dict[str, Any]) -> dict[str, float]:
        """One AdamW step with this call's hyper-parameters (Tinker's AdamParams), then zero the gradients."""
        m = self.get(model_id)
        lr = float(adam.get("learning_rate", 1e-4))
        betas = (float(adam.get("beta1", 0.9)), float(adam.get("beta2", 0.95)))
        if lr < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise InvalidInput(f"adam_params out of range: learning_rate={lr}, betas={betas}")
        for g in m.optimizer.param_groups:
            g.update(lr=lr, betas=betas, eps=float(adam.get("eps", 1e-12)),
                     weight_decay=float(adam.get("weight_decay", 0.0)))
        params = [p for g in m.optimizer.param_groups for p in g["params"]]
        clip = float(adam.get("grad_clip_norm", 0.0))
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        m.optimizer.step()
        m.optimizer.zero_grad(set_to_none=True)
        m.steps += 1
        return {"grad_norm": float(norm), "learning_rate": lr}

    # --- checkpoints ---------------------------------------------------------------------------------------------
    def _file(self, path: str, kind: str) -> Path:
        prefix = "tinker://"
        parts = path[len(prefix):].split("/") if path.startswith(prefix) else []
        if len(parts) != 3 or parts[1] != kind or not all(parts):
            raise InvalidInput(f"{path!r} is not a {kind} path of this server (tinker://<model_id>/{kind}/<name>)")
        file = self.root / parts[0] / kind / f"{parts[2]}.pt"
        if not file.is_file():
            raise InvalidInput(f"{path!r} does not exist on this server")
        return file

    def _new_path(self, model_id: str, kind: str, name: str) -> tuple[str, Path]:
        if not name or "/" in name or name.startswith("."):
            raise InvalidInput(f"checkpoint name {name!r}: a plain file name is needed")
        file = self.root / model_id / kind / f"{name}.pt"
        file.parent.mkdir(parents=True, exist_ok=True)
        return f"tinker://{model_id}/{kind}/{name}", file

    def save_state(self, model_id: str, name: str) -> str:
        """Adapter weights, LoRA config and optimizer state."""
        from peft import get_peft_model_state_dict

        m = self.get(model_id)
        path, file = self._new_path(model_id, "weights", name)
        torch.save({"base_model": self.base_model, "lora": m.lora, "steps": m.steps,
                    "adapter": get_peft_model_state_dict(m.model), "optimizer": m.optimizer.state_dict()}, file)
        return path

    def load_state(self, model_id: str, path: str, optimizer: bool, *, create: bool = False) -> str:
        """Load a `save_state` checkpoint into `model_id` (a new model of that id when `create`)."""
        from peft import set_peft_model_state_dict

        state = torch.load(self._file(path, "weights"), weights_only=False)
        self.check_base_model(state["base_model"])
        if create:
            self.create_model(state["base_model"], state["lora"], model_id)
        m = self.get(model_id)
        set_peft_model_state_dict(m.model, state["adapter"])
        if optimizer:
            m.optimizer.load_state_dict(state["optimizer"])
            m.steps = state["steps"]
        return model_id

    def save_for_sampler(self, model_id: str, name: str | None) -> str:
        """The adapter merged into the base weights; unnamed ones are ephemeral (save_weights_and_get_sampling_client)."""
        m = self.get(model_id)
        path, file = self._new_path(model_id, "sampler_weights", name or f"ephemeral-{next(self._ids)}")
        merged = copy.deepcopy(m.model).merge_and_unload()
        torch.save({"base_model": self.base_model, "state": merged.state_dict()}, file)
        return path

    # --- sampling ----------------------------------------------------------------------------------------------
    def check_sampler(self, model_path: str | None, base_model: str | None) -> str:
        """The sampler key for a model path or the base model (refused clearly when neither is served)."""
        if model_path:
            self._file(model_path, "sampler_weights")
            return model_path
        if base_model is None:
            raise InvalidInput("a sampling client needs model_path or base_model")
        self.check_base_model(base_model)
        return "base"

    def sampler(self, key: str) -> Any:
        from slime_env.agents.transformers_policy import TransformersPolicy

        if key in self._samplers:
            self._samplers.move_to_end(key)
            return self._samplers[key]
        model = self.base
        if key != "base":
            state = torch.load(self._file(key, "sampler_weights"), weights_only=False)
            model = copy.deepcopy(self.base)
            model.load_state_dict(state["state"])
        policy = TransformersPolicy(model, self.tokenizer, max_batch_size=self._max_batch_size, batching="static")
        self._samplers[key] = policy
        while len(self._samplers) > self._samplers_kept:
            _, old = self._samplers.popitem(last=False)
            old.close()
        return policy

    def prompt_logprobs(self, key: str, ids: list[int]) -> list[float]:
        from slime_env.agents.transformers_policy import sequence_logprobs

        with torch.inference_mode():
            return [float("nan")] + sequence_logprobs(self.sampler(key).model, ids)

    def close(self) -> None:
        for policy in self._samplers.values():
            policy.close()
        self._samplers.clear()
