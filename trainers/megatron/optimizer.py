"""The megatron backend's optimizer: megatron DDP and distributed Adam on CUDA; on CPU (gloo) AdamW with megatron's
gradient rules, its state sharded over the data-parallel ranks as megatron's is; the per-rank optimizer shards a
checkpoint holds. The functions take the backend (`b`: a `MegatronBackend`) for its config and parallel sizes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def build(b: Any, module: torch.nn.Module, lr: float):
    """(megatron DDP, megatron distributed Adam) on CUDA; (None, AdamW) on CPU, its state sharded over DP x CP."""
    c = b.config
    if not b.cuda:
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        adamw = {"lr": lr, "betas": c.betas, "weight_decay": c.weight_decay}
        from slime_env.trainers.megatron import moe

        shared = [n for n, _ in named if not moe.is_expert_param(n)]  # experts: their own expert-DP ranks
        if b.dp * b.cp > 1 and len(shared) >= b.dp * b.cp:
            from megatron.core import parallel_state as ps

            return None, ShardedAdamW(named, ps.get_data_parallel_group(with_context_parallel=True),
                                      set(shared), **adamw)
        return None, torch.optim.AdamW([p for _, p in named], **adamw)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=True)
    ddp = DistributedDataParallel(config=module.config, ddp_config=ddp_config, module=module)
    opt = OptimizerConfig(optimizer="adam", lr=lr, min_lr=lr, weight_decay=c.weight_decay,
                          adam_beta1=c.betas[0], adam_beta2=c.betas[1], clip_grad=c.max_grad_norm,
                          bf16=b.dtype == torch.bfloat16, params_dtype=b.dtype,
                          use_distributed_optimizer=True)
    optimizer = get_megatron_optimizer(opt, [ddp])
    # Without apex / Transformer Engine megatron steps torch's AdamW over the fp32 master shards in its
    # multi-tensor (foreach) form; the fused CUDA kernel is the same update in one pass.
    for inner in inner_optimizers(optimizer):
        for group in inner.param_groups:
            group["foreach"], group["fused"] = False, True
    return ddp, optimizer


class ShardedAdamW(torch.optim.AdamW):
    """AdamW that keeps the moments of each parameter of `shared` (replicated over the DP x CP `group`) on one rank
    of the group, which steps it and broadcasts the result: megatron's distributed optimizer on gloo, the same
    updates as AdamW on every rank with 1/(DP x CP) of its state. The other parameters step on every rank."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]], group: Any, shared: set[str], **adamw: Any):
        ranks, me = dist.get_process_group_ranks(group), dist.get_rank()
        load = [0] * len(ranks)
        self.group, self.every = group, [p for _, p in named]
        self.owners: list[tuple[torch.nn.Parameter, int]] = []  # (a shared parameter, its owner's global rank)
        mine = []
        for name, p in named:
            if name in shared:  # to the least loaded rank so far, in a fixed order: every rank computes the same
                r = load.index(min(load))
                load[r] += p.numel()
                self.owners.append((p, ranks[r]))
                if ranks[r] != me:
                    continue
            mine.append(p)
        super().__init__(mine, **adamw)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        me = dist.get_rank()
        for p, owner in self.owners:  # another rank steps it: its gradient goes before the moments are made
            if owner != me:
                p.grad = None
        loss = super().step(closure)
        for p, owner in self.owners:
            dist.broadcast(p.data, src=owner, group=self.group)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.every:  # every parameter's, not only the ones this rank steps
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()


# --- weights in megatron and HF names --------------------------------------------------------------
def step(b: Any, module: torch.nn.Module, ddp: Any, optimizer: Any) -> float:
    """Sum the gradients over the ranks that share them, clip, step; the gradient norm (NaN: none)."""
    if ddp is None:
        return cpu_step(b, module, optimizer)
    from megatron.core.distributed import finalize_model_grads

    for o in getattr(optimizer, "chained_optimizers", [optimizer]):  # it clips to its own config's clip_grad:
        o.config.clip_grad = b.config.max_grad_norm  # `optim_step` sets each call's (inf: none, norm reported)
    finalize_model_grads([ddp])  # sums gradients over DP ranks (per-token loss: no 1/dp scaling)
    if b.lora is not None and module is b.model and b.config.tp > 1:
        from megatron.core import parallel_state as ps

        from slime_env.trainers.megatron.lora import sum_partial_grads

        sum_partial_grads(module, ps.get_tensor_model_parallel_group())
    _, grad_norm, _ = optimizer.step()  # clips to max_grad_norm; skips on inf/nan
    return float(grad_norm) if grad_norm is not None else math.nan

