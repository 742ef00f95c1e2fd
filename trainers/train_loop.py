"""`slime-env train --config FILE.yaml`: dataset → rollout manager → TorchTrainer → weight sync → eval.

Each step: the rollout manager runs `prompts_per_step` groups of `n_samples_per_prompt` episodes with the
current weights, the trainer makes its RL update, the new weights go to the engine. Every `eval_every`
steps (and before the first and after the last) the held-out split is run greedily and scored. Written
to `run_dir`: `metrics.jsonl` (one line per step), TensorBoard event files, `curves.png` (train reward
and held-out accuracy), checkpoints every `save_every` steps (resumed from with `resume: true`). With `time_budget_s`, the run stops (after a final
evaluation) at the first step that ends past the budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from slime_env.trainers.engines import EngineConfig, Engines, resolve_model_path
from slime_env.trainers.evaluation import eval_sets, evaluate, evaluate_set
from slime_env.trainers.placement import ClusterConfig, Placement, make_trainer  # noqa: F401 - make_trainer re-exported
from slime_env.trainers.torch_trainer import TrainerConfig

from slime_env import Task
from slime_env.errors import InvalidInput
from slime_env.rollout.metrics import tool_metrics


@dataclass
class TrainConfig:
    """The whole run; every field can be set in the YAML file (see docs/trainers.md)."""

    run_dir: str = "runs/demo"
    model: str = "default"
    env: str = "ReasoningGym-v0"
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    train_data: dict[str, Any] = field(default_factory=dict)
    eval_data: dict[str, Any] = field(default_factory=dict)
    steps: int = 10
    prompts_per_step: int = 8
    n_samples_per_prompt: int = 4
    max_turns: int = 1
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    # Each turn samples with a seed drawn from (the run's seed, the episode, the turn): rollouts repeat exactly on
    # any engine that honours `sampling_seed` (ours, SGLang, vLLM), e.g. to compare two placements of one run.
    seed_sampling: bool = False
    max_concurrency: int = 64
    eval_every: int = 5
    eval_max_new_tokens: int | None = None
    save_every: int = 0
    time_budget_s: float | None = None
    resume: bool = False
    seed: int = 0
    device: str = "auto"
    engine_dtype: str = "auto"
    trainer: dict[str, Any] = field(default_factory=dict)
    # Groups per step written to samples.jsonl (the report shows the first and last steps' in the viewer).
    sample_groups: int = 4
    # Multi-agent envs: whose trajectories train (None: every agent's, e.g. both seats in self-play), and
    # the env kwargs of the evaluation episodes (e.g. a fixed bot in one seat: win rate against it).
    train_agents: list[str] | None = None
    eval_env_kwargs: dict[str, Any] | None = None
    # League self-play: the seats in `agents` are played by frozen snapshots of the trained policy taken
    # every `every` steps (the initial policy first), `size` kept, the live policy with probability `latest_p`.
    opponent_pool: dict[str, Any] | None = None
    # The engines (slime_env.trainers.engines: embedded, serve, sglang, openai; the weight-sync channel) and where the roles run
    # (slime_env.trainers.placement: this process, or Ray).
    engine: dict[str, Any] = field(default_factory=dict)
    cluster: dict[str, Any] = field(default_factory=dict)
    # Asynchronous training (slime_env.trainers.asynchrony; the YAML key is `async`): mode off | overlap | full, max_staleness,
    # in_flight, interrupt.
    async_: dict[str, Any] = field(default_factory=dict)
    # SFT warm-up before RL (slime_env.trainers.warmup: steps, lr, batch_size, data: conversations or teacher rollouts).
    warmup: dict[str, Any] = field(default_factory=dict)
    # On-policy distillation's teacher (slime_env.trainers.teacher: {url} of an engine server or {model} loaded here); its
    # weight in the loss is trainer.opd_coef.
    teacher: dict[str, Any] = field(default_factory=dict)
    # A learned reward (slime_env.trainers.reward_models: a classifier RM, slime's remote_rm protocol, or an LLM judge) combined
    # with the env's: env_weight * env reward + weight * score.
    reward: dict[str, Any] = field(default_factory=dict)
    # Named eval sets beside the held-out split (slime_env.trainers.evaluation: several samples per task, pass@k, maj@k).
    eval: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> TrainConfig:
        """The run config in a YAML file, with top-level `overrides` (e.g. `env=`) applied before it is checked."""
        import yaml

        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise InvalidInput(f"config file {path} does not exist") from None
        except yaml.YAMLError as e:
            raise InvalidInput(f"{path}: not valid YAML: {e}") from None
        if not isinstance(raw, Mapping):
            raise InvalidInput(f"{path}: expected a mapping of run settings, got {type(raw).__name__}")
        return cls.from_dict({**raw, **overrides}, str(path))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], where: str = "config") -> TrainConfig:
        if not isinstance(raw, Mapping):
            raise InvalidInput(f"{where}: expected a mapping at the top level")
        raw = dict(raw)
        if "async" in raw:  # `async` is a Python keyword: the field is `async_`
            raw["async_"] = raw.pop("async")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise InvalidInput(f"{where}: unknown field(s) {[u.rstrip('_') for u in unknown]}; known: "
                               f"{sorted(k.rstrip('_') for k in known)}")
        cfg = cls(**raw)
        try:
            TrainerConfig(**cfg.trainer)
        except TypeError as e:
            raise InvalidInput(f"{where}: trainer: {e}") from None
        except ValueError as e:
            raise InvalidInput(f"{where}: trainer: {e}") from None
        pool = cfg.opponent_pool
        if pool is not None:
            unknown_keys = sorted(set(pool) - {"agents", "every", "size", "latest_p"})
            if unknown_keys or not pool.get("agents"):
                raise InvalidInput(f"{where}: opponent_pool needs 'agents' (the seats it plays) and takes 'every', "
                                   f"'size', 'latest_p'; got {sorted(pool)}")
        for name in ("steps", "prompts_per_step", "n_samples_per_prompt", "max_turns", "max_new_tokens"):
            if getattr(cfg, name) < 1:
                raise InvalidInput(f"{where}: {name} must be >= 1, got {getattr(cfg, name)}")
        from slime_env.trainers.engines import EngineConfig
        from slime_env.trainers.placement import ClusterConfig

        engine = EngineConfig.from_dict(cfg.engine, f"{where}: engine")
        cluster = ClusterConfig.from_dict(cfg.cluster, f"{where}: cluster")
        cluster.check(engine, TrainerConfig(**cfg.trainer), where)
        if cfg.opponent_pool and engine.kind != "embedded":
            raise InvalidInput(f"{where}: opponent_pool snapshots the embedded engine's model; it needs engine.kind "
                               f"embedded, not {engine.kind!r}")
        from slime_env.trainers.asynchrony import AsyncConfig

        asynchrony = AsyncConfig.from_dict(cfg.async_, f"{where}: async")
        if asynchrony.mode != "off" and TrainerConfig(**cfg.trainer).offload and engine.kind == "embedded":
            raise InvalidInput(f"{where}: trainer.offload frees the embedded engine's memory while the trainer runs; "
                               f"async mode {asynchrony.mode!r} generates meanwhile: use one or the other")
        if asynchrony.mode == "full" and asynchrony.in_flight < cfg.n_samples_per_prompt:
            raise InvalidInput(f"{where}: async.in_flight ({asynchrony.in_flight}) cannot hold one group of "
                               f"n_samples_per_prompt={cfg.n_samples_per_prompt}")
        _check_learning_sections(cfg, where)
        if engine.kind == "openai":
            raise InvalidInput(f"{where}: engine.kind openai serves a frozen policy (no weight-update route): it "
                               "can evaluate, not train; use kind: sglang or serve")
        return cfg


def _check_learning_sections(cfg: TrainConfig, where: str) -> None:
    """The warmup, eval, teacher and reward sections, checked by field before anything starts."""
    from slime_env.trainers.warmup import WarmupConfig

    WarmupConfig.from_dict(cfg.warmup, f"{where}: warmup")
    for s in eval_sets(cfg.eval, f"{where}: eval")[0]:
        if s.env is not None:
            from slime_env.registry import spec as env_spec

            try:
                env_spec(s.env)
            except Exception as e:  # noqa: BLE001 - an unknown env id is a config error, named here
                raise InvalidInput(f"{where}: eval.sets.{s.name}.env: {e}") from None
    opd = TrainerConfig(**cfg.trainer).opd_coef > 0
    if opd != bool(cfg.teacher):
        raise InvalidInput(f"{where}: on-policy distillation needs both trainer.opd_coef > 0 and a teacher "
                           f"section; got opd_coef={TrainerConfig(**cfg.trainer).opd_coef}, "
                           f"teacher={cfg.teacher or None}")
    if cfg.teacher:
        from slime_env.trainers.teacher import check_spec

        check_spec(cfg.teacher, f"{where}: teacher")
    if cfg.reward:
        from slime_env.trainers import reward_models

        reward_models.check_spec(cfg.reward, f"{where}: reward")


def trainer_config(cfg: TrainConfig) -> TrainerConfig:
    """The run's `TrainerConfig`; `off_policy: auto` becomes token-level TIS when the run is asynchronous."""
    from slime_env.trainers.asynchrony import AsyncConfig

    tc = TrainerConfig(**cfg.trainer)
    if tc.off_policy == "auto" and not tc.legacy_tis and AsyncConfig.from_dict(cfg.async_).mode != "off":
        tc.off_policy = "tis"
    return tc


