"""The run config of `slime-env train`: the YAML document (`TrainConfig`) and its sections, parsed once.

`TrainConfig` is the file as written: top-level scalars and one mapping per section (`engine:`, `cluster:`,
`trainer:`, `async:`, `warmup:`, `eval:`, `teacher:`, `reward:`, `opponent_pool:`). `TrainConfig.from_yaml` /
`from_dict` check it and parse every section into its typed object once, `RunSections` (`cfg.sections`), which is
all the run reads; a bad field is an `InvalidInput` naming its YAML path (`config.yaml: engine.kind: ...`). Every
field is documented in docs/trainers.md.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from slime_env.errors import InvalidInput
from slime_env.trainers.run.engines import EngineConfig, default_kind
from slime_env.trainers.run.evaluation import EvalSet, eval_sets
from slime_env.trainers.run.placement import ClusterConfig
from slime_env.trainers.config_fields import check_fields, check_int, check_scalars
from slime_env.trainers.run.sources import AsyncConfig
from slime_env.trainers.run.warmup import WarmupConfig
from slime_env.trainers.torch_trainer import TrainerConfig


@dataclass
class TrainConfig:
    """The whole run; every field can be set in the YAML file (see docs/trainers.md)."""

    # The parsed sections live in a slot beside the fields, not among them: the instance's __dict__ is the document
    # as written (`document()`), and the sections are a value derived from it once.
    __slots__ = ("_sections", "__dict__", "__weakref__")

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
    # Checkpoints kept: the last `keep_last` (the one a resume starts from among them), and every `keep_every`-th
    # step's besides (0: none); older ones are deleted as new ones are written (docs/trainers.md: their size).
    keep_last: int = 2
    keep_every: int = 0
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
    # The engines (slime_env.trainers.run.engines: embedded, serve, sglang, openai; the weight-sync channel) and where
    # the roles run (slime_env.trainers.run.placement: this process, or Ray).
    engine: dict[str, Any] = field(default_factory=dict)
    cluster: dict[str, Any] = field(default_factory=dict)
    # Asynchronous training (slime_env.trainers.run.sources; the YAML key is `async`): mode off | overlap | full,
    # max_staleness, in_flight, interrupt.
    async_: dict[str, Any] = field(default_factory=dict)
    # SFT warm-up before RL (slime_env.trainers.run.warmup: steps, lr, batch_size, data: conversations or teacher
    # rollouts).
    warmup: dict[str, Any] = field(default_factory=dict)
    # On-policy distillation's teacher (slime_env.trainers.run.teacher: {url} of an engine server or {model} loaded
    # here); its weight in the loss is trainer.opd_coef.
    teacher: dict[str, Any] = field(default_factory=dict)
    # A learned reward (slime_env.trainers.run.reward_models: a classifier RM, slime's remote_rm protocol, or an LLM
    # judge) combined with the env's: env_weight * env reward + weight * score.
    reward: dict[str, Any] = field(default_factory=dict)
    # Named eval sets beside the held-out split (slime_env.trainers.run.evaluation: several samples per task, pass@k,
    # maj@k).
    eval: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_yaml(cls, path: str | Path, sets: Sequence[str] = (), **overrides: Any) -> TrainConfig:
        """The run config in a YAML file, with top-level `overrides` (e.g. `env=`) and then the `sets` (`KEY=VALUE`,
        `set_fields`) applied before it is checked."""
        import yaml

        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise InvalidInput(f"config file {path} does not exist") from None
        except yaml.YAMLError as e:
            raise InvalidInput(f"{path}: not valid YAML: {e}") from None
        if not isinstance(raw, Mapping):
            raise InvalidInput(f"{path}: expected a mapping of run settings, got {type(raw).__name__}")
        return cls.from_dict(set_fields({**raw, **overrides}, sets), str(path))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], where: str = "config") -> TrainConfig:
        """The config of a mapping (the YAML document), checked and its sections parsed (`sections`)."""
        if not isinstance(raw, Mapping):
            raise InvalidInput(f"{where}: expected a mapping at the top level")
        raw = dict(raw)
        if "async" in raw:  # `async` is a Python keyword: the field is `async_`
            raw["async_"] = raw.pop("async")
        check_fields(cls, raw, where, sep=": ")
        cfg = cls(**check_scalars(cls, raw, where, sep=": "))
        cfg._sections = RunSections.parse(cfg, where)
        return cfg

    @property
    def sections(self) -> RunSections:
        """The typed sections, parsed when the config was loaded (or now, for a config built directly)."""
        try:
            return self._sections
        except AttributeError:
            self._sections = RunSections.parse(self, "config")
            return self._sections

    def document(self) -> dict[str, Any]:
        """The fields as the YAML names them (`async` is `async_`): what the run writes to config.json."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _check_sampling(cfg: TrainConfig, where: str) -> None:
    """Sampling settings an engine would take and then misbehave on (a negative temperature failed every rollout; a
    NaN one sampled one token forever), refused by field."""
    t = cfg.temperature
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        raise InvalidInput(f"{where}: temperature must be a finite number >= 0 (0: greedy), got {t!r}")
    p = cfg.top_p
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
        raise InvalidInput(f"{where}: top_p must be in (0, 1], got {p!r}")
    if cfg.eval_max_new_tokens is not None:
        check_int(cfg.eval_max_new_tokens, f"{where}: eval_max_new_tokens", minimum=1)
    b = cfg.time_budget_s
    if b is not None and (isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or b <= 0):
        raise InvalidInput(f"{where}: time_budget_s must be a finite number of seconds > 0, got {b!r}")