def cpu_step(b: Any, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """CPU (gloo) path, what megatron's DDP and optimizer do on CUDA: sum gradients over DP ranks (experts over
    their expert-DP ranks), sum sequence-parallel norms' partial gradients over TP, sum a tied embedding's two
    copies' gradients over the first and last pipeline stages, clip by the global norm (TP-sharded parameters
    summed across TP, experts across EP, every stage's own parameters across PP, replicated ones and the last
    stage's embedding copy counted once), AdamW."""
    from megatron.core import parallel_state as ps

    from slime_env.trainers.megatron import moe

    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]  # LoRA: the adapters alone
    tp_group = ps.get_tensor_model_parallel_group() if b.config.tp > 1 else None
    # Under CP each rank's gradients come from its own share of the tokens: dense gradients sum over DP x CP
    # (the expert-data-parallel group already spans the CP ranks).
    dense_dp = ps.get_data_parallel_group(with_context_parallel=True) if b.dp * b.cp > 1 else None
    expert_dp = ps.get_expert_data_parallel_group() if b.moe else None
    for name, p in named:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if moe.is_expert_param(name):
            if expert_dp is not None and expert_dp.size() > 1:
                dist.all_reduce(p.grad, group=expert_dp)
        elif dense_dp is not None:
            dist.all_reduce(p.grad, group=dense_dp)
        # megatron's rule (finalize_model_grads): sequence-parallel norms and q/k norms see only this TP rank's
        # tokens / heads, so their gradients are partial sums
        # and LoRA's partial sums (`slime_env.trainers.megatron.lora`: row-parallel B, column-parallel A under SP)
        if tp_group is not None and ((b.config.sequence_parallel and getattr(p, "sequence_parallel", False))
                                     or "q_layernorm" in name or "k_layernorm" in name
                                     or getattr(p, "lora_tp_partial", False)):
            dist.all_reduce(p.grad, group=tp_group)
        if b.pp > 1 and b.stage["tied"] and getattr(p, "shared_embedding", False):
            dist.all_reduce(p.grad, group=ps.get_embedding_group())

    def squares(keep) -> torch.Tensor:
        return sum((p.grad.double().square().sum() for n, p in named if keep(n, p)),
                   torch.zeros((), dtype=torch.float64))

    sharded = squares(lambda n, p: not moe.is_expert_param(n) and getattr(p, "tensor_model_parallel", False))
    if tp_group is not None:
        dist.all_reduce(sharded, group=tp_group)
    experts = squares(lambda n, p: moe.is_expert_param(n))
    if b.config.ep > 1:
        dist.all_reduce(experts, group=ps.get_expert_model_parallel_group())
    replicated = squares(lambda n, p: not moe.is_expert_param(n) and not getattr(p, "tensor_model_parallel", False))
    # the last stage's copy of a tied embedding is marked `shared`: its sharded square is taken out again
    copy = squares(lambda n, p: getattr(p, "shared", False) and getattr(p, "tensor_model_parallel", False))
    if tp_group is not None:
        dist.all_reduce(copy, group=tp_group)
    total = sharded + experts + replicated - copy
    if b.pp > 1:
        dist.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
    grad_norm = float(total.sqrt())
    if not math.isfinite(grad_norm):
        return grad_norm
    scale = b.config.max_grad_norm / (grad_norm + 1e-6)
    if scale < 1.0:
        for _, p in named:
            p.grad.mul_(scale)
    optimizer.step()
    return grad_norm


def gather(local: dict[str, torch.Tensor], size: int, group: Any) -> list[dict[str, torch.Tensor]]:
    """Every rank's `local` tensors over `group` (of `size` ranks), in rank order; [local] when size is 1."""
    if size == 1:
        return [local]
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(size)]
    for name, t in local.items():
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t.contiguous(), group=group)
        for r, part in enumerate(parts):
            shards[r][name] = part
    return shards
def inner_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a megatron optimizer (a chain of one per parameter kind)."""
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
def zero(ddp: Any, optimizer: Any) -> None:
    """Zero the gradients (megatron's buffers too)."""
    if ddp is not None:
        ddp.zero_grad_buffer()
    optimizer.zero_grad(set_to_none=True)
@torch.no_grad()
def copy_params(module: torch.nn.Module, state: Mapping[str, torch.Tensor],
                 which: Callable[[str], bool] = lambda name: True) -> None:
    """Copy `state` into `module`'s parameters by name; every parameter `which` names must be there."""
    params = {k: p for k, p in module.named_parameters() if which(k)}
    missing = [k for k in params if k not in state]
    if missing:
        raise KeyError(f"megatron weights lack {missing[:4]}")
    for name, p in params.items():
        p.copy_(state[name])
def optimizer_shards(optimizer: Any, ddp: Any) -> list[dict[str, Any]]:
    """This rank's shard of an optimizer: the torch state (moments, step) and the fp32 master weights it updates.
    A resume must use the same TP x DP layout (checked by `restore_optimizer`)."""
    inner = [optimizer] if ddp is None else inner_optimizers(optimizer)
    return [{"state": o.state_dict(), "master": [p.detach().to("cpu", copy=True) for g in o.param_groups
                                                 for p in g["params"]]} for o in inner]
@torch.no_grad()
def restore_optimizer(optimizer: Any, ddp: Any, shards: list[dict[str, Any]], where: Path) -> None:
    """This rank's `optimizer_shards` back (the same parallel layout, else ValueError naming `where`)."""
    inner = [optimizer] if ddp is None else inner_optimizers(optimizer)
    if len(shards) != len(inner):
        raise ValueError(f"{where}: saved by a different parallel layout (optimizer chain of {len(shards)}, "
                         f"this trainer has {len(inner)})")
    for opt, part in zip(inner, shards):
        params = [p for g in opt.param_groups for p in g["params"]]
        if [p.shape for p in params] != [m.shape for m in part["master"]]:
            raise ValueError(f"{where}: saved by a different TP x DP layout (master weight shards differ)")
        for p, m in zip(params, part["master"]):
            p.copy_(m)
        opt.load_state_dict(part["state"])
    if ddp is not None:  # the bf16 parameters from the exact fp32 master weights
        for o in getattr(optimizer, "chained_optimizers", [optimizer]):
            o._copy_main_params_to_model_params()
