"""The engines of a training run, from the run config's `engine:` section.

```yaml
engine:
  kind: embedded        # embedded (a TransformersPolicy in this process) | serve (slime-env serve-engine) |
                        # sglang (SGLang servers or one router) | vllm (vLLM servers, through their RL routes) |
                        # openai (any OpenAI-compatible server, frozen). Left out: embedded, except in an
                        # async mode on a GPU and with the trainer in other processes — serve (`default_kind`)
  urls: []              # sglang / vllm / openai: the servers; serve: the servers, or empty to start `count` here
  count: 2              # serve without urls: engine processes this run starts (and restarts when they die)
  gpus: [1]             # serve without urls: engine i runs on GPU gpus[i % len(gpus)] (default: the trainer's GPU)
  mem_fraction: 0.4     # embedded, and serve without urls: the K/V pool's share of the GPU memory free at the
                        # engine's start (default 0.4; trainers/run/gpu_memory.py counts it in the fit check)
  weight_sync: auto     # auto | distributed | tensor | disk | none
  pause: auto           # vllm: /pause mode of a sync — auto (keep with async interrupt: resume, else wait) | wait |
                        # keep | abort
  verify_sync: true     # vllm: compare /weight_checker checksums after each sync
```

`Engines` keeps the engines role (`slime_env.trainers.run.roles.Engines`): `policy` (what the rollout manager and the
evaluation generate with — the embedded policy or an `slime_env.agents.EnginePool`), `tokenizer`, `channel_spec()`
(which weight channel reaches them: `slime_env.trainers.run.channel`, made by `make_channel` in the trainer group),
`targets()` (the engines a sync must reach), their health (`gone`, `metrics`). `start()` checks, before any training,
that every engine answers and serves the trainer's model; a problem is an `InvalidInput` naming the config field.
Engines this run started are watched: one that dies is restarted and rejoins once the next weight sync has reached it
(`slime_env.agents.engine_pool`). How each `kind` starts is `STARTS`.

`weight_sync: auto` picks: embedded → in place; `serve` on this host → `tensor` (CUDA IPC) where every engine shares
a trainer rank's GPU (each pushed by that rank: `pusher`), `distributed` over NCCL where every engine has a GPU of its
own (`gpus`), over gloo on CPUs; `sglang` →
`distributed` over NCCL; `vllm` → `distributed` (vLLM's NCCL weight transfer) where this process has a GPU, `disk` on
CPUs (vLLM has no gloo transfer); `openai` → `none` (the OpenAI routes have no weight update: such engines serve
frozen policies, e.g. evaluation or a distillation teacher; training through one is refused — train through vLLM
with `kind: vllm`). A `vllm` engine must run in dev mode with its token-in route (`VLLM_SERVER_DEV_MODE=1 vllm serve
MODEL --enable-scale-out`); `start()` says which is missing (`slime_env.trainers.vllm_sync` has the protocol).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from slime_env.errors import InvalidInput
from slime_env.trainers.config_fields import parse_section

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, ProcessorMixin

    from slime_env.agents.engine_pool import EnginePool
    from slime_env.agents.launcher import ServeProcess
    from slime_env.agents.weight_layout import WeightLayout
    from slime_env.clients.sglang import SGLangPolicy
    from slime_env.policy import Policy
    from slime_env.trainers.run.channel import ChannelSpec
    from slime_env.trainers.run.roles import WeightChannel

KINDS = ("embedded", "serve", "sglang", "vllm", "openai")


@dataclass(frozen=True)
class EngineConfig:
    """`engine:` of the run config (see the module docstring)."""

    kind: str = "embedded"
    urls: list[str] = field(default_factory=list)
    count: int = 1
    weight_sync: str = "auto"
    backend: str = "auto"              # distributed: nccl | gloo | auto (nccl on CUDA, gloo on CPU)
    bucket_mb: int = 512               # distributed: bytes per update call
    master_address: str = "127.0.0.1"  # distributed: this host's address as the engines reach it
    health_interval_s: float = 5.0
    health_timeout_s: float = 60.0
    wait_for_engine_s: float = 600.0   # a request with no engine up waits this long for one to come back
    device: str = "auto"               # serve engines started here
    gpus: list[int] = field(default_factory=list)  # serve engines started here: their GPUs (see the docstring)
    dtype: str = "auto"
    max_batch_size: int | None = None  # serve engines started here (default: the run's max_concurrency)
    mem_fraction: float | None = None  # embedded, serve started here: K/V pool's share of free GPU memory (None: 0.4)
    model_name: str | None = None      # openai: the served model's name (default: its first model)
    restart: bool = True               # serve: restart an engine this run started when it dies
    pause: str = "auto"                # vllm: how a sync pauses generation (see the docstring)
    verify_sync: bool = True           # vllm: checksums compared after each sync
    api_key: str | None = None         # vllm: the server's --api-key

    @classmethod
    def from_dict(cls, raw: object, where: str = "engine", *, default_kind: str = "embedded") -> EngineConfig:
        """The section checked (an `InvalidInput` naming the field), `kind` defaulting to `default_kind`."""
        cfg = parse_section(cls, raw, where)
        if not (isinstance(raw, Mapping) and "kind" in raw):
            cfg = replace(cfg, kind=default_kind)
        if cfg.kind not in KINDS:
            raise InvalidInput(f"{where}.kind: {cfg.kind!r} is not one of {list(KINDS)}")
        if isinstance(cfg.urls, str):
            cfg = replace(cfg, urls=[cfg.urls])
        if cfg.kind in ("sglang", "vllm", "openai") and not cfg.urls:
            raise InvalidInput(f"{where}.urls: kind {cfg.kind!r} needs the servers' URLs")
        if cfg.kind == "embedded" and cfg.urls:
            raise InvalidInput(f"{where}.urls: kind 'embedded' runs in this process; give kind: serve or sglang")
        if cfg.weight_sync not in ("auto", "distributed", "tensor", "disk", "none"):
            raise InvalidInput(f"{where}.weight_sync: {cfg.weight_sync!r} is not auto, distributed, tensor, disk "
                               "or none")
        if cfg.kind == "openai" and cfg.weight_sync not in ("auto", "none"):
            raise InvalidInput(f"{where}.weight_sync: the OpenAI routes have no weight update; use weight_sync: "
                               "none (a frozen policy), or kind: vllm (vLLM's RL routes) / sglang / serve")
        if cfg.kind == "embedded" and cfg.weight_sync not in ("auto",):
            raise InvalidInput(f"{where}.weight_sync: the embedded engine is updated in place (leave it auto)")
        if cfg.mem_fraction is not None and not 0 < cfg.mem_fraction < 1:
            raise InvalidInput(f"{where}.mem_fraction: a share of the free GPU memory in (0, 1), got "
                               f"{cfg.mem_fraction}")
        if cfg.pause not in ("auto", "wait", "keep", "abort"):
            raise InvalidInput(f"{where}.pause: {cfg.pause!r} is not auto, wait, keep or abort")
        if cfg.kind == "vllm" and cfg.backend == "gloo":
            raise InvalidInput(f"{where}.backend: vLLM's weight transfer has no gloo backend; on CPUs use "
                               "weight_sync: disk")
        if cfg.backend not in ("auto", "nccl", "gloo"):
            raise InvalidInput(f"{where}.backend: {cfg.backend!r} is not auto, nccl or gloo")
        if isinstance(cfg.gpus, int):
            cfg = replace(cfg, gpus=[cfg.gpus])
        if cfg.device.startswith("cuda:"):  # one GPU named the torch way: the same placement as gpus: [N]
            if cfg.gpus or not cfg.device[5:].isdigit():
                raise InvalidInput(f"{where}.device: {cfg.device!r}: give the engines' GPUs as gpus: [N] "
                                   "and device: cuda")
            cfg = replace(cfg, gpus=[int(cfg.device[5:])], device="cuda")
        if cfg.gpus and (cfg.kind != "serve" or cfg.urls):
            raise InvalidInput(f"{where}.gpus: only engines this run starts (kind: serve without urls) are placed")
        if cfg.gpus and cfg.device == "cpu":
            raise InvalidInput(f"{where}.gpus: device is cpu")
        if any(not isinstance(g, int) or isinstance(g, bool) or g < 0 for g in cfg.gpus):
            raise InvalidInput(f"{where}.gpus: GPU indices (integers >= 0), got {cfg.gpus!r}")
        for name in ("count", "bucket_mb"):
            if getattr(cfg, name) < 1:
                raise InvalidInput(f"{where}.{name} must be >= 1, got {getattr(cfg, name)}")
        return cfg


def default_kind(*, asynchronous: bool, device: str, local: bool, embedded_only: bool) -> str:
    """`engine.kind` when the config leaves it out: `serve` where the trainer runs in other processes (`cluster.backend`
    ray or process: the engine cannot be in the trainer's), and for
    an asynchronous run whose trainer (`device`: the run's) is on a GPU of this host (a serve-engine process on the
    trainer's GPU, weights by CUDA IPC): generating beside the trainer in its process shares the GIL with the
    trainer's step (measured: async steps/h 1.01-1.15x the synchronous run's embedded, 1.38-1.54x with serve-engine;
    docs/async.md) — unless a feature needs the embedded engine (`embedded_only`); else `embedded`."""
    on_gpu = device != "cpu" and _cuda()
    return "serve" if not local or (asynchronous and on_gpu and not embedded_only) else "embedded"


class Engines:
    """The engines role (see the module docstring); `await start()` before use."""

    def __init__(self, cfg: EngineConfig, *, model_path: str, max_concurrency: int, run_dir: Path, seed: int,
                 device: str, dtype: str, spawn: Callable[..., ServeProcess] | None = None):
        self.cfg, self.model_path, self.run_dir, self.seed = cfg, model_path, run_dir, seed
        self.spawn = spawn  # spawn(index, **ServeProcess kwargs): where an engine this run starts goes
        self.max_concurrency, self.device, self.dtype = max_concurrency, device, dtype
        self.policy: Policy | None = None
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.processor: ProcessorMixin | None = None
        self.pool: EnginePool | None = None
        self.processes: list[ServeProcess] = []
        self._restarts: set[asyncio.Task] = set()
        self.embedded = cfg.kind == "embedded"
        self.routed_experts: tuple[int, int] | None = None  # routing replay: (layers, top_k) asked of SGLang servers
        self.pause_mode = "wait" if cfg.pause == "auto" else cfg.pause  # vllm: the run sets keep for interrupt resume

    # --- start -------------------------------------------------------------------------------------------------
    async def start(self) -> None:
        await STARTS[self.cfg.kind](self)

    async def _start_embedded(self) -> None:
        from slime_env.agents.policy_loader import load_policy

        self.policy, self.model_path = load_policy(self.model_path, max_batch_size=self.max_concurrency,
                                                   batch_window_s=0.005, device=self.device, dtype=self.dtype,
                                                   seed=self.seed, paged_options=None if self.cfg.mem_fraction is None
                                                   else {"kv_memory_fraction": self.cfg.mem_fraction})
        self.tokenizer = self.policy.tokenizer
        self.processor = getattr(self.policy, "processor", None)  # a vision model's: its renderer places images

    async def _start_openai(self) -> None:
        from slime_env.clients.openai import OpenAIPolicy

        self.tokenizer = load_tokenizer(self.model_path)
        self.policy = OpenAIPolicy(self.cfg.urls[0], self.cfg.model_name or "default")

    async def _start_vllm(self) -> None:
        """vLLM servers given by URL: each offers the RL routes (dev mode, token-in generation, a known version) and
        serves the trainer's model, or an `InvalidInput` naming it, before any training."""
        from slime_env.agents.engine_pool import EnginePool
        from slime_env.clients.vllm import VLLMPolicy, VLLMServerError
        from slime_env.http import RemoteError

        self.tokenizer = load_tokenizer(self.model_path)
        engines = [VLLMPolicy(u, max_connections=max(256, self.max_concurrency), api_key=self.cfg.api_key)
                   for u in self.cfg.urls]
        want = _embedding_digests(self.model_path)
        for i, e in enumerate(engines):
            try:
                await asyncio.wait_for(e.check(), self.cfg.health_timeout_s)
                sums = await e.weight_checksums()
            except VLLMServerError as err:
                raise InvalidInput(f"engine.urls[{i}]: {err}") from None
            except (RemoteError, TimeoutError, OSError) as err:
                raise InvalidInput(f"engine.urls[{i}]: {e.url} does not answer as a vLLM server ({err})") from None
            got = [v for k, v in sums.items() if k.rsplit(":", 1)[-1] == "model.embed_tokens.weight"]
            if want and len(got) == 1 and got[0] not in want:
                raise InvalidInput(f"engine.urls[{i}]: {e.url} serves other weights than the trainer's model "
                                   f"{self.model_path} (model.embed_tokens.weight's sha256 differs in every dtype)")
        self.pool = EnginePool(engines, health_interval_s=self.cfg.health_interval_s,
                               health_timeout_s=self.cfg.health_timeout_s,
                               wait_for_engine_s=self.cfg.wait_for_engine_s, on_down=self._on_down)
        self.pool.watch()
        self.policy = self.pool

    async def _start_servers(self) -> None:
        """SGLang-API servers: given by URL (sglang, serve with urls) or started by this run (serve)."""
        from slime_env.agents.engine_pool import EnginePool
        from slime_env.clients.sglang import SGLangPolicy

        self.tokenizer = load_tokenizer(self.model_path)
        urls = list(self.cfg.urls)
        if not urls:  # serve: this run starts its engines
            urls = await self._launch()
        engines = [SGLangPolicy(u, max_connections=max(256, self.max_concurrency), routed_experts=self.routed_experts)
                   for u in urls]
        await self._check(engines)
        self.pool = EnginePool(engines, health_interval_s=self.cfg.health_interval_s,
                               health_timeout_s=self.cfg.health_timeout_s,
                               wait_for_engine_s=self.cfg.wait_for_engine_s, on_down=self._on_down)
        self.pool.watch()
        self.policy = self.pool

    async def _launch(self) -> list[str]:
        from slime_env.agents.launcher import ServeProcess

        logs = self.run_dir / "engines"
        logs.mkdir(parents=True, exist_ok=True)
        args = ["--max-batch-size", str(self.cfg.max_batch_size or self.max_concurrency), "--batch-window-ms", "5",
                "--device", self.cfg.device, "--dtype", self.cfg.dtype]
        if self.cfg.mem_fraction is not None:
            args += ["--mem-fraction", str(self.cfg.mem_fraction)]
        if not _cuda() or self.cfg.device == "cpu":  # engines on this CPU share its cores instead of each taking all
            import os

            args += ["--threads", str(max(1, (os.cpu_count() or 1) // self.cfg.count))]
        spawn = self.spawn or (lambda i, **kw: ServeProcess(**kw))
        self.processes = [spawn(i, model=self.model_path, args=args, log_path=logs / f"engine_{i}.log",
                                env=self._gpu_env(i)) for i in range(self.cfg.count)]
        try:
            return list(await asyncio.gather(*(p.start() for p in self.processes)))
        except Exception:
            for p in self.processes:
                p.stop()
            raise

    def _gpu_env(self, i: int) -> dict[str, str]:
        """Engine i's environment: only its GPU visible (`gpu_env`), or nothing where engines share the trainer's."""
        return gpu_env(self.cfg.gpus[i % len(self.cfg.gpus)]) if self.cfg.gpus else {}

    def engine_gpus(self) -> set[int]:
        """The GPUs (this process's indices) of the engines this run starts; empty where they share the trainer's."""
        return {self.cfg.gpus[i % len(self.cfg.gpus)] for i in range(self.cfg.count)} if self.cfg.gpus else set()

    async def _check(self, engines: list[SGLangPolicy]) -> None:
        """Every engine answers, and serves the weights of the trainer's model (compared on the first values of
        the embedding, within bf16 rounding: the engine may run in bf16)."""
        from slime_env.http import RemoteError

        want = _first_values(self.model_path)
        for i, e in enumerate(engines):
            field_name = f"engine.urls[{i}]" if self.cfg.urls else f"engine (started engine {i})"
            try:
                ok = await asyncio.wait_for(e.health(), self.cfg.health_timeout_s)
            except (TimeoutError, OSError):
                ok = False
            if not ok:
                raise InvalidInput(f"{field_name}: {e.url} does not answer /health_generate")
            try:
                got = await e.http.request("GET", "/get_weights_by_name",
                                           {"name": "model.embed_tokens.weight", "truncate_size": len(want)})
            except RemoteError as err:
                raise InvalidInput(f"{field_name}: {e.url} cannot show its weights ({err}); it must serve the "
                                   f"trainer's model {self.model_path}") from None
            if len(got) != len(want) or any(not math.isclose(a, b, rel_tol=1e-2, abs_tol=1e-3)
                                            for a, b in zip(got, want)):
                raise InvalidInput(f"{field_name}: {e.url} serves other weights than the trainer's model "
                                   f"{self.model_path} (model.embed_tokens.weight starts {got[:4]} there, "
                                   f"{want[:4]} here)")

    # --- weight sync -------------------------------------------------------------------------------------------
    def channel_spec(self, trainer_gpus: set[int] | None = None, *, keep_adapters: int = 2,
                     ray_node: bool = False) -> ChannelSpec:
        """The weight channel that reaches these engines (`channel_kind`), as `make_channel` builds it: decided here
        once per run. `trainer_gpus`: the GPUs of the trainer's ranks (default: this process's GPU); `keep_adapters`:
        LoRA adapter versions each engine keeps; `ray_node`: the pushing rank is a Ray actor, which the engines reach
        at its node's address (found there) rather than at `engine.master_address`."""
        from slime_env.trainers.run.channel import ChannelSpec

        return ChannelSpec(kind=self.channel_kind(trainer_gpus), folder=str(self.sync_folder()),
                           api="vllm" if self.cfg.kind == "vllm" else "sglang", backend=self.backend(),
                           master_address=None if ray_node else self.cfg.master_address,
                           bucket_bytes=self.cfg.bucket_mb << 20, keep_adapters=keep_adapters,
                           pause_mode=self.pause_mode, verify=self.cfg.verify_sync)

    def channel(self, layout: WeightLayout | None = None, *,
                save: Callable[[Path], object] | None = None) -> WeightChannel:
        """`make_channel` of `channel_spec()` to these engines from this process. `layout`: how the trainer's weights
        reach them; `save(path)`, for `disk`: a writer of the model folder other than the layout's own."""
        from slime_env.trainers.run.channel import make_channel

        return make_channel(self.channel_spec(), self.targets, layout=layout, policy=self.policy, save=save)

    def targets(self) -> list[Policy]:
        """The engine servers a weight sync must reach now (none for the embedded engine)."""
        return list(self.pool.targets()) if self.pool is not None else []

    def channel_kind(self, trainer_gpus: set[int] | None = None) -> str:
        """`engine.weight_sync` with `auto` resolved (see the module docstring), refused by name where it cannot
        reach the engines. `trainer_gpus`: the GPUs of the trainer's ranks (default: this process's GPU)."""
        if self.embedded:
            return "inplace"
        kind = self.cfg.weight_sync
        if kind == "auto":
            kind = "none" if self.cfg.kind == "openai" else "distributed"
            if self.cfg.kind == "vllm" and not _cuda():
                kind = "disk"  # vLLM's transfer engines are NCCL and CUDA IPC only
            if self.cfg.kind == "serve" and not self.cfg.urls and _cuda():
                # Every engine on a trainer rank's GPU: CUDA IPC, from that rank (NCCL refuses two ranks on one GPU).
                # Every engine on a GPU of its own: NCCL, GPU to GPU.
                kind = "distributed" if self.engine_gpus() - self._trainer_gpus(trainer_gpus) else "tensor"
        self._check_reach(kind, trainer_gpus)
        return kind

    def pusher(self, url: str, ranks: int) -> int:
        """Which of `ranks` trainer ranks (rank r on GPU r) pushes `weight_sync: tensor` to the engine at `url`: the
        rank on the engine's GPU (CUDA IPC opens memory of a GPU the engine sees); on CPUs, where shared memory
        reaches any engine, the engines this run started in turn; rank 0 for any other."""
        i = next((i for i, p in enumerate(self.processes) if getattr(p, "url", None) == url), None)
        if i is None or ranks == 1:
            return 0
        if self.cfg.gpus:
            gpu = self.cfg.gpus[i % len(self.cfg.gpus)]
            return gpu if gpu < ranks else 0
        return 0 if _cuda() else i % ranks  # on CUDA without engine.gpus every engine is on GPU 0

    @staticmethod
    def _trainer_gpus(given: set[int] | None) -> set[int]:
        if given is not None:
            return given
        import torch

        return {torch.cuda.current_device()}

    def sync_folder(self) -> Path:
        """Where `weight_sync: disk` writes each version: `run_dir/weight_sync`, the channel's alone (emptied when a
        run, a resumed one too, opens it; its versions removed when it closes), LoRA adapter versions under its
        `adapters` (each removed once no engine holds it loaded). In the run directory rather than /tmp: a run killed
        with SIGKILL leaves it where its resume clears it, and across hosts the run directory is the shared one."""
        return self.run_dir.resolve() / "weight_sync"  # the engines and ranks resolve it in cwds of their own

    def backend(self) -> str:
        """The `distributed` channel's torch.distributed backend."""
        return self.cfg.backend if self.cfg.backend != "auto" else ("nccl" if _cuda() else "gloo")

    def _check_reach(self, kind: str, trainer_gpus: set[int] | None = None) -> None:
        """CUDA IPC reaches only engines that see a trainer rank's GPU; NCCL only engines on other GPUs."""
        gpus = self.engine_gpus()
        if not gpus or kind not in ("tensor", "distributed") or kind == "distributed" and self.cfg.backend == "gloo":
            return
        mine = self._trainer_gpus(trainer_gpus)
        if kind == "tensor" and gpus - mine or kind == "distributed" and gpus & mine:
            where = f"GPU {min(mine)}" if len(mine) == 1 else f"GPUs {sorted(mine)}"
            raise InvalidInput(f"engine.gpus: {sorted(gpus)} puts {'some' if len(gpus) > 1 else 'the'} engine(s) "
                               f"{'off' if kind == 'tensor' else 'on'} the trainer's {where}, which "
                               f"weight_sync {kind} cannot reach (CUDA IPC needs the trainer's GPU, NCCL a GPU per "
                               "rank); place them all apart or all on it, or use weight_sync: disk")

    def synced(self) -> None:
        """A weight sync reached every target: stale engines rejoin the rotation."""
        if self.pool is not None:
            self.pool.mark_synced(self.pool.targets())

    def gone(self) -> str | None:
        """Why no engine is left to generate (None while one is up, or for the embedded engine)."""
        if self.pool is None or self.pool.targets():
            return None
        return "; ".join(sorted({f"{u}: {r}" for u, state, r in self.pool.events if state == "down"}))

    def metrics(self) -> dict[str, float]:
        """`engines/failovers` and `engines/up` of a pool of servers (nothing for the embedded engine)."""
        if self.pool is None:
            return {}
        return {"engines/failovers": float(self.pool.failovers), "engines/up": float(len(self.pool.up()))}

    async def release_memory(self) -> None:
        """The engines' memory leaves the GPU while a colocated trainer runs (`trainer.offload`): the embedded
        engine's K/V pool, or SGLang's `/release_memory_occupation` on each engine server (serve, sglang); a no-op
        for other kinds."""
        if self.embedded and hasattr(self.policy, "release_memory"):
            self.policy.release_memory()
        elif self.releases_memory:
            await asyncio.gather(*(e.release_memory_occupation() for e in self.pool.up()))

    async def resume_memory(self) -> None:
        """Before the weights arrive: each engine server takes its memory back (`/resume_memory_occupation`; SGLang
        releases its weights too). The embedded engine takes its pool back when it next generates."""
        if self.releases_memory:
            await asyncio.gather(*(e.resume_memory_occupation() for e in self.pool.up()))

    @property
    def releases_memory(self) -> bool:
        """Whether `release_memory` frees memory of engine servers (kind serve or sglang)."""
        return not self.embedded and self.cfg.kind in ("serve", "sglang") and self.pool is not None

    # --- faults ------------------------------------------------------------------------------------------------
    def _on_down(self, engine: Policy, reason: str) -> None:
        process = next((p for p in self.processes if p.url == engine.url), None)
        if process is None or not self.cfg.restart:
            return
        task = asyncio.ensure_future(self._restart(process, engine))
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    async def _restart(self, process: ServeProcess, engine: Policy) -> None:
        if await asyncio.to_thread(process.alive):  # it answers no more but runs: stop it first (a hung engine)
            await asyncio.to_thread(process.stop)
        url = await process.start()
        from slime_env.clients.sglang import SGLangPolicy

        self.pool.replace(engine, SGLangPolicy(url, max_connections=max(256, self.max_concurrency),
                                               routed_experts=self.routed_experts))

    async def wait_restarts(self) -> None:
        """Until the restarts under way are done (their engines are then stale, waiting for weights)."""
        if self._restarts:
            await asyncio.gather(*list(self._restarts), return_exceptions=True)

    async def close(self) -> None:
        for task in list(self._restarts):
            task.cancel()
        if self.pool is not None:
            await self.pool.close()
        elif self.policy is not None and hasattr(self.policy, "close"):
            result = self.policy.close()
            if asyncio.iscoroutine(result):
                await result
        for p in self.processes:
            await asyncio.to_thread(p.stop)


# engine.kind -> how its engines start
STARTS = {"embedded": Engines._start_embedded, "openai": Engines._start_openai, "serve": Engines._start_servers,
          "sglang": Engines._start_servers, "vllm": Engines._start_vllm}


def load_tokenizer(model_path: str) -> PreTrainedTokenizerBase:
    """The tokenizer saved in the model folder (the embedded model's folder holds the original one)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(model_path))


def resolve_model_path(model: str) -> str:
    if model == "default":
        from slime_env.agents.default_model import default_model_path

        return str(default_model_path())
    if model == "smolvlm":
        from slime_env.agents.vision_models import smolvlm_path

        return str(smolvlm_path())
    return model


def _first_values(model_path: str, n: int = 8) -> list[float]:
    """The first values of the model folder's embedding (safetensors, read without loading the model)."""
    from safetensors import safe_open

    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            if "model.embed_tokens.weight" in st.keys():
                return st.get_slice("model.embed_tokens.weight")[0, :n].float().tolist()
    raise InvalidInput(f"model: {model_path} has no model.embed_tokens.weight in its safetensors files")


def _embedding_digests(model_path: str) -> set[str]:
    """vLLM's checksum (sha256 of the bytes) of the model folder's embedding, in each dtype a server may hold it."""
    import hashlib

    import torch
    from safetensors import safe_open

    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            if "model.embed_tokens.weight" in st.keys():
                t = st.get_tensor("model.embed_tokens.weight")
                return {hashlib.sha256(t.to(d).contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
                        for d in (t.dtype, torch.bfloat16, torch.float16, torch.float32)}
    return set()


def gpu_env(gpu: int) -> dict[str, str]:
    """The environment that makes this process's GPU `gpu` a child process's only visible device (mapped through
    this process's own CUDA_VISIBLE_DEVICES): the child's kernels and CUDA graphs then run on that device's context
    without any device index in it (`--device cuda` there)."""
    import os

    import torch

    if gpu >= torch.cuda.device_count():
        raise InvalidInput(f"engine.gpus: GPU {gpu} is not there (this process sees "
                           f"{torch.cuda.device_count()} GPU(s))")
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return {"CUDA_VISIBLE_DEVICES": visible[gpu] if visible else str(gpu)}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def routing_shape(model_path: str) -> tuple[int, int]:
    """(num_hidden_layers, num_experts_per_tok) of an MoE model folder: what SGLang servers return per token for
    routing replay. InvalidInput for a dense model."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    top_k = getattr(config, "num_experts_per_tok", None)
    if not top_k:
        raise InvalidInput(f"trainer.routing_replay: rollout: {model_path} ({config.model_type}) is not a MoE model")
    return int(config.num_hidden_layers), int(top_k)