def load_split(spec: Mapping[str, Any], where: str) -> list[Task]:
    """`{"path": file}` (JSONL/Parquet via load_tasks), `{"reasoning_gym": {dataset, size, seed, config}}`, or
    `{"generator": "package.module:function", **kwargs}` (a function returning tasks, e.g.
    `slime_env.envs.math.retry_env:arithmetic_tasks`)."""
    if "generator" in spec:
        from slime_env.loading import load_object

        fn = load_object(spec["generator"])
        return [Task.coerce(t, f"{where}[{i}]") for i, t in
                enumerate(fn(**{k: v for k, v in spec.items() if k != "generator"}))]
    if "path" in spec:
        from slime_env import load_tasks

        return load_tasks(spec["path"], **{k: v for k, v in spec.items() if k != "path"})
    if "reasoning_gym" in spec:
        from slime_env.envs.math.reasoning_gym_env import reasoning_gym_tasks

        rg = dict(spec["reasoning_gym"])
        return reasoning_gym_tasks(rg.pop("dataset"), rg.pop("size", 100), rg.pop("seed", 0), rg.pop("config", {}))
    raise InvalidInput(f"{where}: give 'path', 'reasoning_gym' or 'generator'")


def plot_curves(rows: list[dict[str, Any]], path: Path, title: str,
                eval_label: str = "held-out accuracy (greedy)") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in rows if "train/reward_mean" in r]
    ax.plot(steps, [r["train/reward_mean"] for r in rows if "train/reward_mean" in r], label="train reward (mean)",
            color="tab:blue", alpha=0.7)
    ev = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    if ev:
        ax.plot([s for s, _ in ev], [a for _, a in ev], marker="o", label=eval_label,
                color="tab:red")
    ax.set_xlabel("step")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


