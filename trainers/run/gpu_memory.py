"""GPU memory of a run: what it must hold on each GPU, estimated from the model's config before anything loads
(`check_fit`, called by `preflight.check_before_start`), and what the GPUs hold, measured (`torch_view` of a trainer
rank's device, `device_used`: the driver's view of every GPU, as nvidia-smi shows it).

The estimate counts only memory that must be resident at once, so it refuses only runs that cannot fit, never one
that could (docs/trainers.md, "Will it fit"). Per trainer rank, from the parameter count P (the model built from its
config on the meta device) and the layout:

- megatron: bf16 weights 2·P/(tp·pp·ep), fp32 gradient buffers 4·P/(tp·pp·ep), the distributed optimizer's fp32
  master weights and two Adam moments 12·P/(tp·pp·ep·dp), dp = ranks/(tp·pp) (its shards span data- and context-
  parallel ranks); in float32, 4 + 4 + 8·/dp. `offload`: gradients and optimizer leave the GPU between steps.
- fsdp: fp32 weights, gradients and moments, all sharded: 16·P/ranks (`fsdp_cpu_offload`: none on the GPU).
- torch: one device, the model in float32: 16·P.
- LoRA: the base weights alone (the adapter and its state are small).

An engine on a trainer's GPU (colocated) holds its weights (2·P in bf16) and its K/V pool: the paged engine's
`mem_fraction` (`engine.mem_fraction`, default 0.4) of the memory free when it starts — the engines start before the
trainer, so of the GPU less the weights and context. While the trainer steps, engines that release their memory
(`trainer.offload` in a synchronous run: serve-engine, SGLang and the embedded engine) keep only their CUDA context.
Every process on a GPU holds a CUDA context with its workspaces (`CONTEXT_BYTES`). Not counted: activations, the
logits of a micro-batch, a PPO critic, an engine's CUDA graphs — a run that passes can still run out of memory in
its step; one that fails cannot run.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from slime_env.errors import InvalidInput

if TYPE_CHECKING:
    from slime_env.trainers.run.config import TrainConfig
    from slime_env.trainers.torch_trainer import TrainerConfig

GB = 1e9
# One process's CUDA context, cuBLAS and NCCL workspaces: a released serve-engine kept 0.93 GB (nvidia-smi, an H200).
CONTEXT_BYTES = int(0.9 * GB)
KV_FRACTION = 0.4  # the paged engine's default `kv_memory_fraction` (agents/paged_engine.py)
RELEASING = ("serve", "sglang", "embedded")  # engine kinds whose memory leaves the GPU while the trainer steps


@dataclass(frozen=True)
class TrainerShare:
    """What one trainer rank keeps on its GPU, in bytes, and how it was divided (for the message)."""

    weights: int
    gradients: int
    optimizer: int
    between_steps: int  # resident while the engines generate (`offload`: the weights alone)
    layout: str

    @property
    def stepping(self) -> int:
        return self.weights + self.gradients + self.optimizer


@dataclass
class GPUNeed:
    """One GPU's need in each phase of a step, with the parts that make it up."""

    gpu: int
    stepping: int = 0      # while the trainer steps
    generating: int = 0    # while the engines generate
    parts: list[str] = field(default_factory=list)

    @property
    def peak(self) -> int:
        return max(self.stepping, self.generating)


def parameter_count(model: str) -> int | None:
    """The parameters of `model` (a run's `model:` field), from its config on the meta device: nothing is loaded
    or allocated. None when its config cannot be read here (the model load reports that)."""
    from slime_env.agents.default_model import meta_model

    meta = meta_model(model)
    return None if meta is None else sum(p.numel() for p in meta.parameters())


