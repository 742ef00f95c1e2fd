"""`MegatronOptions`: the fields of the run config's `trainer:` section that only `MegatronTrainer` reads.

`TrainerConfig` (`slime_env.trainers.torch_trainer`) takes them flat beside the RL step's fields (`trainer: {backend:
megatron, tp: 2, ...}`); `check_megatron` refuses them, by name, under another backend. No megatron-core import here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MegatronOptions:
    """Parallel layout and scale of `backend: megatron` (docs/megatron.md)."""

    # TP size; the token budget of a micro-batch (megatron: its packed rows; the torch and fsdp trainers read it
    # too, as rows times the longest row: a step's activations grow with it).
    tp: int = 1
    max_tokens_per_micro_batch: int = 8192
    offload: bool = False  # on CUDA: optimizer state and gradient buffers leave the GPU between steps
    # Expert-parallel size (MoE models), sequence parallelism over the TP group, activation recompute's layers and
    # modules (`recompute: selective` | `full`, a field of TrainerConfig shared with FSDP).
    ep: int = 1
    cp: int = 1  # context parallel: every packed sequence split over `cp` ranks, two balanced chunks each
    pp: int = 1  # pipeline parallel: the layers in `pp` stages, micro-batches on megatron's 1F1B schedule
    sequence_parallel: bool = False
    recompute_layers: int = 1
    recompute_modules: list[str] | None = None
    # Full recompute's layers: `uniform` (every layer, in chunks of recompute_layers) or `block` (only the first
    # recompute_layers layers of each pipeline stage; the others keep their activations: faster, more memory).
    recompute_method: str = "uniform"
    # false: a recomputed layer keeps its attention output and softmax statistics from the forward, so the backward's
    # recompute skips the attention kernel (heads x (head_dim + 1) values per token and layer; trainers/megatron/
    # attention.py). Full recompute, no CP.
    recompute_attention: bool = True
    # MoE routers: the load-balancing loss kind and its coefficient (None: the model's router_aux_loss_coef), the
    # token dispatcher (None: alltoall on CUDA, allgather on CPU).
    moe_load_balancing: str = "aux_loss"
    moe_aux_loss_coeff: float | None = None
    moe_token_dispatcher: str | None = None
    moe_grouped_gemm: bool = True  # experts as two grouped GEMMs per layer (GroupedExperts); false: SequentialMLP
    # The LM head's log-probs and entropy in chunks of this many tokens (never a micro-batch's [tokens, vocab] logits
    # at once; the backward recomputes them): None = auto (chunks of <= 1 GiB of fp32 logits once a micro-batch's
    # would pass that), 0 = never. TP = 1 and PP = 1 only (vocab-parallel heads keep their own path).
    lm_head_chunk_tokens: int | None = None
    # The packed attention's kernel on GPUs: auto (cuDNN for sequences >= 8k tokens on Hopper, varlen flash for the
    # rest), flash, cudnn (trainers/megatron/attention.py; bench/attention.py measures them).
    attention_kernel: str = "auto"

    def check_megatron(self, backend: str, estimator: str, recompute: str) -> None:
        """ValueError naming the field that does not fit `backend` (and the estimator, the recompute kind)."""
        if backend != "megatron":
            for name in ("tp", "ep", "cp", "pp"):
                if getattr(self, name) != 1:
                    raise ValueError(f"{name}={getattr(self, name)} needs backend: megatron "
                                     f"(the {backend} trainer has no {name.upper()} groups)")
            if self.sequence_parallel:
                raise ValueError("sequence_parallel needs backend: megatron with tp > 1")
        if min(self.tp, self.ep, self.cp, self.pp, self.max_tokens_per_micro_batch, self.recompute_layers) < 1:
            raise ValueError(f"tp ({self.tp}), ep ({self.ep}), cp ({self.cp}), pp ({self.pp}), max_tokens_per_"
                             f"micro_batch ({self.max_tokens_per_micro_batch}) and recompute_layers "
                             f"({self.recompute_layers}) must be >= 1")
        if self.attention_kernel not in ("auto", "flash", "cudnn"):
            raise ValueError(f"attention_kernel must be one of auto, flash, cudnn, got {self.attention_kernel!r}")
        if backend != "megatron" and self.attention_kernel != "auto":
            raise ValueError(f"attention_kernel is the megatron trainer's; the {backend} trainer runs the model's own "
                             "attention")
        if self.recompute_method not in ("uniform", "block"):
            raise ValueError(f"recompute_method must be uniform or block, got {self.recompute_method!r}")
        if self.recompute_method != "uniform" and (backend != "megatron" or recompute != "full"):
            raise ValueError("recompute_method: block is megatron's full recompute (backend: megatron, "
                             "recompute: full)")
        if not self.recompute_attention and (backend != "megatron" or recompute != "full"):
            raise ValueError("recompute_attention: false keeps attention outputs through megatron's full recompute: "
                             f"it needs backend: megatron and recompute: full (got backend {backend}, "
                             f"recompute {recompute})")
        if self.lm_head_chunk_tokens is not None and self.lm_head_chunk_tokens < 0:
            raise ValueError(f"lm_head_chunk_tokens must be >= 0 (0: never), got {self.lm_head_chunk_tokens}")
        if self.lm_head_chunk_tokens and (self.tp > 1 or self.pp > 1):
            raise ValueError("lm_head_chunk_tokens needs tp: 1 and pp: 1 (a vocab-parallel or pipelined head keeps "
                             "its own path)")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel splits activations over the TP group: it needs tp > 1")
        if self.pp > 1 and estimator == "ppo":
            raise ValueError("estimator: ppo with pp > 1: the critic is not pipelined; use pp: 1 (TP / CP / DP scale "
                             "the critic)")
        if backend != "megatron" and recompute == "selective":
            raise ValueError(f"recompute: selective is megatron's; the {backend} trainer takes 'none' or 'full'")