async def train(cfg: TrainConfig, *, log: Callable[[str], None] = print,
                on_step: Callable[[int, Any, Any], Any] | None = None, sft_only: bool = False) -> dict[str, Any]:
    """Run the configured training; returns the summary (first / last held-out accuracy, paths). `on_step(step,
    engines, trainer)` (may be async) is called after each step's weight sync, e.g. to inspect the engines.
    `sft_only` (`slime-env sft`): the warm-up alone, evaluated before and after, its model saved as an HF folder."""
    import torch

    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    run = Path(cfg.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.json").write_text(json.dumps(cfg.__dict__, indent=1, default=str))
    train_tasks = load_split(cfg.train_data, "train_data")
    evals = Evals(cfg, load_split(cfg.eval_data, "eval_data") if cfg.eval_data else [], *eval_sets(cfg.eval))
    for s in evals.sets:
        s.tasks = load_split(s.data, f"eval.sets.{s.name}.data")
    # The three roles: engines (embedded or servers), the trainer group (this process or Ray actors) and, below, the
    # rollout manager between them; weights go trainer -> engines through one channel.
    engine_cfg = EngineConfig.from_dict(cfg.engine)
    model = cfg.model if engine_cfg.kind == "embedded" else resolve_model_path(cfg.model)
    # Everything acquired below is given back in reverse order, however the run ends.
    async with contextlib.AsyncExitStack() as stack:
        placement = Placement(ClusterConfig.from_dict(cfg.cluster),
                              engines=engine_cfg.count if engine_cfg.kind == "serve" and not engine_cfg.urls else 0)
        stack.callback(placement.close)
        engines = Engines(engine_cfg, model_path=model, max_concurrency=cfg.max_concurrency, run_dir=run,
                          seed=cfg.seed, device=cfg.device, dtype=cfg.engine_dtype, spawn=placement.spawn_engine)
        stack.push_async_callback(engines.close)
        await engines.start()
        tok = engines.tokenizer
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        trainer = placement.trainer_group(trainer_config(cfg), engines, pad_id, cfg.device)
        stack.callback(trainer.close)
        channel = trainer.channel(engines)
        stack.push_async_callback(channel.close)
        teacher = None
        if cfg.teacher:
            from slime_env.trainers.teacher import make_teacher

            teacher = make_teacher(cfg.teacher)
            stack.push_async_callback(teacher.close)
            await teacher.check_tokenizer(tok)  # before any training: a mismatched teacher is a config error
        rm = None
        if cfg.reward:
            from slime_env.trainers.reward_models import make_reward_model

            from slime_env import get_renderer

            rm = make_reward_model(cfg.reward, policy=engines.policy, renderer=get_renderer(tok))
            stack.push_async_callback(rm.close)
        if sft_only:
            return await _sft_only(cfg, run, engines, trainer, channel, train_tasks, evals, log)
        return await _train(cfg, run, engines, trainer, channel, stack, train_tasks, evals, log, on_step,
                            _Scorers(rm, cfg.reward, teacher))


@dataclass
class _Scorers:
    """What scores a batch after its rollouts: a reward model (its score combined with the env's reward) and on-policy
    distillation's teacher (its log-probs of every sampled token). Each group's trajectories are replaced in place, so
    samples.jsonl and the trainer see the same rewards."""

    rm: Any = None
    reward: Mapping[str, Any] = field(default_factory=dict)
    teacher: Any = None

    async def __call__(self, groups: list[Any]) -> dict[str, float]:
        from slime_env.trainers.reward_models import apply_rewards
        from slime_env.trainers.teacher import annotate

        out: dict[str, float] = {}
        if self.rm is not None:
            t0 = time.perf_counter()
            for g, new in zip(groups, await asyncio.gather(*(apply_rewards(
                    self.rm, g.trajectories, weight=float(self.reward.get("weight", 1.0)),
                    env_weight=float(self.reward.get("env_weight", 1.0))) for g in groups))):
                g.trajectories = new
            scored = [t for g in groups for t in g.trajectories if "rm_score" in t.info]
            out.update({"time/reward_s": time.perf_counter() - t0, "reward/scored": float(len(scored)),
                        "reward/rm_score_mean": sum(t.info["rm_score"] for t in scored) / max(len(scored), 1),
                        "reward/env_reward_mean": sum(t.metadata["env_reward"] for t in scored) / max(len(scored), 1)})
        if self.teacher is not None:
            t0 = time.perf_counter()
            for g, new in zip(groups, await asyncio.gather(*(annotate(self.teacher, g.trajectories) for g in groups))):
                g.trajectories = new
            out["time/teacher_s"] = time.perf_counter() - t0
        return out


@dataclass
class Evals:
    """The run's evaluations: the held-out split (`eval/*`, every `eval_every` steps) and the named sets
    (`eval/<name>/*`, every `every` steps, default `eval_every`); all of them at step 0 and at the last step."""

    cfg: TrainConfig
    tasks: list[Task]
    sets: list[Any]
    every: int | None = None
    seconds: float = 0.0

    def __bool__(self) -> bool:
        return bool(self.tasks or self.sets)

    async def run(self, policy: Any, renderer: Any, step: int, final: bool = False) -> dict[str, float]:
        t0, out = time.perf_counter(), {}
        due = final or step == 0
        if self.tasks and (due or step % max(self.cfg.eval_every, 1) == 0):
            out.update(await evaluate(self.tasks, policy, renderer, self.cfg))
        for s in self.sets:
            if due or step % (self.every or max(self.cfg.eval_every, 1)) == 0:
                out.update(await evaluate_set(s, policy, renderer, self.cfg))
        self.seconds += time.perf_counter() - t0
        return out


async def _warmup(cfg: TrainConfig, run: Path, engines: Any, trainer: Any, channel: Any, train_tasks: list[Task],
                  log: Callable[[str], None]) -> dict[str, float]:
    """The SFT warm-up (slime_env.trainers.warmup), its weights pushed to the engines; returns its `warmup/*` metrics."""
    from slime_env.trainers.warmup import WarmupConfig, run_warmup, warmup_trajectories

    from slime_env import get_renderer

    wc = WarmupConfig.from_dict(cfg.warmup)
    t0 = time.perf_counter()
    ro = wc.data.get("rollouts") or {}
    tasks = load_split(ro["tasks"], "warmup.data.rollouts.tasks") if "tasks" in ro else train_tasks
    trajs, stats = await warmup_trajectories(wc, cfg, engines.policy, get_renderer(engines.tokenizer), tasks, log)
    rows = await run_warmup(wc, trainer, trajs, run, cfg.seed, log)
    await trainer.sync(channel, "0")  # still weight version 0: RL steps count from there
    engines.synced()
    return {**stats, "warmup/steps": float(len(rows)), "warmup/loss_first": rows[0].get("sft/loss", math.nan),
            "warmup/loss_last": rows[-1].get("sft/loss", math.nan), "warmup/s": time.perf_counter() - t0}


async def _sft_only(cfg: TrainConfig, run: Path, engines: Any, trainer: Any, channel: Any, train_tasks: list[Task],
                    evals: Evals, log: Callable[[str], None]) -> dict[str, Any]:
    from slime_env import get_renderer

    if not cfg.warmup:
        raise InvalidInput("slime-env sft needs a warmup section (steps, lr, batch_size, data)")
    renderer = get_renderer(engines.tokenizer)
    await trainer.sync(channel, "0")
    engines.synced()
    summary: dict[str, Any] = {"run_dir": str(run)}
    if evals:
        summary["before"] = await evals.run(engines.policy, renderer, 0)
        log(f"before SFT: {_eval_line(summary['before'])}")
    summary.update(await _warmup(cfg, run, engines, trainer, channel, train_tasks, log))
    if evals:
        summary["after"] = await evals.run(engines.policy, renderer, 0)
        log(f"after SFT: {_eval_line(summary['after'])}")
    where = run / "checkpoints" / "sft"
    trainer.save(where)
    engines.tokenizer.save_pretrained(str(where / "model"))  # a model folder `model:` and every engine can load
    summary["model"] = str(where / "model")
    (run / "summary.json").write_text(json.dumps(summary, indent=1))
    log(f"SFT model: {summary['model']}")
    return summary


async def _train(cfg: TrainConfig, run: Path, engines: Any, trainer: Any, channel: Any,
                 stack: contextlib.AsyncExitStack, train_tasks: list[Task], evals: Evals,
                 log: Callable[[str], None], on_step: Callable[[int, Any, Any], Any] | None,
                 scorers: _Scorers | None = None) -> dict[str, Any]:
    from slime_env.trainers.asynchrony import AsyncConfig, BusyMeter, make_source, staleness_metrics

    from slime_env import RolloutManager, get_renderer

    asynchrony = AsyncConfig.from_dict(cfg.async_)
    policy, tok = engines.policy, engines.tokenizer
    start = 0
    trained: list[int] = []  # full mode: the group indices trained on so far (a resumed run skips them)
    latest = run / "checkpoints" / "latest"
    metrics_path = run / "metrics.jsonl"
    samples_path = run / "samples.jsonl"
    if cfg.resume and latest.exists():
        ckpt = run / "checkpoints" / latest.read_text().strip()
        trainer.load(ckpt)
        start = trainer.step_count
        if (ckpt / "async_state.json").exists():
            trained = json.loads((ckpt / "async_state.json").read_text())["trained_groups"]
        _truncate_rows(metrics_path, start)  # steps after the checkpoint were rolled back with the weights
        log(f"resumed from {ckpt} (step {start})")
    await trainer.sync(channel, str(start))
    engines.synced()
    renderer = get_renderer(tok)
    writer = _tensorboard(run)
    if writer is not None:
        stack.callback(writer.close)
    per_step = cfg.prompts_per_step
    if asynchrony.mode == "full":  # groups finish out of order: index every group of the run, skip those trained
        total = (cfg.steps + asynchrony.max_staleness + 2) * per_step
        order = [train_tasks[i % len(train_tasks)] for i in range(total)]
    else:
        order = [train_tasks[i % len(train_tasks)] for i in range(start * per_step, (cfg.steps + 1) * per_step)]
    pool, opponent_for = None, None
    if cfg.opponent_pool:
        from slime_env.trainers.opponent_pool import OpponentPool, snapshot

        pool = OpponentPool(policy, size=int(cfg.opponent_pool.get("size", 4)),
                            latest_p=float(cfg.opponent_pool.get("latest_p", 0.0)), seed=cfg.seed)
        stack.callback(pool.close)
        pool.add(snapshot(policy, version=str(start)))
        pool_seats = set(cfg.opponent_pool["agents"])

        def opponent_for(index: int, agent: str) -> Any:
            return pool.opponent(index) if agent in pool_seats else None  # None: the live policy

    meter = BusyMeter()  # engine busy time and generated tokens, whatever the mode
    manager = RolloutManager(order, env_id=cfg.env, env_kwargs=cfg.env_kwargs, policy=meter.wrap(policy),
                             renderer=renderer, policy_for=opponent_for,
                             sampling_params={"temperature": cfg.temperature, "top_p": cfg.top_p,
                                              **({"sampling_seed": "episode"} if cfg.seed_sampling else {})},
                             n_samples_per_prompt=cfg.n_samples_per_prompt,
                             max_concurrency=max(cfg.max_concurrency, cfg.n_samples_per_prompt),
                             max_turns=cfg.max_turns, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed,
                             train_agents=cfg.train_agents, skip=trained if asynchrony.mode == "full" else (),
                             partial_rollout=asynchrony.mode == "full" and asynchrony.interrupt == "resume")
    stack.push_async_callback(manager.close)
    source = make_source(asynchrony, manager, per_step, version=start)
    stack.push_async_callback(source.close)  # runs before manager.close: in-flight generation stops first
    release_kv = bool(TrainerConfig(**cfg.trainer).offload) and engines.embedded and hasattr(policy, "release_memory")
    rows: list[dict[str, Any]] = []
    if not cfg.resume:
        metrics_path.unlink(missing_ok=True)
        samples_path.unlink(missing_ok=True)
    t_start = time.perf_counter()
    if evals and start == 0:
        first = await evals.run(policy, renderer, 0)
        rows.append(_record(metrics_path, writer, 0, first))
        log(f"step 0: {_eval_line(first)}")
    if cfg.warmup and start == 0:  # a resumed run's checkpoint already holds the warm-up
        warm = await _warmup(cfg, run, engines, trainer, channel, train_tasks, log)
        if evals:
            warm.update(await evals.run(policy, renderer, 0))
            log(f"after the SFT warm-up: {_eval_line(warm)}")
        rows.append(_record(metrics_path, writer, 0, warm))
    t_prev, busy_prev, tokens_prev = time.perf_counter(), meter.busy(), meter.tokens
    step = start
    try:
        for step in range(start + 1, cfg.steps + 1):
            t0 = time.perf_counter()
            batch = await source.next(step, last=step == cfg.steps)
            scored = await scorers(batch.groups) if scorers is not None else {}  # reward model, OPD teacher
            trajs = [t for g in batch.groups for t in g.trajectories]
            if not trajs:
                raise RuntimeError("the rollout manager returned no groups")
            await engines.wait_restarts()
            if engines.pool is not None and not engines.pool.targets():  # the last engine is gone
                reasons = "; ".join(sorted({f"{u}: {r}" for u, state, r in engines.pool.events if state == "down"}))
                raise _RunEnded(f"every engine is gone ({reasons})")
            rollout_s = time.perf_counter() - t0  # the trainer's wait for its batch
            _save_samples(samples_path, step, batch.groups[:max(cfg.sample_groups, 0)])
            if release_kv:  # colocated with `offload: true`: the engine's K/V pool leaves the GPU while it trains
                policy.release_memory()
            metrics = await trainer.step(trajs, cfg.n_samples_per_prompt)
            metrics.update(scored)
            trained.extend(g.group_index for g in batch.groups)  # in the weights now, synced or not
            t_sync = time.perf_counter()
            await source.before_sync()
            meter.hold()  # requests queued behind the update are not engine work
            await engines.wait_restarts()  # an engine restarted meanwhile gets this step's weights too
            metrics.update(await trainer.sync(channel, str(step)))
            engines.synced()
            meter.release()
            source.after_sync(step)
            sync_s = time.perf_counter() - t_sync
            if on_step is not None:
                seen = on_step(step, engines, trainer)
                if asyncio.iscoroutine(seen):
                    await seen
            if pool is not None and step % max(int(cfg.opponent_pool.get("every", 5)), 1) == 0:
                pool.add(snapshot(policy, version=str(step)))
            now = time.perf_counter()
            wall = max(now - t_prev, 1e-9)
            metrics.update({"rollout/s": rollout_s, "rollout/statuses": _statuses(trajs),
                            "time/elapsed_s": now - t_start, "time/step_s": wall, "time/sync_s": sync_s,
                            "time/trainer_idle_frac": max(0.0, 1.0 - metrics.get("train/step_s", 0.0) / wall),
                            "time/engine_idle_frac": max(0.0, 1.0 - (meter.busy() - busy_prev) / wall),
                            "rollout/generated_tokens_per_s": (meter.tokens - tokens_prev) / wall,
                            **tool_metrics(trajs)})
            if asynchrony.mode != "off":
                metrics.update(staleness_metrics(batch.groups, step - 1))
                metrics["async/groups_stale"] = batch.metrics.get("rollout/groups_stale", 0.0)
                if asynchrony.mode == "full":
                    metrics["async/groups"] = [g.group_index for g in batch.groups]
            if engines.pool is not None:
                metrics["engines/failovers"] = float(engines.pool.failovers)
                metrics["engines/up"] = float(len(engines.pool.up()))
            out_of_time = cfg.time_budget_s is not None and time.perf_counter() - t_start > cfg.time_budget_s
            metrics.update(await evals.run(policy, renderer, step, final=step == cfg.steps or out_of_time))
            metrics["time/eval_s"] = evals.seconds
            rows.append(_record(metrics_path, writer, step, metrics))
            t_prev, busy_prev, tokens_prev = time.perf_counter(), meter.busy(), meter.tokens
            log(f"step {step}: reward {metrics['train/reward_mean']:.3f}, loss {metrics.get('train/loss', 0):+.4f}, "
                f"grad {metrics.get('train/grad_norm', 0):.3f}, rollout {rollout_s:.1f}s, train "
                f"{metrics['train/step_s']:.1f}s" + (f", {_eval_line(metrics)}" if "eval/" in "".join(metrics) else ""))
            if cfg.save_every and (step % cfg.save_every == 0 or step == cfg.steps or out_of_time):
                _checkpoint(run, trainer, f"step_{step}", trained if asynchrony.mode == "full" else None)
            if out_of_time:
                log(f"time budget of {cfg.time_budget_s:.0f}s used: stopping after step {step}")
                break
    except Exception as e:
        # Whatever ends the run mid-step (the last engine gone, a trainer or engine error, a weight sync that
        # failed): stop generating, keep the trainer as of its last finished step, and say why.
        await source.close()
        done = trainer.step_count
        reason = str(e) if isinstance(e, _RunEnded) else f"{type(e).__name__}: {e}"
        try:
            where = _checkpoint(run, trainer, f"step_{done}", trained if asynchrony.mode == "full" else None)
        except Exception as save_error:  # noqa: BLE001 - the original reason matters more
            raise RuntimeError(f"step {step} failed ({reason}); saving the trainer failed too: {save_error}") from e
        raise RuntimeError(f"{reason}; the trainer after step {done} is saved in {where}") from e
    all_rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    from slime_env import spec

    games = spec(cfg.env).multi_agent  # zero-sum self-play: the mean train reward is 0 by construction
    curves = plot_curves(all_rows, run / "curves.png", f"{cfg.env} — {TrainerConfig(**cfg.trainer).estimator}",
                         "win rate against the evaluation opponent (greedy)" if games else "held-out accuracy (greedy)")
    accs = [(r["step"], r["eval/accuracy"]) for r in all_rows if "eval/accuracy" in r]
    summary = {"run_dir": str(run), "curves": str(curves), "metrics": str(metrics_path),
               "first_accuracy": accs[0][1] if accs else math.nan, "last_accuracy": accs[-1][1] if accs else math.nan,
               "steps": cfg.steps, "elapsed_s": time.perf_counter() - t_start}
    warm = [r for r in all_rows if "warmup/steps" in r]
    if warm and "eval/accuracy" in warm[0]:
        summary["after_warmup_accuracy"] = warm[0]["eval/accuracy"]
    (run / "summary.json").write_text(json.dumps(summary, indent=1))
    from slime_env.trainers.report import write_report

    summary["report"] = str(write_report(run))
    (run / "summary.json").write_text(json.dumps(summary, indent=1))
    log(f"report: {summary['report']}")
    return summary


class _RunEnded(Exception):
    """The run cannot go on (its reason is the message)."""


def _eval_line(metrics: Mapping[str, Any]) -> str:
    """The log line's evaluation part: held-out accuracy, and each named set's accuracy and largest pass@k."""
    parts = [f"held-out accuracy {metrics['eval/accuracy']:.3f}"] if "eval/accuracy" in metrics else []
    for key in sorted(k for k in metrics if k.endswith("/accuracy") and k.count("/") == 2):
        name = key.split("/")[1]
        passes = sorted((int(k.rsplit("@", 1)[1]), k) for k in metrics if k.startswith(f"eval/{name}/pass@"))
        parts.append(f"{name} {metrics[key]:.3f}" + (f" (pass@{passes[-1][0]} {metrics[passes[-1][1]]:.3f})"
                                                      if passes else ""))
    return ", ".join(parts)


def _checkpoint(run: Path, trainer: Any, name: str, trained: list[int] | None) -> Path:
    """Save the trainer under checkpoints/NAME (with the trained group indices of an asynchronous `full` run) and
    point `latest` at it."""
    where = run / "checkpoints" / name
    trainer.save(where)
    if trained is not None:
        (where / "async_state.json").write_text(json.dumps({"trained_groups": trained}))
    tmp = run / "checkpoints" / "latest.tmp"
    tmp.write_text(name)
    tmp.replace(run / "checkpoints" / "latest")  # atomic: a kill mid-write never leaves `latest` empty
    return where


def _truncate_rows(path: Path, last_step: int) -> None:
    """Keep the metrics rows up to `last_step` (a resumed run redoes the later ones)."""
    if path.exists():
        keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= last_step]
        path.write_text("".join(line + "\n" for line in keep))


def _save_samples(path: Path, step: int, groups: list[Any]) -> None:
    """This step's first groups, whole, for the report's trajectory viewer."""
    if not groups:
        return
    with path.open("a", encoding="utf-8") as f:
        for g in groups:
            f.write(json.dumps({**g.to_record(), "step": step}, ensure_ascii=False) + "\n")


def _statuses(trajs) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in trajs:
        out[t.status] = out.get(t.status, 0) + 1
    return out


def _record(path: Path, writer: Any, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
    row = {"step": step, **metrics}
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
    if writer is not None:
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                writer.add_scalar(k, v, step)
        writer.flush()
    return row


def _tensorboard(run: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard not installed: metrics.jsonl and the PNG still get written
        return None
    return SummaryWriter(str(run / "tensorboard"))
