"""`MegatronTrainer`: the RL trainer on megatron-core (GPUs, TP x DP x EP), same contract as `TorchTrainer`.

It is a `TorchTrainer` whose model is a megatron `GPTModel` (`slime_env.trainers.megatron`), so one RL step is the
very same code: `pack()` / `TrainBatch`, the old and reference log-probs, `slime_env.trainers.algorithms` for the
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
  The split step (`trainers.split_step`: `serve-tinker --backend megatron`) is `TorchTrainer`'s over
  `_datum_logprobs` and this optimizer, without pipeline parallel.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from slime_env.errors import InvalidInput
from slime_env.trajectory import Trajectory
from slime_env.trainers import algorithms as alg
from slime_env.trainers.batch import TrainBatch
from slime_env.trainers.split_step import Datum
from slime_env.trainers.distributed import balanced_ranges, lockstep, token_budget_slices
from slime_env.trainers.megatron.logprobs import head_chunk_tokens
from slime_env.trainers.torch_trainer import TorchTrainer, TrainerConfig, read_hf_weights


class _RefWeights:
    """The reference policy as CPU tensors in megatron names, swapped into the model when needed."""

    def __init__(self, state: Mapping[str, torch.Tensor]):
        self.state = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


@dataclass
class _Packed:
    """A micro-batch as this rank feeds it to the model: its (CP share of the) packed `ids` [1, T'], the THD
    `params`, the batch's loss-masked tokens (`need`, indices into the unpadded packed rows), and for each of them
    the local row of the logit that scores it (`src`, -1 where another CP rank holds it) and its token id."""

    ids: torch.Tensor
    params: Any
    need: torch.Tensor
    src: torch.Tensor
    targets: torch.Tensor


class MegatronTrainer(TorchTrainer):
    """RL updates of a Hugging Face Llama / Qwen2 / Qwen3 / Qwen3-MoE model trained as a megatron `GPTModel`.

    `hf_model` gives the architecture and the initial weights (any device; it is not kept). Run one process
    per GPU under `torchrun` for TP x CP x PP x DP (`config.tp`, `config.cp`, `config.pp`; MoE: `config.ep`); every
    rank must call `step` with the same trajectories.
    `step(trajectories, group_size) -> metrics`, `save(path)`, `load(path)`, `await sync(policy)` (`TorchTrainer`'s),
    `hf_state_dict()` (the current weights with HF names, on every rank).
    """

    def __init__(self, hf_model: torch.nn.Module, config: TrainerConfig | None = None, *, pad_id: int):
        from slime_env.trainers.megatron import build_gpt, init_parallel

        self.config = c = config or TrainerConfig(backend="megatron")
        self.pad_id = pad_id
        self.hf_config = hf_model.config
        if getattr(hf_model.config, "vision_config", None) is not None:
            raise ValueError(f"MegatronTrainer: {type(hf_model).__name__} is a vision-language model, which this "
                             "megatron-core backend does not train: use trainer.backend torch or fsdp (docs/vlm.md)")
        self.cuda = torch.cuda.is_available()
        self.dtype = {"auto": torch.bfloat16 if self.cuda else torch.float32, "bfloat16": torch.bfloat16,
                      "float32": torch.float32}[c.dtype]
        if not self.cuda and self.dtype != torch.float32:
            raise ValueError("MegatronTrainer on CPU trains in float32 "
                             "(megatron's mixed-precision optimizer is CUDA-only)")
        from slime_env.trainers.megatron import moe

        # Every size is checked against the model before the process group or any weight is allocated.
        self._options = dict(ep=c.ep, cp=c.cp, pp=c.pp, sequence_parallel=c.sequence_parallel, recompute=c.recompute,
                             recompute_layers=c.recompute_layers, recompute_modules=c.recompute_modules,
                             recompute_method=c.recompute_method,
                             moe_options=dict(aux_loss_coeff=c.moe_aux_loss_coeff, load_balancing=c.moe_load_balancing,
                                              dispatcher=c.moe_token_dispatcher))
        from slime_env.trainers.megatron import transformer_config

        transformer_config(self.hf_config, tp=c.tp, dtype=self.dtype, **self._options)
        self.parallel = init_parallel(c.tp, ep=c.ep, cp=c.cp, pp=c.pp)
        from megatron.core import parallel_state as ps

        self.tp_rank, self.dp, self.dp_rank = ps.get_tensor_model_parallel_rank(), self.parallel["dp"], \
            self.parallel["dp_rank"]
        self.ep_rank = self.parallel["ep_rank"]
        self.cp, self.cp_rank = c.cp, self.parallel["cp_rank"]
        self.pp, self.pp_rank = c.pp, self.parallel["pp_rank"]
        self._stage = dict(offset=self.pp_rank * (self.hf_config.num_hidden_layers // c.pp),
                           layers=self.hf_config.num_hidden_layers // c.pp, first=self.pp_rank == 0,
                           last=self.pp_rank == c.pp - 1,
                           tied=bool(getattr(self.hf_config, "tie_word_embeddings", False)))
        self.moe = moe.is_moe(self.hf_config)
        # Expert parallel: the ranks of an EP group exchange tokens in every MoE layer, so they run the same number
        # of forward and backward passes; megatron's all-gather dispatcher also needs equal token counts.
        self._lockstep = self.moe and c.ep > 1
        self._min_tokens = 0  # every packed micro-batch is padded to at least this many tokens (see `_padded`)
        self.grouped = self.moe and c.moe_grouped_gemm
        self.lora = None
        if c.lora is not None:  # {megatron linear: Adapted}; refuses what the adapters do not cover by name
            from slime_env.trainers.megatron import lora

            self.lora = lora.plan(c.lora, self.hf_config)
        self.model = build_gpt(self.hf_config, tp=c.tp, dtype=self.dtype, grouped_experts=self.grouped,
                               attention_kernel=c.attention_kernel, keep_attention=not c.recompute_attention,
                               lora=self.lora, **self._options)
        self._gathers_tokens = self._lockstep and self.model.config.moe_token_dispatcher_type == "allgather"
        self.device = next(self.model.parameters()).device
        hf_state = {k: v.detach().to("cpu") for k, v in hf_model.state_dict().items()}
        self._load_mcore(self._from_hf(hf_state))
        if self.lora is not None:  # a fresh adapter from one seed (rank 0's), the same in every parallel layout
            from slime_env.trainers.megatron.lora import freeze_base, initial_adapter, inputs_need_grad

            seed = torch.randint(0, 2**31 - 1, (1,)).to(self.device)  # NCCL broadcasts device tensors only
            dist.broadcast(seed, src=0)
            self._load_adapter_tensors(initial_adapter(self.lora, self.hf_config, int(seed)))
            freeze_base(self.model)
            if c.recompute != "none":
                inputs_need_grad(self.model)
        # the KL reference: with LoRA the model itself with its adapters off (`_reference_logprobs`)
        self.ref_model = _RefWeights(self._mcore_state()) if c.kl_coef > 0 and self.lora is None else None
        self.critic = self.critic_ddp = None
        if c.estimator == "ppo":  # the critic: this architecture without the LM head, a value head on top
            from slime_env.trainers.megatron.value import MegatronValueModel

            self.critic = MegatronValueModel(self.hf_config, tp=c.tp, dtype=self.dtype, grouped_experts=self.grouped,
                                             **self._options)
            mc = self._from_hf(hf_state)
            mc = {f"gpt.{k}": v for k, v in mc.items()} | {"norm.weight": mc["decoder.final_layernorm.weight"]}
            _copy_params(self.critic, mc | {f"head.{k}": v for k, v in self.critic.head.state_dict().items()})
            self.critic_ddp, self.critic_optimizer = self._optimizer_for(self.critic, c.critic_lr)
        del hf_state
        self.ddp, self.optimizer = self._optimizer_for(self.model, c.lr)
        self.role_baselines = alg.RoleBaselines(c.rae_decay) if c.estimator == "rae" else None
        self.step_count = 0
        self._offloaded = False
        self.routing_shape = None
        if c.routing_replay == "rollout":  # MoE routing replay (slime_env.trainers.routing_replay)
            if not self.moe:
                raise InvalidInput(f"routing_replay: {self.hf_config.model_type} is not a MoE model; set "
                                   "trainer.routing_replay: off")
            if c.cp > 1 or c.pp > 1 or (c.sequence_parallel and c.tp > 1):
                raise ValueError("routing_replay: rollout runs with TP (without sequence parallel), EP and DP; context "
                                 "parallel, pipeline parallel and sequence parallel are not supported yet")
            h = self.hf_config
            self.routing_shape = (h.num_hidden_layers, h.num_experts_per_tok, h.num_experts)

    # --- GPU memory between steps -------------------------------------------------------------------
    def offload(self) -> None:
        """Release the GPU memory the trainer needs only inside `step` — the optimizer's master weights and
        moments go to CPU memory, the gradient buffers are freed — so a colocated engine can use it while it
        generates. The bf16 weights stay (the engine syncs from them). `step` brings everything back itself.
        A no-op on CPU. With `offload: true` in the config, every `step` ends with it."""
        if self.ddp is None or self._offloaded:
            return
        for ddp, optimizer in self._parts():
            optimizer.offload_to_cpu()
            ddp.offload_grad_buffers()
        self._offloaded = True

    def onload(self) -> None:
        """Undo `offload` (called by `step`)."""
        if not self._offloaded:
            return
        for ddp, optimizer in self._parts():
            ddp.restore_grad_buffers()
            optimizer.restore_from_cpu()
        self._offloaded = False

    def _parts(self) -> list[tuple[Any, Any]]:
        return [(self.ddp, self.optimizer)] + ([(self.critic_ddp, self.critic_optimizer)] if self.critic_ddp else [])

    def step(self, trajectories: Sequence[Trajectory], group_size: int) -> dict[str, float]:
        if any(t.vision is not None for t in trajectories):
            raise ValueError("MegatronTrainer: trajectories hold images (Trajectory.vision), which this megatron-core "
                             "backend does not train: use trainer.backend torch or fsdp (docs/vlm.md)")
        self.onload()
        metrics = super().step(trajectories, group_size)
        if self.config.offload:
            self.offload()
        return metrics

    def _param_groups(self) -> list[dict[str, Any]]:
        # megatron's distributed optimizer steps the torch optimizers inside it: their groups hold the live `lr`
        return [g for inner in _inner(self.optimizer) for g in inner.param_groups] if self.cuda \
            else super()._param_groups()

    def _optimizer_for(self, module: torch.nn.Module, lr: float):
        """(megatron DDP, megatron distributed Adam) on CUDA; (None, AdamW) on CPU."""
        c = self.config
        if not self.cuda:
            return None, torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=lr, betas=c.betas,
                                           weight_decay=c.weight_decay)
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=True)
        ddp = DistributedDataParallel(config=module.config, ddp_config=ddp_config, module=module)
        opt = OptimizerConfig(optimizer="adam", lr=lr, min_lr=lr, weight_decay=c.weight_decay,
                              adam_beta1=c.betas[0], adam_beta2=c.betas[1], clip_grad=c.max_grad_norm,
                              bf16=self.dtype == torch.bfloat16, params_dtype=self.dtype,
                              use_distributed_optimizer=True)
        optimizer = get_megatron_optimizer(opt, [ddp])
        # Without apex / Transformer Engine megatron steps torch's AdamW over the fp32 master shards in its
        # multi-tensor (foreach) form; the fused CUDA kernel is the same update in one pass.
        for inner in _inner(optimizer):
            for group in inner.param_groups:
                group["foreach"], group["fused"] = False, True
        return ddp, optimizer

    # --- weights in megatron and HF names --------------------------------------------------------------
    def _from_hf(self, hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's megatron weights (its TP shard, its EP share of the experts, stacked for `GroupedExperts`)
        from a full HF state dict."""
        from slime_env.trainers.megatron import hf_to_mcore, moe
        from slime_env.trainers.megatron.convert import stage_weights

        state = hf_to_mcore(hf, self.hf_config, tp_rank=self.tp_rank, tp_size=self.config.tp)
        if self.pp > 1:
            state = stage_weights(state, **self._stage)
        if self.moe:
            state = moe.local_experts(state, self.hf_config.num_experts, self.ep_rank, self.config.ep)
        return moe.to_grouped(state) if self.grouped else state

    def _mcore_state(self) -> dict[str, torch.Tensor]:
        """The base model's weights (this rank's, megatron names; no adapter)."""
        from slime_env.trainers.megatron.lora import is_lora_param

        return {k: v for k, v in self.model.state_dict().items()
                if not k.endswith("_extra_state") and not is_lora_param(k)}

    def _load_mcore(self, state: Mapping[str, torch.Tensor]) -> None:
        from slime_env.trainers.megatron.lora import is_lora_param

        _copy_params(self.model, state, lambda name: not is_lora_param(name))

    def _load_adapter_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """A PEFT adapter's tensors (HF names) into this rank's adapter parameters."""
        from slime_env.trainers.megatron import lora
        from slime_env.trainers.megatron.convert import stage_weights

        state = lora.from_peft(tensors, self.lora, self.hf_config, tp_rank=self.tp_rank, tp_size=self.config.tp,
                               ep_rank=self.ep_rank, ep_size=self.config.ep)
        if self.pp > 1:
            state = stage_weights(state, **(self._stage | {"tied": False}))
        _copy_params(self.model, state, lora.is_lora_param)

    @torch.no_grad()
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Current weights with Hugging Face names, gathered across TP ranks and, for experts, EP ranks (a
        collective under TP or EP). MoE experts come in transformers' fused in-memory layout."""
        from megatron.core import parallel_state as ps

        from slime_env.trainers.megatron import mcore_to_hf, moe

        local = moe.from_grouped(self._mcore_state()) if self.grouped else self._mcore_state()
        experts = {k: v for k, v in local.items() if moe.is_expert_param(k)}
        dense = {k: v for k, v in local.items() if k not in experts}
        shards = _gather(dense, self.config.tp, ps.get_tensor_model_parallel_group() if self.config.tp > 1 else None)
        if experts:
            group = ps.get_expert_model_parallel_group() if self.config.ep > 1 else None
            shards[0] = shards[0] | moe.global_experts(_gather(experts, self.config.ep, group))
        return mcore_to_hf(self._all_stages(shards), self.hf_config)

    def _all_stages(self, shards: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        """Per-TP-rank megatron tensors of this pipeline stage -> of every stage, layers numbered over the whole model
        (a collective under PP)."""
        if self.pp == 1:
            return shards
        from megatron.core import parallel_state as ps

        from slime_env.trainers.megatron.convert import renumber_layers

        group = ps.get_pipeline_model_parallel_group()
        mine = [renumber_layers(sh, self._stage["offset"]) for sh in shards]
        # names, shapes and dtypes go as objects; the tensors one at a time from their stage, straight into place:
        # all_gather_object pickled every stage whole and held the bytes, the gathered buffer and the copies at once,
        # the Ray placement test's memory peak (~3.2 GB per rank of SmolLM2 under PP=2, ~2.2 GB now)
        metas: list[Any] = [None] * self.pp
        dist.all_gather_object(metas, [{k: (tuple(v.shape), v.dtype) for k, v in sh.items()} for sh in mine],
                               group=group)
        ranks, me = dist.get_process_group_ranks(group), ps.get_pipeline_model_parallel_rank()
        device = next(iter(mine[0].values())).device
        out: list[dict[str, torch.Tensor]] = [{} for _ in shards]
        for stage in reversed(range(self.pp)):  # a name on two stages (a tied embedding): the last stage's, as before
            for t, names in enumerate(metas[stage]):
                for name, (shape, dtype) in names.items():
                    if name in out[t]:
                        continue
                    x = mine[t][name].detach().contiguous() if stage == me else torch.empty(shape, dtype=dtype,
                                                                                           device=device)
                    dist.broadcast(x, src=ranks[stage], group=group)
                    out[t][name] = x.cpu()
        return [{k: sh[k] for stage in metas for k in stage[t]} for t, sh in enumerate(out)]

    @torch.no_grad()
    def adapter(self) -> Any:
        """The current LoRA adapter (`slime_env.agents.lora_adapter.LoRAAdapter`: PEFT's names and config, copies, the
        fused layers' adapters split per projection), gathered across TP and PP: every rank calls it."""
        if self.lora is None:
            raise ValueError("adapter(): this trainer has no trainer.lora section")
        from megatron.core import parallel_state as ps

        from slime_env.agents.lora_adapter import LoRAAdapter
        from slime_env.trainers.megatron import lora, moe

        local = {k: v.detach() for k, v in lora.lora_state(self.model).items()}
        experts = {k: v for k, v in local.items() if moe.is_expert_param(k)}  # [local experts, ...]: joined over EP
        shards = _gather({k: v for k, v in local.items() if k not in experts}, self.config.tp,
                         ps.get_tensor_model_parallel_group() if self.config.tp > 1 else None)
        if experts:
            group = ps.get_expert_model_parallel_group() if self.config.ep > 1 else None
            parts = _gather(experts, self.config.ep, group)
            shards[0] = shards[0] | {k: torch.cat([p[k] for p in parts]) for k in experts}
        tensors = lora.to_peft(self._all_stages(shards), self.lora, self.hf_config)
        return LoRAAdapter(self.config.lora.name, {k: v.cpu() for k, v in tensors.items()},
                           lora.peft_config(self.config.lora, self.lora, self.hf_config))

    def _reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        if self.lora is None:
            return super()._reference_logprobs(batch)
        from slime_env.trainers.megatron.lora import adapters_off

        with adapters_off(self.model):  # the base model: no second copy of the weights
            return self._frozen_logprobs(self.model, batch)

    @contextlib.contextmanager
    def _swapped(self, ref: _RefWeights) -> Iterator[None]:
        """The reference weights in the model for the duration; the trained ones back afterwards, bit for bit."""
        params = dict(self.model.named_parameters())
        saved = {k: p.detach().to("cpu", copy=True) for k, p in params.items()}
        self._load_mcore(ref.state)
        try:
            yield
        finally:
            self._load_mcore(saved)

    # --- log-probs over packed sequences -------------------------------------------------------------------
    def logprobs(self, model: Any, batch: TrainBatch, *, with_entropy: bool = False):
        """Log-probs (and entropies) aligned with `batch.input_ids` [B, L], set where the loss mask is set.

        The rows are packed (THD); the logits at packed index j - 1 score token j."""
        if self.pp > 1:  # no gradient through a pipeline outside the schedule: `_update` runs the gradient passes
            with torch.no_grad():
                out = self._pipelined_logprobs(batch, [slice(0, batch.size)], with_entropy=with_entropy)
            return out if with_entropy else out[0]
        p = self._packed(batch)
        if p is None:
            self._idle_forward()
            zeros = self._scatter(batch, None, None)
            return (zeros, zeros.clone()) if with_entropy else zeros
        forward = self.ddp if (self.ddp is not None and model is self.model) else self.model
        if self.routing_shape is not None:
            self._replay_routes(batch, p)
        chunk = 0 if self.config.tp > 1 else head_chunk_tokens(self.config.lm_head_chunk_tokens, p.ids.numel(),
                                                        self.hf_config.vocab_size)
        if chunk:  # the model stops at its final norm; the head runs in chunks of `chunk` tokens
            from slime_env.trainers.megatron.model import final_hidden_states

            with final_hidden_states(forward) as head_weight:
                hidden = forward(input_ids=p.ids, position_ids=None, attention_mask=None,
                                 packed_seq_params=p.params)[0]  # [T', H]
            out = self._scored_logprobs(batch, p, hidden, with_entropy, head=(head_weight(), chunk))
            return out if with_entropy else out[0]
        logits = forward(input_ids=p.ids, position_ids=None, attention_mask=None,
                         packed_seq_params=p.params)[0]  # [T', V / tp]
        out = self._scored_logprobs(batch, p, logits, with_entropy)
        return out if with_entropy else out[0]

    def _replay_routes(self, batch: TrainBatch, p: _Packed) -> None:
        """Routing replay: the batch's routes in the packed order the routers see (no CP / SP: the unpadded rows,
        then the dummy sequence, which routes itself)."""
        from slime_env.trainers import routing_replay as rr

        if batch.routed_experts is None:
            rr.megatron_use_routes(self.model, None)
            return
        rows = batch.routed_experts[batch.attention_mask.bool()]  # [N, layers, top_k], unpadded() order
        routes = rows.new_full((p.ids.shape[1], *rows.shape[1:]), -1)
        routes[:rows.shape[0]] = rows
        rr.megatron_use_routes(self.model, routes.to(self.device))

    def _scored_logprobs(self, batch: TrainBatch, p: _Packed, logits: torch.Tensor, with_entropy: bool,
                         head: tuple[torch.Tensor, int] | None = None) -> list[torch.Tensor]:
        """[log-probs] or [log-probs, entropies], each [B, L] in `batch`'s layout, from this rank's `logits` (or,
        with `head` = (the LM head's weight, tokens per chunk), from its final hidden states)."""
        from slime_env.trainers.megatron import vocab_parallel_logprobs
        from slime_env.trainers.megatron.logprobs import chunked_head_logprobs

        def score(rows: torch.Tensor, targets: torch.Tensor):
            if head is not None:
                out = chunked_head_logprobs(rows, head[0], targets, chunk_tokens=head[1], with_entropy=with_entropy)
            else:
                out = vocab_parallel_logprobs(rows, targets, with_entropy=with_entropy)
            return out if with_entropy else (out,)

        return [self._scatter(batch, p.need, x) for x in self._at_scored(p, logits, score)]

    def _datum_logprobs(self, data: Sequence[Datum]) -> list[torch.Tensor]:
        """The split step's log-probs (`TorchTrainer.forward` / `forward_backward` call this): the data packed (THD),
        the logit at each datum's position p scoring its `targets[p]`. No pipeline: its schedule owns the backward."""
        if self.pp > 1:
            raise ValueError("forward / forward_backward (the split step) run without pipeline parallel (pp: 1)")
        lengths = [len(d.tokens) for d in data]
        ids, params, (where, local_row, _) = self._layout(torch.cat([d.tokens for d in data]),
                                                           torch.tensor([0, *itertools.accumulate(lengths)],
                                                                        dtype=torch.int32))
        need = torch.arange(sum(lengths))
        src = where if local_row is None else local_row[where]  # a datum's own position scores its target
        p = _Packed(ids, params, need.to(self.device), src.to(self.device),
                    torch.cat([d.targets for d in data]).to(self.device))
        forward = self.ddp if self.ddp is not None else self.model
        logits = forward(input_ids=p.ids, position_ids=None, attention_mask=None, packed_seq_params=p.params)[0]
        from slime_env.trainers.megatron import vocab_parallel_logprobs

        (logp,) = self._at_scored(p, logits, lambda rows, targets: (vocab_parallel_logprobs(rows, targets),))
        return list(logp.float().split(lengths))

    # --- pipeline parallel -----------------------------------------------------------------------------------
    def _pipeline(self, micros: Sequence[TrainBatch], on_logits: Callable[[int, _Packed, torch.Tensor], Any], *,
                  train: bool) -> None:
        """`micros` through megatron's pipeline schedule (1F1B; forward only unless `train`), every stage of this
        DP rank taking part. On the last stage `on_logits(i, packed, logits)` handles micro-batch i and returns the
        scalar to backpropagate (the schedule runs each micro-batch's backward as soon as 1F1B allows). A
        micro-batch without loss tokens still flows through every stage, as a pad sequence with zero loss."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        fixed = not self.model.config.variable_seq_lengths
        if fixed:  # one activation shape for the whole schedule: every micro-batch padded to the longest
            totals = [sum(self._model_lengths(m.attention_mask.sum(-1).tolist())) for m in micros]
            # under EP lockstep `_micro_slices` has just set the common count of all EP ranks' micro-batches
            self._min_tokens = max([1, self._min_tokens if self._gathers_tokens else 0] + totals)
        packed = [self._packed(m) for m in micros]
        seq_length = self._padded_total(1) if fixed else 1  # the padded global length
        model = self.ddp if (train and self.ddp is not None) else self.model

        def forward_step(data_iterator, chunk):
            i = next(data_iterator)
            p = packed[i]
            ids, params = (p.ids, p.params) if p is not None else self._dummy()
            output = chunk(input_ids=ids, position_ids=None, attention_mask=None, packed_seq_params=params)

            def loss(logits):
                value = logits.float().sum() * 0.0 if p is None else on_logits(i, p, logits[0])
                return value, torch.zeros((), dtype=torch.int), {}

            return output, loss

        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(range(len(micros))),
                                    model=[model], num_microbatches=len(micros), seq_length=seq_length,
                                    micro_batch_size=1, forward_only=not train)

    def _from_last_stage(self, x: Any) -> Any:
        """The last pipeline stage's `x` (a tensor or a picklable object) on every stage of this pipeline."""
        from megatron.core import parallel_state as ps

        group = ps.get_pipeline_model_parallel_group()
        src = ps.get_pipeline_model_parallel_last_rank()
        if isinstance(x, torch.Tensor):
            y = x.to(self.device).contiguous()
            dist.broadcast(y, src=src, group=group)
            return y.to(x.device)
        box = [x]
        dist.broadcast_object_list(box, src=src, group=group)
        return box[0]

    def _pipelined_logprobs(self, batch: TrainBatch, slices: Sequence[slice], *, with_entropy: bool = False
                            ) -> list[torch.Tensor]:
        """[log-probs] (and entropies) [B, L] of `batch` on every stage, its micro-batches `slices` pipelined."""
        outs = [torch.zeros(batch.input_ids.shape, dtype=torch.float32) for _ in range(2 if with_entropy else 1)]
        micros = [batch.rows(s) for s in slices]

        def on_logits(i: int, p: _Packed, logits: torch.Tensor):
            for out, x in zip(outs, self._scored_logprobs(micros[i], p, logits, with_entropy)):
                out[slices[i]] = x.cpu()
            return torch.zeros((), device=self.device)

        self._pipeline(micros, on_logits, train=False)
        return [self._from_last_stage(o) for o in outs]

    def _update(self, mini: TrainBatch, old: torch.Tensor | None, ref: torch.Tensor | None,
                targets: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, float]:
        from slime_env.trainers.megatron.attention import keeping

        with keeping(self.model):  # `recompute_attention: false`: outputs kept through recompute, dropped after
            return self._update_kept(mini, old, ref, targets)

    def _update_kept(self, mini: TrainBatch, old: torch.Tensor | None, ref: torch.Tensor | None,
                     targets: tuple[torch.Tensor, torch.Tensor] | None) -> dict[str, float]:
        if self.pp == 1:
            return super()._update(mini, old, ref, targets)
        self._zero_grad()
        total_tokens = float(mini.loss_mask.sum().clamp(min=1.0))
        slices = self._micro_slices(mini)
        micros = [mini.rows(s).trimmed() for s in slices]
        stats: dict[str, float] = {}

        def on_logits(i: int, p: _Packed, logits: torch.Tensor) -> torch.Tensor:
            logp, entropy = self._scored_logprobs(micros[i], p, logits, True)
            loss, share, reported = self._micro_loss(micros[i], slices[i], logp, entropy, old, ref, total_tokens,
                                                     mini.size)
            for k, v in reported.items():
                stats[k] = stats.get(k, 0.0) + float(v.detach()) * share
            return loss * share

        self._pipeline(micros, on_logits, train=True)
        stats = self._reduce_stats(self._from_last_stage(stats))
        stats["grad_norm"] = self._optimizer_step()
        self._zero_grad()
        return stats

    def _at_scored(self, p: _Packed, local: torch.Tensor, fn: Callable[..., Sequence[torch.Tensor]]
                   ) -> list[torch.Tensor]:
        """`fn(rows of local that score a loss token, their target ids)` -> per-token tensors, as [len(p.need)]
        each. Under CP every rank computes the tokens whose scoring row it holds and the sums over the CP group
        complete them (backward: each rank's own share)."""
        if self.cp == 1:
            return list(fn(local[p.src], p.targets))
        from slime_env.trainers.megatron.context_parallel import sum_over_cp
        from megatron.core import parallel_state as ps

        mine = (p.src >= 0).nonzero().squeeze(-1)
        parts = fn(local[p.src[mine]], p.targets[mine])
        group = ps.get_context_parallel_group()
        # A rank that scores nothing here still joins the backward: its K/V fed the other ranks' queries, and the
        # all-gather's backward is a collective.
        tie = local.reshape(-1)[0].float() * 0.0 if mine.numel() == 0 else 0.0
        return [sum_over_cp(torch.zeros(p.need.numel(), dtype=torch.float32, device=self.device)
                            .index_put((mine,), part.float()) + tie, group) for part in parts]

    def values(self, batch: TrainBatch) -> torch.Tensor:
        """The critic's [B, L] values (the state before each loss-masked token), from packed rows."""
        p = self._packed(batch)
        if p is None:
            if self._lockstep:
                with torch.no_grad():
                    self.critic(*self._dummy())
            return self._scatter(batch, None, None)
        forward = self.critic_ddp if self.critic_ddp is not None else self.critic
        hidden = forward(p.ids, p.params)
        return self._scatter(batch, p.need, self._at_scored(p, hidden, lambda rows, _: (self.critic.values(rows),))[0])

    def _packed(self, batch: TrainBatch) -> _Packed | None:
        """`batch`'s rows concatenated as this rank feeds them to the model; None if no token is loss-masked. A
        loss-masked token is never a sequence start (prompts are masked)."""
        u = batch.unpadded()
        need = (u["loss_mask"] > 0).nonzero().squeeze(-1)
        if need.numel() == 0:
            return None
        ids, params, index = self._layout(u["input_ids"], u["cu_seqlens"])
        at = index[0][need]  # where each loss token sits in the padded global layout
        src = at - 1 if index[1] is None else index[1][at - 1]
        return _Packed(ids, params, need.to(self.device), src.to(self.device), index[2][at].to(self.device))

    def _layout(self, ids: torch.Tensor, cu: torch.Tensor):
        """(this rank's ids [1, T'], THD params, (padded index of each input token, local row of each padded
        token or None without CP, the padded ids)). Under CP each sequence is padded to a multiple of 2·CP and
        the rank keeps its two chunks of each; `_padded` then appends the dummy sequence the layout needs."""
        from megatron.core.packed_seq_params import PackedSeqParams

        where = torch.arange(ids.numel())
        if self.cp > 1:
            from slime_env.trainers.megatron import context_parallel as ctx

            ids, cu, where = ctx.pad_sequences(ids, cu, self.cp, self.pad_id)
        ids, cu = self._padded(ids, cu)
        local_row = None
        full = ids
        if self.cp > 1:
            shard = ctx.shard_index(cu, self.cp_rank, self.cp)
            local_row = torch.full((ids.numel(),), -1, dtype=torch.long)
            local_row[shard] = torch.arange(shard.numel())
            ids = ids[shard]
        longest = int((cu[1:] - cu[:-1]).max())
        cu = cu.to(self.device)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                                 max_seqlen_kv=longest)
        return ids.to(self.device).unsqueeze(0), params, (where, local_row, full)

    def _padded(self, ids: torch.Tensor, cu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`ids` with a dummy sequence of pad ids appended where the layout needs it: sequence parallel splits
        (each CP rank's share of) the tokens over TP, so their count must divide; CP splits every sequence into 2·CP
        chunks; megatron's all-gather token dispatcher under EP gathers equal token counts from every EP rank (each
        micro-batch is padded to `_min_tokens`; so is every micro-batch of a pipeline schedule whose stages exchange
        activations of one fixed shape). The dummy sequence attends only to itself and no log-prob is read
        from it."""
        pad = self._padded_total(ids.numel()) - ids.numel()
        if pad:
            ids = torch.cat([ids, ids.new_full((pad,), self.pad_id)])
            cu = torch.cat([cu, cu[-1:] + pad])
        return ids, cu

    def _padded_total(self, n: int) -> int:
        """The packed token count the model is given for `n` tokens (see `_padded`)."""
        target = max(n, self._min_tokens)
        multiple = math.lcm(2 * self.cp if self.cp > 1 else 1,
                            self.cp * self.config.tp if self.config.sequence_parallel else 1)
        return target + -target % multiple

    def _model_lengths(self, lengths: list[int]) -> list[int]:
        """Sequence lengths as the model sees them: under CP each padded for the 2·CP split."""
        if self.cp == 1:
            return lengths
        from slime_env.trainers.megatron.context_parallel import padded_lengths

        return padded_lengths(lengths, self.cp)

    def _dummy(self) -> tuple[torch.Tensor, Any]:
        """(ids [1, T'], THD params) of one sequence of pad ids: the forward an idle rank runs."""
        ids, params, _ = self._layout(torch.full((1,), self.pad_id, dtype=torch.long),
                                      torch.tensor([0, 1], dtype=torch.int32))
        if getattr(self, "routing_shape", None) is not None:  # routing replay: the pad sequence routes itself
            from slime_env.trainers import routing_replay as rr

            rr.megatron_use_routes(self.model, None)
        return ids, params

    def _idle_forward(self) -> None:
        """Expert parallel: a rank with nothing to compute still joins its EP group's token exchange."""
        if not self._lockstep:
            return
        ids, packed = self._dummy()
        with torch.no_grad():
            self.model(input_ids=ids, position_ids=None, attention_mask=None, packed_seq_params=packed)

    def _idle_micro_batch(self) -> None:
        if not self._lockstep:
            return
        ids, packed = self._dummy()
        forward = self.ddp if self.ddp is not None else self.model
        if self.moe:
            from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

            MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(0.0, device=self.device))
        logits = forward(input_ids=ids, position_ids=None, attention_mask=None, packed_seq_params=packed)
        (logits.float().sum() * 0.0).backward()

    def _scatter(self, batch: TrainBatch, need: torch.Tensor | None, values: torch.Tensor | None) -> torch.Tensor:
        """Per-token `values` at packed indices `need` -> [B, L] in the batch's layout (zeros elsewhere)."""
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=self.device)
        if need is None:
            return out
        keep = batch.attention_mask.to(self.device).bool()
        flat = torch.zeros(int(keep.sum()), dtype=torch.float32, device=self.device).index_put((need,), values)
        return out.masked_scatter(keep, flat)

    @torch.no_grad()
    def _frozen_logprobs(self, model: Any, batch: TrainBatch) -> torch.Tensor:
        if isinstance(model, _RefWeights):
            with self._swapped(model):
                return self._frozen_logprobs(self.model, batch)
        if self.pp > 1:
            self.model.eval()
            return self._pipelined_logprobs(batch, self._micro_slices(batch))[0]
        return super()._frozen_logprobs(model, batch)

    # --- this rank's rows, gradients, optimizer -------------------------------------------------------------
    def _micro_slices(self, batch: TrainBatch) -> list[slice]:
        """This DP rank's micro-batches. Under expert parallelism every rank gets as many (empty ones appended:
        a rank without rows runs an idle pass) and, with the all-gather dispatcher, a common token count."""
        lengths = batch.attention_mask.sum(-1).tolist()
        budget = self.config.max_tokens_per_micro_batch
        per_rank = [token_budget_slices(lengths, a, b, budget) for a, b in balanced_ranges(lengths, self.dp)]
        if not self._lockstep:
            return per_rank[self.dp_rank]
        if self._gathers_tokens:
            lengths = self._model_lengths(lengths)  # the token counts the model sees
            self._min_tokens = max([sum(lengths[s]) for slices in per_rank for s in slices] or [1])
        return lockstep(per_rank, self.dp_rank)

    def _zero_grad(self) -> None:
        _zero(self.ddp, self.optimizer)

    def _optimizer_step(self) -> float:
        return self._step(self.model, self.ddp, self.optimizer)

    def _critic_step(self) -> float:
        grad_norm = self._step(self.critic, self.critic_ddp, self.critic_optimizer)
        _zero(self.critic_ddp, self.critic_optimizer)
        return grad_norm

    def _all_rows(self, x: torch.Tensor) -> torch.Tensor:
        if self.dp == 1:
            return x
        from megatron.core import parallel_state as ps

        y = x.to(self.device)
        dist.all_reduce(y, group=ps.get_data_parallel_group())  # each row was computed by exactly one DP rank
        return y.to(x.device)

    def _step(self, module: torch.nn.Module, ddp: Any, optimizer: Any) -> float:
        if ddp is None:
            return self._cpu_optimizer_step(module, optimizer)
        from megatron.core.distributed import finalize_model_grads

        for o in getattr(optimizer, "chained_optimizers", [optimizer]):  # it clips to its own config's clip_grad:
            o.config.clip_grad = self.config.max_grad_norm  # `optim_step` sets each call's (inf: none, norm reported)
        finalize_model_grads([ddp])  # sums gradients over DP ranks (per-token loss: no 1/dp scaling)
        if self.lora is not None and module is self.model and self.config.tp > 1:
            from megatron.core import parallel_state as ps

            from slime_env.trainers.megatron.lora import sum_partial_grads

            sum_partial_grads(module, ps.get_tensor_model_parallel_group())
        _, grad_norm, _ = optimizer.step()  # clips to max_grad_norm; skips on inf/nan
        return float(grad_norm) if grad_norm is not None else math.nan

    def _cpu_optimizer_step(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
        """CPU (gloo) path, what megatron's DDP and optimizer do on CUDA: sum gradients over DP ranks (experts over
        their expert-DP ranks), sum sequence-parallel norms' partial gradients over TP, sum a tied embedding's two
        copies' gradients over the first and last pipeline stages, clip by the global norm (TP-sharded parameters
        summed across TP, experts across EP, every stage's own parameters across PP, replicated ones and the last
        stage's embedding copy counted once), AdamW."""
        from megatron.core import parallel_state as ps

        from slime_env.trainers.megatron import moe

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]  # LoRA: the adapters alone
        tp_group = ps.get_tensor_model_parallel_group() if self.config.tp > 1 else None
        # Under CP each rank's gradients come from its own share of the tokens: dense gradients sum over DP x CP
        # (the expert-data-parallel group already spans the CP ranks).
        dense_dp = ps.get_data_parallel_group(with_context_parallel=True) if self.dp * self.cp > 1 else None
        expert_dp = ps.get_expert_data_parallel_group() if self.moe else None
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
            if tp_group is not None and ((self.config.sequence_parallel and getattr(p, "sequence_parallel", False))
                                         or "q_layernorm" in name or "k_layernorm" in name
                                         or getattr(p, "lora_tp_partial", False)):
                dist.all_reduce(p.grad, group=tp_group)
            if self.pp > 1 and self._stage["tied"] and getattr(p, "shared_embedding", False):
                dist.all_reduce(p.grad, group=ps.get_embedding_group())

        def squares(keep) -> torch.Tensor:
            return sum((p.grad.double().square().sum() for n, p in named if keep(n, p)),
                       torch.zeros((), dtype=torch.float64))

        sharded = squares(lambda n, p: not moe.is_expert_param(n) and getattr(p, "tensor_model_parallel", False))
        if tp_group is not None:
            dist.all_reduce(sharded, group=tp_group)
        experts = squares(lambda n, p: moe.is_expert_param(n))
        if self.config.ep > 1:
            dist.all_reduce(experts, group=ps.get_expert_model_parallel_group())
        replicated = squares(lambda n, p: not moe.is_expert_param(n) and not getattr(p, "tensor_model_parallel", False))
        # the last stage's copy of a tied embedding is marked `shared`: its sharded square is taken out again
        copy = squares(lambda n, p: getattr(p, "shared", False) and getattr(p, "tensor_model_parallel", False))
        if tp_group is not None:
            dist.all_reduce(copy, group=tp_group)
        total = sharded + experts + replicated - copy
        if self.pp > 1:
            dist.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
        grad_norm = float(total.sqrt())
        if not math.isfinite(grad_norm):
            return grad_norm
        scale = self.config.max_grad_norm / (grad_norm + 1e-6)
        if scale < 1.0:
            for _, p in named:
                p.grad.mul_(scale)
        optimizer.step()
        return grad_norm

    def _training_mode(self) -> None:
        # megatron recomputes activations and applies the routers' load-balancing loss only in training mode
        from slime_env.trainers.megatron.model import training_features_on

        training_features_on(self.model)
        if self.critic is not None:
            training_features_on(self.critic)

    def _backward(self, loss: torch.Tensor, share: float) -> None:
        if self.moe:  # the routers' load-balancing losses add their gradient with the micro-batch's share too
            from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

            MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(share, device=self.device))
        super()._backward(loss, share)

    def _split_share(self) -> float:
        # the DP replicas back the same data and their gradients are summed (TP / CP ranks hold shares, not copies)
        return 1.0 / self.dp

    _STATS = TorchTrainer._STATS + ("value_loss",)

    def _reduce_stats(self, stats: dict[str, float]) -> dict[str, float]:
        if self.dp == 1:
            return stats
        from megatron.core import parallel_state as ps

        return self._sum_stats(stats, ps.get_data_parallel_group())

    # --- checkpoints and weight sync ------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """`path/model` (HF safetensors + config.json) or, with LoRA, `path/adapter` (the adapter alone, PEFT's
        format), optimizer state and step; every rank must call it."""
        self.onload()
        path = Path(path)
        rank = dist.get_rank()
        if self.lora is not None:
            adapter = self.adapter()
            if rank == 0:
                adapter.save(path / "adapter")
        else:
            self.save_weights(path / "model")
        if rank == 0:
            (path / "config.json").write_text(json.dumps(asdict(self.config)))
        if dist.get_world_size() > 1:
            dist.barrier()
        saved: dict[str, Any] = {"optimizer": _optimizer_shards(self.optimizer, self.ddp), "step": self.step_count}
        if self.critic is not None:  # PPO: the critic's weights (this rank's shards) and optimizer too
            saved["critic"] = {k: v.detach().to("cpu", copy=True) for k, v in self.critic.named_parameters()}
            saved["critic_optimizer"] = _optimizer_shards(self.critic_optimizer, self.critic_ddp)
        torch.save(saved, path / f"trainer_rank{rank}.pt")
        return path

    def load(self, path: str | Path, *, optimizer: bool = True) -> None:
        """Weights from `path/model` (HF safetensors: ours, or any of this architecture) or, with LoRA, the adapter
        of `path/adapter` (or of the PEFT folder `path`), then, when `optimizer`, the optimizer state and step when
        `path` holds them."""
        path = Path(path)
        if self.lora is not None:
            from slime_env.agents.lora_adapter import LoRAAdapter
            from slime_env.trainers.lora import adapter_folder

            folder = adapter_folder(path)
            if folder is None:
                raise FileNotFoundError(f"{path}: a LoRA trainer resumes from an adapter checkpoint (adapter/ in "
                                        "PEFT's format); this one holds none")
            self._load_adapter_tensors(LoRAAdapter.load(folder).tensors)
        else:
            self._load_mcore(self._from_hf(read_hf_weights(path)))
        if self.ddp is not None:
            self.optimizer.reload_model_params()  # fp32 master weights from the loaded parameters
        state = path / f"trainer_rank{dist.get_rank()}.pt"
        if optimizer and state.exists():
            saved = torch.load(state, map_location="cpu", weights_only=False)
            _restore_optimizer(self.optimizer, self.ddp, saved["optimizer"], state)
            if self.critic is not None and "critic" in saved:
                _copy_params(self.critic, saved["critic"])
                if self.critic_ddp is not None:
                    self.critic_optimizer.reload_model_params()
                _restore_optimizer(self.critic_optimizer, self.critic_ddp, saved["critic_optimizer"], state)
            self.step_count = int(saved["step"])

    @property
    def pushes(self) -> bool:
        return dist.get_rank() == 0  # every rank gathers the weights in `sync`; rank 0 pushes them

    def weight_layout(self) -> Any:
        from slime_env.agents.weight_layout import WeightLayout

        return WeightLayout.of(self.hf_config)

    def weights(self) -> dict[str, torch.Tensor]:
        """The current weights with Hugging Face names (gathered across TP: every rank calls it); with LoRA, the base
        weights with the adapter merged in."""
        hf = self.hf_state_dict()
        if self.lora is not None:
            for k, d in self.adapter().deltas().items():
                hf[k] = (hf[k].float() + d.to(hf[k].device)).to(hf[k].dtype)
        return hf

    def save_weights(self, path: str | Path) -> Path:
        """Only the HF model folder (safetensors + config.json) — what an engine loads, in the layout every weight
        channel sends (experts one matrix each, as Hugging Face, SGLang and vLLM read them; with LoRA the merged
        weights). Every rank calls it."""
        hf = self.weights()
        if dist.get_rank() == 0:
            self.weight_layout().save_folder(path, hf)
        return Path(path)


def _gather(local: dict[str, torch.Tensor], size: int, group: Any) -> list[dict[str, torch.Tensor]]:
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


def _inner(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a megatron optimizer (a chain of one per parameter kind)."""
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]


