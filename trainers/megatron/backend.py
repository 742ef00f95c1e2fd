"""`MegatronBackend`: the RL step's `Backend` (`slime_env.trainers.step`) on megatron-core — packed THD micro-batches
(`packing`), TP x CP x PP x DP and EP, MoE, LoRA, megatron's optimizer (`optimizer`), weights in HF names
(`weights`). `MegatronTrainer` (`slime_env.trainers.megatron_trainer`, whose docstring says what differs from the
torch backend) composes it with the step.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
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
from slime_env.trainers.megatron import optimizer as optim
from slime_env.trainers.megatron import weights as hf_weights
from slime_env.trainers.megatron.logprobs import head_chunk_tokens
from slime_env.trainers.megatron.packing import Packed, Packer
from slime_env.trainers.step import MicroLoss, frozen_logprobs, sum_stats
from slime_env.trainers.torch_trainer import TrainerConfig, read_hf_weights


class MegatronBackend:
    """The `Backend` of a Hugging Face Llama / Qwen2 / Qwen3 / Qwen3-MoE model trained as a megatron `GPTModel`.

    `hf_model` gives the architecture and the initial weights (any device; it is not kept). Run one process
    per GPU under `torchrun` for TP x CP x PP x DP (`config.tp`, `config.cp`, `config.pp`; MoE: `config.ep`); every
    rank must call `step` with the same trajectories.
    Besides the `Backend` Protocol: `offload()` / `onload()`, `hf_state_dict()` (the weights with HF names).
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
        self.stage = dict(offset=self.pp_rank * (self.hf_config.num_hidden_layers // c.pp),
                          layers=self.hf_config.num_hidden_layers // c.pp, first=self.pp_rank == 0,
                          last=self.pp_rank == c.pp - 1,
                          tied=bool(getattr(self.hf_config, "tie_word_embeddings", False)))
        self.moe = moe.is_moe(self.hf_config)
        # Expert parallel: the ranks of an EP group exchange tokens in every MoE layer, so they run the same number
        # of forward and backward passes; megatron's all-gather dispatcher also needs equal token counts.
        self._lockstep = self.moe and c.ep > 1
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
        self.packer = Packer(pad_id=pad_id, cp=c.cp, cp_rank=self.cp_rank, tp=c.tp,
                             sequence_parallel=c.sequence_parallel, device=self.device)
        hf_state = {k: v.detach().to("cpu") for k, v in hf_model.state_dict().items()}
        hf_weights.load_mcore(self, hf_weights.from_hf(self, hf_state))
        if self.lora is not None:
            self._init_adapter()
        # the KL reference: with LoRA the model itself with its adapters off (`reference_logprobs`)
        self.ref_model = (hf_weights.RefWeights(hf_weights.mcore_state(self)) if c.kl_coef > 0 and self.lora is None
                          else None)
        self.critic = self.critic_ddp = None
        if c.estimator == "ppo":
            self._init_critic(hf_state)
        del hf_state
        self.ddp, self.optimizer = optim.build(self, self.model, c.lr)
        self.role_baselines = alg.RoleBaselines(c.rae_decay) if c.estimator == "rae" else None
        self.step_count = 0
        self._offloaded = False
        self.routing_shape = self._routing_shape() if c.routing_replay == "rollout" else None

    def _init_adapter(self) -> None:
        """A fresh adapter from one seed (rank 0's), the same in every parallel layout; the base frozen."""
        from slime_env.trainers.megatron.lora import freeze_base, initial_adapter, inputs_need_grad

        seed = torch.randint(0, 2**31 - 1, (1,)).to(self.device)  # NCCL broadcasts device tensors only
        dist.broadcast(seed, src=0)
        hf_weights.load_adapter_tensors(self, initial_adapter(self.lora, self.hf_config, int(seed)))
        freeze_base(self.model)
        if self.config.recompute != "none":
            inputs_need_grad(self.model)

    def _init_critic(self, hf_state: dict[str, torch.Tensor]) -> None:
        """PPO's critic: this architecture without the LM head, a value head on top, and its optimizer."""
        from slime_env.trainers.megatron.value import MegatronValueModel

        c = self.config
        self.critic = MegatronValueModel(self.hf_config, tp=c.tp, dtype=self.dtype, grouped_experts=self.grouped,
                                         **self._options)
        mc = hf_weights.from_hf(self, hf_state)
        mc = {f"gpt.{k}": v for k, v in mc.items()} | {"norm.weight": mc["decoder.final_layernorm.weight"]}
        optim.copy_params(self.critic, mc | {f"head.{k}": v for k, v in self.critic.head.state_dict().items()})
        self.critic_ddp, self.critic_optimizer = optim.build(self, self.critic, c.critic_lr)

    def _routing_shape(self) -> tuple[int, int, int]:
        """MoE routing replay (slime_env.trainers.routing_replay): (layers, top_k, experts); refused by name where
        it does not run."""
        c, h = self.config, self.hf_config
        if not self.moe:
            raise InvalidInput(f"routing_replay: {h.model_type} is not a MoE model; set trainer.routing_replay: off")
        if c.cp > 1 or c.pp > 1 or (c.sequence_parallel and c.tp > 1):
            raise ValueError("routing_replay: rollout runs with TP (without sequence parallel), EP and DP; context "
                             "parallel, pipeline parallel and sequence parallel are not supported yet")
        return (h.num_hidden_layers, h.num_experts_per_tok, h.num_experts)

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

    def prepare(self, trajectories: Sequence[Trajectory]) -> None:
        """Refuse images by name; bring back what `offload` released."""
        if any(t.vision is not None for t in trajectories):
            raise ValueError("MegatronTrainer: trajectories hold images (Trajectory.vision), which this megatron-core "
                             "backend does not train: use trainer.backend torch or fsdp (docs/vlm.md)")
        self.onload()

    def finish(self) -> None:
        """With `offload: true`, every step ends with `offload`."""
        if self.config.offload:
            self.offload()

    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's live parameter groups."""
        # megatron's distributed optimizer steps the torch optimizers inside it: their groups hold the live `lr`
        return [g for inner in optim.inner_optimizers(self.optimizer) for g in inner.param_groups] if self.cuda \
            else list(self.optimizer.param_groups)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Current weights with Hugging Face names, gathered across TP, EP and PP (a collective)."""
        return hf_weights.hf_state_dict(self)

    def adapter(self) -> Any:
        """The current LoRA adapter (`LoRAAdapter`, PEFT's names), gathered across TP and PP: every rank calls it."""
        return hf_weights.adapter(self)

    def reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """The reference weights' log-probs (swapped in), or with LoRA the model's with its adapters off."""
        if self.lora is None:
            return self.frozen_logprobs(self.ref_model, batch)
        from slime_env.trainers.megatron.lora import adapters_off

        with adapters_off(self.model):  # the base model: no second copy of the weights
            return self.frozen_logprobs(self.model, batch)

    @contextlib.contextmanager
    def _swapped(self, ref: hf_weights.RefWeights) -> Iterator[None]:
        """The reference weights in the model for the duration; the trained ones back afterwards, bit for bit."""
        params = dict(self.model.named_parameters())
        saved = {k: p.detach().to("cpu", copy=True) for k, p in params.items()}
        hf_weights.load_mcore(self, ref.state)
        try:
            yield
        finally:
            hf_weights.load_mcore(self, saved)

    # --- log-probs over packed sequences -------------------------------------------------------------------
    def logprobs(self, model: Any, batch: TrainBatch, *, with_entropy: bool = False):
        """Log-probs (and entropies) aligned with `batch.input_ids` [B, L], set where the loss mask is set.

        The rows are packed (THD); the logits at packed index j - 1 score token j."""
        if self.pp > 1:  # no gradient through a pipeline outside the schedule: `_update` runs the gradient passes
            with torch.no_grad():
                out = self._pipelined_logprobs(batch, [slice(0, batch.size)], with_entropy=with_entropy)
            return out if with_entropy else out[0]
        p = self.packer.packed(batch)
        if p is None:
            self._idle_forward()
            zeros = self.packer.scatter(batch, None, None)
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

    def _replay_routes(self, batch: TrainBatch, p: Packed) -> None:
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

    def _scored_logprobs(self, batch: TrainBatch, p: Packed, logits: torch.Tensor, with_entropy: bool,
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

        return [self.packer.scatter(batch, p.need, x) for x in self.packer.at_scored(p, logits, score)]

    def datum_logprobs(self, data: Sequence[Datum]) -> list[torch.Tensor]:
        """The split step's log-probs (`SplitStep.forward` / `forward_backward` call this): the data packed (THD),
        the logit at each datum's position p scoring its `targets[p]`. No pipeline: its schedule owns the backward."""
        if self.pp > 1:
            raise ValueError("forward / forward_backward (the split step) run without pipeline parallel (pp: 1)")
        lengths = [len(d.tokens) for d in data]
        ids, params, (where, local_row, _) = self.packer.layout(torch.cat([d.tokens for d in data]),
                                                           torch.tensor([0, *itertools.accumulate(lengths)],
                                                                        dtype=torch.int32))
        need = torch.arange(sum(lengths))
        src = where if local_row is None else local_row[where]  # a datum's own position scores its target
        p = Packed(ids, params, need.to(self.device), src.to(self.device),
                    torch.cat([d.targets for d in data]).to(self.device))
        forward = self.ddp if self.ddp is not None else self.model
        logits = forward(input_ids=p.ids, position_ids=None, attention_mask=None, packed_seq_params=p.params)[0]
        from slime_env.trainers.megatron import vocab_parallel_logprobs

        (logp,) = self.packer.at_scored(p, logits, lambda rows, targets: (vocab_parallel_logprobs(rows, targets),))
        return list(logp.float().split(lengths))

    # --- pipeline parallel -----------------------------------------------------------------------------------
    def _pipeline(self, micros: Sequence[TrainBatch], on_logits: Callable[[int, Packed, torch.Tensor], Any], *,
                  train: bool) -> None:
        """`micros` through megatron's pipeline schedule (1F1B; forward only unless `train`), every stage of this
        DP rank taking part. On the last stage `on_logits(i, packed, logits)` handles micro-batch i and returns the
        scalar to backpropagate (the schedule runs each micro-batch's backward as soon as 1F1B allows). A
        micro-batch without loss tokens still flows through every stage, as a pad sequence with zero loss."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        fixed = not self.model.config.variable_seq_lengths
        if fixed:  # one activation shape for the whole schedule: every micro-batch padded to the longest
            totals = [sum(self.packer.model_lengths(m.attention_mask.sum(-1).tolist())) for m in micros]
            # under EP lockstep `_micro_slices` has just set the common count of all EP ranks' micro-batches
            self.packer.min_tokens = max([1, self.packer.min_tokens if self._gathers_tokens else 0] + totals)
        packed = [self.packer.packed(m) for m in micros]
        seq_length = self.packer.padded_total(1) if fixed else 1  # the padded global length
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

        def on_logits(i: int, p: Packed, logits: torch.Tensor):
            for out, x in zip(outs, self._scored_logprobs(micros[i], p, logits, with_entropy)):
                out[slices[i]] = x.cpu()
            return torch.zeros((), device=self.device)

        self._pipeline(micros, on_logits, train=False)
        return [self._from_last_stage(o) for o in outs]

    @property
    def pipelined(self) -> bool:
        """Under pipeline parallel the gradient passes run in megatron's schedule (`pipeline_passes`)."""
        return self.pp > 1

    def update_context(self) -> Any:
        """`recompute_attention: false`: attention outputs kept through recompute, dropped after the update."""
        from slime_env.trainers.megatron.attention import keeping

        return keeping(self.model)

    def pipeline_passes(self, mini: TrainBatch, slices: list[slice], loss_of: MicroLoss,
                        stats: dict[str, float]) -> dict[str, float]:
        """`mini`'s micro-batches `slices` on the 1F1B schedule, each backing `loss * share`; the last stage's
        `stats` on every stage."""
        micros = [mini.rows(s).trimmed() for s in slices]

        def on_logits(i: int, p: Packed, logits: torch.Tensor) -> torch.Tensor:
            logp, entropy = self._scored_logprobs(micros[i], p, logits, True)
            loss, share = loss_of(micros[i], slices[i], logp, entropy)
            return loss * share

        self._pipeline(micros, on_logits, train=True)
        return self._from_last_stage(stats)

    def values(self, batch: TrainBatch) -> torch.Tensor:
        """The critic's [B, L] values (the state before each loss-masked token), from packed rows."""
        p = self.packer.packed(batch)
        if p is None:
            if self._lockstep:
                with torch.no_grad():
                    self.critic(*self._dummy())
            return self.packer.scatter(batch, None, None)
        forward = self.critic_ddp if self.critic_ddp is not None else self.critic
        hidden = forward(p.ids, p.params)
        values = self.packer.at_scored(p, hidden, lambda rows, _: (self.critic.values(rows),))[0]
        return self.packer.scatter(batch, p.need, values)

    def _dummy(self) -> tuple[torch.Tensor, Any]:
        """(ids [1, T'], THD params) of one sequence of pad ids: the forward an idle rank runs."""
        ids, params, _ = self.packer.layout(torch.full((1,), self.pad_id, dtype=torch.long),
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

    def idle_micro_batch(self) -> None:
        """Expert parallel: a zero-weighted pass, so the EP group's token exchanges match."""
        if not self._lockstep:
            return
        ids, packed = self._dummy()
        forward = self.ddp if self.ddp is not None else self.model
        if self.moe:
            from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

            MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(0.0, device=self.device))
        logits = forward(input_ids=ids, position_ids=None, attention_mask=None, packed_seq_params=packed)
        (logits.float().sum() * 0.0).backward()

    @torch.no_grad()
    def frozen_logprobs(self, model: Any, batch: TrainBatch) -> torch.Tensor:
        """`model`'s (or the swapped-in reference weights') log-probs of every row, no gradient."""
        if isinstance(model, hf_weights.RefWeights):
            with self._swapped(model):
                return self.frozen_logprobs(self.model, batch)
        if self.pp > 1:
            self.model.eval()
            return self._pipelined_logprobs(batch, self.micro_slices(batch))[0]
        return frozen_logprobs(self, model, batch)

    # --- this rank's rows, gradients, optimizer -------------------------------------------------------------
    def micro_slices(self, batch: TrainBatch) -> list[slice]:
        """This DP rank's micro-batches. Under expert parallelism every rank gets as many (empty ones appended:
        a rank without rows runs an idle pass) and, with the all-gather dispatcher, a common token count."""
        lengths = batch.attention_mask.sum(-1).tolist()
        budget = self.config.max_tokens_per_micro_batch
        per_rank = [token_budget_slices(lengths, a, b, budget) for a, b in balanced_ranges(lengths, self.dp)]
        if not self._lockstep:
            return per_rank[self.dp_rank]
        if self._gathers_tokens:
            lengths = self.packer.model_lengths(lengths)  # the token counts the model sees
            self.packer.min_tokens = max([sum(lengths[s]) for slices in per_rank for s in slices] or [1])
        return lockstep(per_rank, self.dp_rank)

    def zero_grad(self) -> None:
        optim.zero(self.ddp, self.optimizer)

    def optimizer_step(self) -> float:
        """Megatron's optimizer (or AdamW on CPU) after the gradients are summed over ranks; the gradient norm."""
        return optim.step(self, self.model, self.ddp, self.optimizer)

    def critic_step(self) -> float:
        """The critic's optimizer step; its gradient norm."""
        grad_norm = optim.step(self, self.critic, self.critic_ddp, self.critic_optimizer)
        optim.zero(self.critic_ddp, self.critic_optimizer)
        return grad_norm

    def all_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Rows computed by other DP ranks filled in."""
        if self.dp == 1:
            return x
        from megatron.core import parallel_state as ps

        y = x.to(self.device)
        dist.all_reduce(y, group=ps.get_data_parallel_group())  # each row was computed by exactly one DP rank
        return y.to(x.device)

    def train_mode(self) -> None:
        """Training mode (megatron's recompute and load-balancing loss)."""
        # megatron recomputes activations and applies the routers' load-balancing loss only in training mode
        from slime_env.trainers.megatron.model import training_features_on

        training_features_on(self.model)
        if self.critic is not None:
            training_features_on(self.critic)

    def backward(self, loss: torch.Tensor, share: float) -> None:
        """Backward of `loss * share` (MoE: the routers' auxiliary losses at the same share)."""
        if self.moe:  # the routers' load-balancing losses add their gradient with the micro-batch's share too
            from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

            MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(share, device=self.device))
        (loss * share).backward()

    def split_share(self) -> float:
        """The inverse DP size."""
        # the DP replicas back the same data and their gradients are summed (TP / CP ranks hold shares, not copies)
        return 1.0 / self.dp

    def reduce_stats(self, stats: dict[str, float]) -> dict[str, float]:
        """The statistics summed over the DP ranks."""
        if self.dp == 1:
            return stats
        from megatron.core import parallel_state as ps

        return sum_stats(self.config, stats, ps.get_data_parallel_group(), self.device, extra=("value_loss",))

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
        saved: dict[str, Any] = {"optimizer": optim.optimizer_shards(self.optimizer, self.ddp), "step": self.step_count}
        if self.critic is not None:  # PPO: the critic's weights (this rank's shards) and optimizer too
            saved["critic"] = {k: v.detach().to("cpu", copy=True) for k, v in self.critic.named_parameters()}
            saved["critic_optimizer"] = optim.optimizer_shards(self.critic_optimizer, self.critic_ddp)
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
            hf_weights.load_adapter_tensors(self, LoRAAdapter.load(folder).tensors)
        else:
            hf_weights.load_mcore(self, hf_weights.from_hf(self, read_hf_weights(path)))
        if self.ddp is not None:
            self.optimizer.reload_model_params()  # fp32 master weights from the loaded parameters
        state = path / f"trainer_rank{dist.get_rank()}.pt"
        if optimizer and state.exists():
            saved = torch.load(state, map_location="cpu", weights_only=False)
            optim.restore_optimizer(self.optimizer, self.ddp, saved["optimizer"], state)
            if self.critic is not None and "critic" in saved:
                optim.copy_params(self.critic, saved["critic"])
                if self.critic_ddp is not None:
                    self.critic_optimizer.reload_model_params()
                optim.restore_optimizer(self.critic_optimizer, self.critic_ddp, saved["critic_optimizer"], state)
            self.step_count = int(saved["step"])

    @property
    def pushes(self) -> bool:
        """Rank 0."""
        return dist.get_rank() == 0  # every rank gathers the weights in `sync`; rank 0 pushes them

    def weight_layout(self) -> Any:
        """The HF config's `WeightLayout`."""
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