@dataclass(frozen=True)
class OpponentPoolConfig:
    """`opponent_pool:` (league self-play; see `TrainConfig`)."""

    agents: tuple[str, ...]
    every: int = 5
    size: int = 4
    latest_p: float = 0.0


@dataclass(frozen=True)
class RunSections:
    """Every section of a run config as the run uses it, parsed once (`RunSections.parse`).

    `trainer` has `off_policy: auto` resolved (token-level TIS when the run is asynchronous, else none)."""

    trainer: TrainerConfig
    engine: EngineConfig
    cluster: ClusterConfig
    asynchrony: AsyncConfig
    warmup: WarmupConfig
    eval_sets: list[EvalSet]
    eval_every: int | None  # the eval sets' own `every` (None: the run's eval_every)
    opponent_pool: OpponentPoolConfig | None = None
    teacher: Mapping[str, Any] | None = None
    reward: Mapping[str, Any] | None = None

    @classmethod
    def parse(cls, cfg: TrainConfig, where: str) -> RunSections:
        """Check `cfg` and parse its sections; `InvalidInput` naming `where` and the field's YAML path."""
        if not isinstance(cfg.trainer, Mapping):
            raise InvalidInput(f"{where}: trainer: expected a mapping, got {type(cfg.trainer).__name__}")
        checked = check_scalars(TrainerConfig, cfg.trainer, f"{where}: trainer")
        try:
            trainer = TrainerConfig(**checked)
        except (TypeError, ValueError) as e:
            raise InvalidInput(f"{where}: trainer: {e}") from None
        pool = _opponent_pool(cfg.opponent_pool, where)
        for name in ("steps", "prompts_per_step", "n_samples_per_prompt", "max_turns", "max_new_tokens"):
            check_int(getattr(cfg, name), f"{where}: {name}", minimum=1)
        for name in ("save_every", "eval_every", "sample_groups", "max_concurrency", "keep_every"):
            check_int(getattr(cfg, name), f"{where}: {name}", minimum=0)
        check_int(cfg.keep_last, f"{where}: keep_last", minimum=1)  # the checkpoint `latest` names stays
        _check_sampling(cfg, where)
        for section in ("train_data", "eval_data"):
            data = getattr(cfg, section)
            for key in ("n", "size", "limit"):  # how many tasks: fewer than one measures and trains nothing
                if isinstance(data, Mapping) and key in data:
                    check_int(data[key], f"{where}: {section}.{key}", minimum=1)
        cluster = ClusterConfig.from_dict(cfg.cluster, f"{where}: cluster")
        asynchrony = AsyncConfig.from_dict(cfg.async_, f"{where}: async")
        kind = default_kind(asynchronous=asynchrony.mode != "off", device=cfg.device,
                            local=cluster.backend == "local", embedded_only=bool(pool))
        engine = EngineConfig.from_dict(cfg.engine, f"{where}: engine", default_kind=kind)
        cluster.check(engine, trainer, where)
        if pool and engine.kind != "embedded":
            raise InvalidInput(f"{where}: opponent_pool snapshots the embedded engine's model; it needs engine.kind "
                               f"embedded, not {engine.kind!r}")
        asynchrony.check(cfg.n_samples_per_prompt, offload=trainer.offload and engine.kind == "embedded", where=where)
        warmup = WarmupConfig.from_dict(cfg.warmup, f"{where}: warmup")
        sets, every = eval_sets(cfg.eval, f"{where}: eval")
        for s in sets:
            if s.env is not None:
                from slime_env.registry import spec as env_spec

                try:
                    env_spec(s.env)
                except Exception as e:  # noqa: BLE001 - an unknown env id is a config error, named here
                    raise InvalidInput(f"{where}: eval.sets.{s.name}.env: {e}") from None
        if (trainer.opd_coef > 0) != bool(cfg.teacher):
            raise InvalidInput(f"{where}: on-policy distillation needs both trainer.opd_coef > 0 and a teacher "
                               f"section; got opd_coef={trainer.opd_coef}, teacher={cfg.teacher or None}")
        if cfg.teacher:
            from slime_env.trainers.run.teacher import check_spec

            check_spec(cfg.teacher, f"{where}: teacher")
        if cfg.reward:
            from slime_env.trainers.run import reward_models

            reward_models.check_spec(cfg.reward, f"{where}: reward")
        if engine.kind == "openai":
            raise InvalidInput(f"{where}: engine.kind openai serves a frozen policy (the OpenAI routes update no "
                               "weights): it can evaluate, not train; use kind: vllm (a vLLM server through its RL "
                               "routes), sglang or serve")
        if trainer.off_policy == "auto" and not trainer.legacy_tis and asynchrony.mode != "off":
            trainer = replace(trainer, off_policy="tis")
        if trainer.lora is not None and asynchrony.mode != "off":  # every in-flight request's adapter stays loaded
            keep = max(trainer.lora.keep_loaded, asynchrony.max_staleness + 1)
            trainer = replace(trainer, lora=replace(trainer.lora, keep_loaded=keep))
        return cls(trainer=trainer, engine=engine, cluster=cluster, asynchrony=asynchrony, warmup=warmup,
                   eval_sets=sets, eval_every=every, opponent_pool=pool, teacher=cfg.teacher or None,
                   reward=cfg.reward or None)