def _zero(ddp: Any, optimizer: Any) -> None:
    if ddp is not None:
        ddp.zero_grad_buffer()
    optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def _copy_params(module: torch.nn.Module, state: Mapping[str, torch.Tensor],
                 which: Callable[[str], bool] = lambda name: True) -> None:
    """Copy `state` into `module`'s parameters by name; every parameter `which` names must be there."""
    params = {k: p for k, p in module.named_parameters() if which(k)}
    missing = [k for k in params if k not in state]
    if missing:
        raise KeyError(f"megatron weights lack {missing[:4]}")
    for name, p in params.items():
        p.copy_(state[name])


def _optimizer_shards(optimizer: Any, ddp: Any) -> list[dict[str, Any]]:
    """This rank's shard of an optimizer: the torch state (moments, step) and the fp32 master weights it updates.
    A resume must use the same TP x DP layout (checked by `_restore_optimizer`)."""
    inner = [optimizer] if ddp is None else _inner(optimizer)
    return [{"state": o.state_dict(), "master": [p.detach().to("cpu", copy=True) for g in o.param_groups
                                                 for p in g["params"]]} for o in inner]


@torch.no_grad()
def _restore_optimizer(optimizer: Any, ddp: Any, shards: list[dict[str, Any]], where: Path) -> None:
    inner = [optimizer] if ddp is None else _inner(optimizer)
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
