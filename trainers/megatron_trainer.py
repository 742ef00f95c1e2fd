"""`MegatronTrainer`: the RL trainer on megatron-core (GPUs, TP x DP x EP), same contract as `TorchTrainer`.

It is the RL step of `slime_env.trainers.step` over `MegatronBackend` (`slime_env.trainers.megatron.backend`),
whose model is a megatron `GPTModel` (`slime_env.trainers.megatron`), so one RL step is the very same code:
`pack()` / `TrainBatch`, the old and reference log-probs, `slime_env.trainers.algorithms` for the
loss, KL, entropy and TIS, the exact per-mini-batch reduction. What differs:
- **Packed sequences.** A micro-batch is the rows that fit `max_tokens_per_micro_batch`, concatenated without
  padding (THD, `cu_seqlens`); log-probs are computed only where the loss mask is set, from
  vocabulary-parallel logits, and scattered back into the batch's `[B, L]` layout.
- **Data parallel.** Every rank receives the same trajectories; each computes a contiguous, token-balanced
  share of every mini-batch's rows. Each rank's loss is weighted by its tokens over the mini-batch's global
  masked-token count and gradients are summed across ranks (`calculate_per_token_loss`), so the gradient
  equals the one-GPU gradient.
- **Scale.** Sequence parallelism over the TP group (a packed micro-batch is padded to a multiple of TP with a
  dummy sequence), context parallelism over packed sequences (`slime_env.trainers.megatron.context_parallel`: each CP
  rank holds two balanced chunks of every sequence; log-probs summed over the CP group), pipeline parallelism (each
  stage holds a share of the layers; a mini-batch's packed micro-batches run on megatron's 1F1B schedule, the loss
  and log-probs on the last stage, which sends them to the others), megatron's activation recompute, and MoE models
  (Qwen3-MoE) with experts split over the expert-parallel group (`slime_env.trainers.megatron.moe`).
- **Optimizer.** On CUDA: megatron DDP (fp32 gradient buffers) and megatron's distributed Adam with fp32
  master weights over bf16 parameters, gradient clipping inside. On CPU (tests, fp32): `torch.optim.AdamW`.
- **Reference model.** Its weights stay on the CPU and are swapped into the model for the no-grad pass.
- **Checkpoints and sync** speak Hugging Face: `save` writes safetensors with HF names (gathered across TP)
  and the HF config, so the engine, `TorchTrainer.load` and HF tools read them; optimizer state goes beside.
- **LoRA** (`trainer.lora`): TP-aware adapters on the attention and dense MLP linears, and on Qwen3-MoE's experts
  (EP-split, peft's `target_parameters` layout) and router (`slime_env.trainers.megatron.lora`), the base frozen
  (megatron's DDP and optimizer hold the adapters alone), the KL reference the model with its adapters off;
  `adapter()` is the adapter in PEFT's names, as `TorchTrainer`'s, and a checkpoint holds it in PEFT's format.
  The split step (`trainers.split_step`: `serve-tinker --backend megatron`) is `SplitStep` over
  `datum_logprobs` and this optimizer, without pipeline parallel.
"""

from __future__ import annotations

import torch

from slime_env.trainers.megatron.backend import MegatronBackend
from slime_env.trainers.torch_trainer import TrainerConfig
from slime_env.trainers.trainer import Trainer

__all__ = ["MegatronBackend", "MegatronTrainer"]


class MegatronTrainer(Trainer):
    """RL updates of a Hugging Face Llama / Qwen2 / Qwen3 / Qwen3-MoE model trained as a megatron `GPTModel`: the RL
    step over a `MegatronBackend` (`hf_model` gives the architecture and the initial weights; every rank calls
    `step`, `save`, `weights`, `sync`). `offload()` / `onload()` / `hf_state_dict()` are the backend's."""

    def __init__(self, hf_model: torch.nn.Module, config: TrainerConfig | None = None, *, pad_id: int):
        super().__init__(MegatronBackend(hf_model, config, pad_id=pad_id))