def trainer_share(params: int, trainer: TrainerConfig, ranks: int) -> TrainerShare:
    """One rank's weights, gradients and optimizer state for `params` parameters under `trainer` (a
    `TrainerConfig`) over `ranks` ranks; see the module docstring."""
    lora = trainer.lora is not None
    if trainer.backend == "megatron":
        split = trainer.tp * trainer.pp * trainer.ep
        dp = max(1, ranks // (trainer.tp * trainer.pp))
        bf16 = trainer.dtype != "float32"
        weights = (2 if bf16 else 4) * params // split
        grads = 0 if lora else 4 * params // split
        opt = 0 if lora else (12 if bf16 else 8) * params // (split * dp)
        layout = f"megatron, tp {trainer.tp} x pp {trainer.pp} x ep {trainer.ep}, optimizer over dp {dp}"
        between = weights if trainer.offload else weights + grads + opt
        return TrainerShare(weights, grads, opt, between, layout)
    if trainer.backend == "fsdp":
        if trainer.fsdp_cpu_offload:
            return TrainerShare(0, 0, 0, 0, "fsdp, fsdp_cpu_offload")
        weights = 4 * params // ranks
        grads, opt = (0, 0) if lora else (4 * params // ranks, 8 * params // ranks)
        return TrainerShare(weights, grads, opt, weights + grads + opt, f"fsdp over {ranks} rank(s), float32")
    weights = 4 * params
    grads, opt = (0, 0) if lora else (4 * params, 8 * params)
    return TrainerShare(weights, grads, opt, weights + grads + opt, "torch, one device, float32")


def estimate(cfg: TrainConfig, params: int, gpu_bytes: int) -> list[GPUNeed]:
    """Each GPU's need (the trainer's GPUs, and engines' GPUs of their own) for a run `cfg` (a `TrainConfig`) of a
    model of `params` parameters on GPUs of `gpu_bytes` each."""
    s = cfg.sections
    trainer, engine, cluster = s.trainer, s.engine, s.cluster
    ranks = cluster.ranks if cluster.backend != "local" else 1
    share = trainer_share(params, trainer, ranks)
    trainer_gpus = list(range(ranks))
    releases = (trainer.offload and s.asynchrony.mode == "off" and engine.kind in RELEASING)
    fraction = engine.mem_fraction if engine.mem_fraction is not None else KV_FRACTION
    engine_weights = 2 * params if cfg.engine_dtype in ("auto", "bfloat16", "float16") else 4 * params
    # engines on this host's GPUs: GPU -> how many
    on_gpu: dict[int, int] = {}
    if engine.kind == "embedded":
        on_gpu[0] = 1
    elif engine.kind == "serve" and not engine.urls:
        if cluster.backend == "ray":
            for g in (trainer_gpus if cluster.colocate else range(ranks, ranks + cluster.engines)):
                on_gpu[g] = on_gpu.get(g, 0) + 1
        else:
            for i in range(engine.count):
                g = engine.gpus[i % len(engine.gpus)] if engine.gpus else 0
                on_gpu[g] = on_gpu.get(g, 0) + 1
    needs = []
    for g in sorted(set(trainer_gpus) | set(on_gpu)):
        need = GPUNeed(g)
        used = 0  # what the engines hold when the next one starts (they start before the trainer)
        engines_gen = engines_step = 0
        for _ in range(on_gpu.get(g, 0)):
            context = 0 if engine.kind == "embedded" else CONTEXT_BYTES  # embedded: the run's process, counted below
            pool = int(fraction * max(0, gpu_bytes - used - CONTEXT_BYTES - engine_weights))
            engines_gen += context + engine_weights + pool
            engines_step += context if releases else context + engine_weights + pool
            used += context + engine_weights + pool
            need.parts.append(f"engine ({engine.kind}): {engine_weights / GB:.1f} weights + {pool / GB:.1f} K/V pool "
                              f"({fraction:g} of the free memory) + {context / GB:.1f} context"
                              + (", released while the trainer steps" if releases else ""))
        if g in trainer_gpus:  # the rank's process (the embedded engine's too: its context counted here)
            need.stepping = engines_step + share.stepping + CONTEXT_BYTES
            need.generating = engines_gen + share.between_steps + CONTEXT_BYTES
            offloaded = " (gradients and optimizer off the GPU while engines generate)" \
                if share.between_steps < share.stepping else ""
            need.parts.insert(0, f"trainer rank {g} ({share.layout}): {share.weights / GB:.1f} weights + "
                                 f"{share.gradients / GB:.1f} gradients + {share.optimizer / GB:.1f} optimizer"
                                 f"{offloaded} + {CONTEXT_BYTES / GB:.1f} context")
        else:
            need.generating = engines_gen
            need.stepping = engines_gen
        needs.append(need)
    return needs


def check_fit(cfg: TrainConfig, where: str = "config", *, gpu_bytes: int | None = None,
              params: int | None = None) -> None:
    """Refuse, before anything loads, a run on CUDA whose trainer and colocated engines cannot fit a GPU (see the
    module docstring): an `InvalidInput` naming the numbers and the config fields that change them. A no-op on CPUs,
    where no GPU is found, or where the model's config cannot be read here."""
    if cfg.device == "cpu" or str(cfg.device).startswith("cpu"):
        return
    if gpu_bytes is None:
        totals = device_totals()
        if not totals:
            return
        gpu_bytes = min(totals.values())
    if params is None:
        params = parameter_count(cfg.model)
        if params is None:
            return
    worst = max(estimate(cfg, params, gpu_bytes), key=lambda n: n.peak - gpu_bytes)
    if worst.peak <= gpu_bytes:
        return
    s = cfg.sections
    phase = "while the trainer steps" if worst.stepping >= worst.generating else "while the engines generate"
    fixes = []
    if s.trainer.backend == "megatron":
        fixes.append("more ranks to shard over (cluster.trainer.gpus_per_node; trainer.tp / trainer.pp)")
        if not s.trainer.offload and s.asynchrony.mode == "off":
            fixes.append("trainer.offload: true (the engines release their memory while the trainer steps; its "
                         "gradients and optimizer leave the GPU while they generate)")
        elif not s.trainer.offload and worst.generating > worst.stepping:
            fixes.append("trainer.offload: true (gradients and optimizer off the GPU while the engines generate)")
        elif s.asynchrony.mode != "off" and len(worst.parts) > 1:
            fixes.append("async.mode: off with trainer.offload: true (the engines release their memory while the "
                         "trainer steps)")
    elif s.trainer.backend == "fsdp":
        fixes.append("more ranks (cluster.trainer.gpus_per_node) or trainer.fsdp_cpu_offload: true")
    else:
        fixes.append("trainer.backend: megatron or fsdp (bf16 weights, sharded optimizer)")
    if s.trainer.lora is None:
        fixes.append("trainer.lora (train an adapter: no gradients or optimizer state for the base weights)")
    if len(worst.parts) > 1:
        fixes.append("engine.mem_fraction (a smaller K/V pool), or engine.gpus (engines on GPUs of their own)")
    raise InvalidInput(
        f"{where}: the run cannot fit GPU {worst.gpu}: {phase} it must hold at least {worst.peak / GB:.1f} GB of "
        f"the GPU's {gpu_bytes / GB:.1f} GB, for a model of {params / 1e9:.2f} B parameters — "
        + "; ".join(worst.parts) + " (GB; activations not counted). Change: " + "; ".join(fixes))


# --- what the GPUs hold ----------------------------------------------------------------------------------------
def device_used() -> dict[int, tuple[float, float]]:
    """{GPU index: (used GB, total GB)} of every GPU as the driver sees them (nvidia-smi's memory.used: every
    process's, CUDA contexts included); empty without nvidia-smi. Starts no CUDA context in this process."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {}
    try:
        out = subprocess.run([exe, "--query-gpu=index,memory.used,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    view = {}
    for line in out.strip().splitlines():
        index, used, total = (x.strip() for x in line.split(","))
        view[int(index)] = (float(used) * 2**20 / GB, float(total) * 2**20 / GB)  # MiB
    return view


def device_totals() -> dict[int, int]:
    """{GPU index: bytes} of this host's GPUs (nvidia-smi); empty where there is none."""
    return {i: int(total * GB) for i, (_, total) in device_used().items()}


def torch_view(prefix: str) -> dict[str, float]:
    """This process's current CUDA device as torch sees it, in GB — `{prefix}allocated`, `reserved`, and the peaks
    of both since the last call (the peaks are reset) — or {} without CUDA."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    view = {f"{prefix}allocated_gb": torch.cuda.memory_allocated() / GB,
            f"{prefix}reserved_gb": torch.cuda.memory_reserved() / GB,
            f"{prefix}peak_allocated_gb": torch.cuda.max_memory_allocated() / GB,
            f"{prefix}peak_reserved_gb": torch.cuda.max_memory_reserved() / GB}
    torch.cuda.reset_peak_memory_stats()
    return view