def _opponent_pool(raw: Mapping[str, Any] | None, where: str) -> OpponentPoolConfig | None:
    if raw is None:
        return None
    if sorted(set(raw) - {"agents", "every", "size", "latest_p"}) or not raw.get("agents"):
        raise InvalidInput(f"{where}: opponent_pool needs 'agents' (the seats it plays) and takes 'every', "
                           f"'size', 'latest_p'; got {sorted(raw)}")
    raw = check_scalars(OpponentPoolConfig, raw, f"{where}: opponent_pool")
    return OpponentPoolConfig(agents=tuple(raw["agents"]), every=max(int(raw.get("every", 5)), 1),
                              size=int(raw.get("size", 4)), latest_p=float(raw.get("latest_p", 0.0)))


def trainer_config(cfg: TrainConfig) -> TrainerConfig:
    """The run's `TrainerConfig` (`cfg.sections.trainer`: `off_policy: auto` resolved)."""
    return cfg.sections.trainer


_EXPONENT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+")


def set_fields(raw: Mapping[str, Any], sets: Sequence[str]) -> dict[str, Any]:
    """`raw` with each `KEY=VALUE` of `sets` applied in turn: KEY a dotted YAML path (`trainer.lr`, `eval_data.n`;
    missing mappings on the way are made), VALUE read as YAML (`4`, `1.0e-5`, `null`, `{}`, `[a, b]`). The
    command line's `--set`; a malformed one is an InvalidInput naming it."""
    import yaml

    out: dict[str, Any] = dict(raw)
    for item in sets:
        key, eq, text = item.partition("=")
        path = key.strip().split(".")
        if not eq or not all(path):
            raise InvalidInput(f"--set {item!r}: expected KEY=VALUE, KEY a dotted field path (e.g. trainer.lr=1e-5)")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise InvalidInput(f"--set {item!r}: the value is not valid YAML: {e}") from None
        if isinstance(value, str) and _EXPONENT.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads `1e-5` (no dot) as a string; on a command line it is a number
        node = out
        for depth, name in enumerate(path[:-1]):
            child = node.get(name)
            if child is None:
                child = {}
            elif not isinstance(child, Mapping):
                where = ".".join(path[:depth + 1])
                raise InvalidInput(f"--set {item!r}: {where} is {child!r}, not a mapping of fields")
            node[name] = child = dict(child)  # copies: the caller's mapping is left as it was
            node = child
        node[path[-1]] = value
    return out
