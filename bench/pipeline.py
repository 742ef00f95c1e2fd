"""The training pipeline across processes: weight sync, rollout throughput through engine servers, an engine's death.

    python bench/pipeline.py sync [--engines 1 2 4] [--hidden 2048 --layers 16]   # ~1B parameters by default
    python bench/pipeline.py sync --shape qwen3-4b [--gpus 4]     # a shape of bench/shapes.py, engines on GPUs 1-3
    python bench/pipeline.py throughput [--steps 3] [--shape qwen3-0.6b] [--gpus 3]
    python bench/pipeline.py fault [--shape NAME] [--gpus N]

`--shape NAME` (every command): random bf16 weights at that shape with SmolLM2's tokenizer (bench/shapes.py), instead
of sync's `--hidden` Llama and throughput's / fault's SmolLM2-135M-Instruct; `--layers` overrides its depth.
`--gpus N`: the sender / trainer on GPU 0 and the `serve-engine`s spread over GPUs 1..N-1 (engine i on GPU
1 + i mod (N-1)), weights over NCCL; `--gpus 1` puts every engine on the sender's GPU.

`sync`: seconds to push a model's weights from this process to N `serve-engine` servers, three ways in the same run —
`distributed` (SGLang's `update_weights_from_distributed`: a torch.distributed group, NCCL on a GPU, gloo on CPUs;
one call, as serve-engine bounds its own buffers; `buckets`: the same in 512 MB calls, as an SGLang server gets it),
`tensor` (CUDA IPC / shared memory, `update_weights_from_tensor`; same host) and `disk` (save a Hugging Face folder,
then `update_weights_from_disk`). Random weights of a Llama shape, bfloat16 on the wire and in the engines; every
push is checked (a parameter's checksum on every engine equals the sender's). On a GPU machine with one GPU the
engine shares the GPU: `tensor` (CUDA IPC) and `disk` are timed (NCCL needs a GPU per rank); with two or more, the
engines run on GPU 1 (`--engine-gpu`) and `distributed` goes over NCCL, GPU to GPU. `--train-step` also times one
`MegatronTrainer` step on the same shape (on GPU 0) for the "≤ 5% of a step" comparison.

`throughput`: the same multi-turn run (`ArithmeticRetry-v0`, seeded sampling so the rollouts are the same tokens)
with the embedded engine and with two `serve-engine` servers (`engine: {kind: serve, count: 2}`): episodes/s,
generated tokens/s, rollout and step seconds.

`fault`: two engines, `kill -9` one while step 2 generates: episodes per step (none lost or twice), failovers, the
restart, and the restarted engine's first generation's weight version.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from shapes import SHAPES, gpus_arg, save_random_model, tokenizer  # noqa: E402

from slime_env.agents.launcher import ServeProcess  # noqa: E402
from slime_env.clients.sglang import SGLangPolicy  # noqa: E402
from slime_env.trainers import weight_sync as ws  # noqa: E402
from slime_env.trainers.run.engines import gpu_env  # noqa: E402


def make_model_folder(args, folder: Path) -> dict[str, torch.Tensor]:
    """Random bf16 weights saved with SmolLM2's tokenizer at `folder`: `--shape` (with `--layers`), or else a Llama of
    `--hidden` / `--layers`; their state dict."""
    from transformers import LlamaConfig

    shape = args.shape or LlamaConfig(vocab_size=len(tokenizer()), hidden_size=args.hidden,
                                      intermediate_size=int(args.hidden * 2.75) // 64 * 64,
                                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                                      num_key_value_heads=args.hidden // 256, max_position_embeddings=4096,
                                      tie_word_embeddings=False)
    return save_random_model(shape, folder, layers=args.layers if args.shape else None,
                             device="cuda" if torch.cuda.is_available() else "cpu")


def engine_gpus(gpus: int | None) -> list[int] | None:
    """`--gpus N`'s engine placement: GPUs 1..N-1; None (the sender's GPU, or the CPU) when N is 1 or not given."""
    if gpus is not None and gpus > max(1, torch.cuda.device_count()):
        raise SystemExit(f"--gpus {gpus}: this machine has {torch.cuda.device_count()} GPU(s)")
    return list(range(1, gpus)) if gpus and gpus > 1 else None


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().float().contiguous().cpu().numpy().tobytes()).hexdigest()


async def time_channels(state: dict[str, torch.Tensor], folder: Path, n: int, kinds: list[str], logs: Path,
                        repeats: int, gpus: list[int] | None = None) -> dict[str, float]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    procs = [ServeProcess(model=str(folder), args=["--dtype", "bfloat16", "--device", device, "--max-batch-size", "4"],
                          log_path=logs / f"engine_{n}_{i}.log",
                          env=gpu_env(gpus[i % len(gpus)]) if gpus else {})  # what engine.gpus does
             for i in range(n)]
    urls = await asyncio.gather(*(p.start() for p in procs))
    engines = [SGLangPolicy(u, timeout_s=3600) for u in urls]
    out: dict[str, float] = {}
    probe = "model.layers.0.mlp.down_proj.weight"
    try:
        pushing: dict[str, dict[str, torch.Tensor]] = {}

        def save(path):  # what a trainer's save_weights does: the weights being pushed, as an HF folder
            from safetensors.torch import save_file

            path.mkdir(parents=True, exist_ok=True)
            first: dict[int, str] = {}  # one copy of tied embeddings (safetensors refuses shared tensors)
            for k, v in pushing["weights"].items():
                first.setdefault(v.data_ptr(), k)
            save_file({k: v.contiguous().cpu() for k, v in pushing["weights"].items() if first[v.data_ptr()] == k},
                      str(path / "model.safetensors"), metadata={"format": "pt"})
            shutil.copy(folder / "config.json", path / "config.json")

        for kind in kinds:
            tmp = Path(tempfile.mkdtemp(prefix="sync_bench_"))

            backend = "nccl" if device == "cuda" else "gloo"
            channel = {"distributed": lambda: ws.Distributed(lambda: engines, backend=backend),
                       "buckets": lambda: ws.Distributed(lambda: engines, backend=backend, bucket_bytes=512 << 20,
                                                         one_call=False),
                       "tensor": lambda: ws.FromTensor(lambda: engines),
                       "disk": lambda: ws.FromDisk(lambda: engines, folder=tmp, save=save)}[kind]()
            times = []
            for r in range(repeats + 1):  # the first forms the group / warms the page cache: not timed
                bump = {k: (v + (r + 1) * 1e-2).to(v.dtype) if k == probe else v for k, v in state.items()}
                pushing["weights"] = bump
                t0 = time.perf_counter()
                await channel.push(bump, f"{kind}-{r}")
                if r:
                    times.append(time.perf_counter() - t0)
                for e in engines:
                    got = (await e.get_weights_checksum([probe]))["checksums"][probe]
                    assert got == digest(bump[probe]), f"{kind}: engine {e.url} did not get the weights"
            await channel.close()
            shutil.rmtree(tmp, ignore_errors=True)
            out[kind] = sorted(times)[len(times) // 2]
    finally:
        for e in engines:
            await e.close()
        for p in procs:
            p.stop()
    return out


def train_step_seconds(folder: Path) -> float:
    """One full `MegatronTrainer.step` on the model of `folder` (GPU), on bench/megatron_mfu.py's batch: 16
    sequences of 256-2,048 tokens."""
    import random

    from slime_env.trainers.megatron_trainer import MegatronTrainer
    from slime_env.trainers.torch_trainer import TrainerConfig
    from transformers import AutoModelForCausalLM

    from bench.megatron_mfu import trajectories

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    trainer = MegatronTrainer(hf, TrainerConfig(backend="megatron", lr=1e-6, max_tokens_per_micro_batch=16384),
                              pad_id=0)
    del hf
    rng = random.Random(0)
    trajs = trajectories([rng.randint(256, 2048) for _ in range(16)], vocab=30000)
    trainer.step(trajs, 8)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    trainer.step(trajs, 8)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def cmd_sync(args) -> None:
    logs = Path(args.out_dir)
    logs.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.is_available()
    # CUDA IPC reaches only an engine that sees the sender's GPU; NCCL only one on another GPU. So the engines go to
    # GPU 1 by default only where there is one and `tensor` is not asked for.
    if args.gpus is not None and args.engine_gpu is not None:
        raise SystemExit("--gpus and --engine-gpu: give one of them")
    gpus = engine_gpus(args.gpus) if args.gpus is not None else \
        [args.engine_gpu] if args.engine_gpu is not None else None
    if gpus is None and args.gpus is None and torch.cuda.device_count() > 1 and "tensor" not in (args.kinds or []):
        gpus = [1]
    if gpus is not None and "tensor" in (args.kinds or []):
        raise SystemExit(f"--kinds tensor: CUDA IPC cannot reach engines on GPU(s) {gpus} (drop --engine-gpu / "
                         "--gpus, or give --gpus 1)")
    folder = Path(tempfile.mkdtemp(prefix="bench_model_"))
    state = make_model_folder(args, folder)
    params = sum(v.numel() for v in {v.data_ptr(): v for v in state.values()}.values())  # tied embeddings once
    kinds = args.kinds or (["distributed", "disk"] if gpus is not None else
                           ["tensor", "disk"] if gpu else ["distributed", "tensor", "disk"])
    rows = []
    for n in args.engines:
        times = asyncio.run(time_channels(state, folder, n, kinds, logs, args.repeats, gpus))
        rows.append({"engines": n, **times})
        print(json.dumps(rows[-1]), flush=True)
    step = train_step_seconds(folder) if args.train_step and gpu else None
    where = torch.cuda.get_device_name() if gpu else f"CPU ({os.cpu_count()} cores)"
    if gpus is not None:
        where += f"; sender on GPU 0, engines on GPU(s) {gpus}"
    print(f"\nweight sync of a {params / 1e9:.2f}B-parameter {args.shape or 'Llama'} "
          f"({params * 2 / 1e9:.2f} GB in bf16), {where}; seconds, median of {args.repeats}")
    print(f"{'engines':>7} " + " ".join(f"{k:>12}" for k in kinds) + ("   disk / fastest" if "disk" in kinds else ""))
    for r in rows:
        fastest = min((r[k] for k in kinds if k != "disk"), default=None)
        ratio = f"   {r['disk'] / fastest:.1f}x" if "disk" in kinds and fastest else ""
        print(f"{r['engines']:>7} " + " ".join(f"{r[k]:>12.3f}" for k in kinds) + ratio)
    if step is not None and any(k != "disk" for k in kinds):
        print(f"one MegatronTrainer step on this shape: {step:.2f} s; fastest sync at 1 engine = "
              f"{min(rows[0][k] for k in kinds if k != 'disk') / step:.1%} of it")
    shutil.rmtree(folder, ignore_errors=True)


def run_config(run_dir: str, engine: dict, steps: int, on_step=None, model: str = "default") -> list[dict]:
    from slime_env.trainers.run import TrainConfig, train

    tasks = {"generator": "slime_env.envs.math.retry_env:arithmetic_tasks", "digits": [2, 1], "ops": "+-"}
    cfg = TrainConfig.from_dict({
        "run_dir": run_dir, "model": model, "env": "ArithmeticRetry-v0",
        "env_kwargs": {"digits": [2, 1], "ops": "+-", "max_attempts": 3},
        "train_data": {**tasks, "size": 2000, "seed": 11, "split": "train"},
        "steps": steps, "prompts_per_step": 4, "n_samples_per_prompt": 8, "max_turns": 3, "max_new_tokens": 24,
        "max_concurrency": 32, "temperature": 1.0, "seed_sampling": True, "eval_every": 1000,
        "trainer": {"estimator": "grpo", "lr": 1e-5, "micro_batch_size": 16}, "engine": engine,
    }, "bench/pipeline.py")
    summary = asyncio.run(train(cfg, log=lambda _: None, on_step=on_step))
    return [json.loads(line) for line in open(summary["metrics"])]


def run_model(args) -> str:
    """The runs' `model:`: SmolLM2-135M-Instruct, or a folder of random weights at `--shape`."""
    if not args.shape:
        return "default"
    folder = tempfile.mkdtemp(prefix="bench_model_")
    save_random_model(args.shape, folder, layers=args.layers)
    return folder


def serve(count: int, args, **more) -> dict:
    """`engine:` of `count` serve-engines, placed by `--gpus`."""
    gpus = engine_gpus(args.gpus)
    return {"kind": "serve", "count": count, **more, **({"gpus": gpus} if gpus else {})}


def cmd_throughput(args) -> None:
    table = {}
    engines = (("embedded", {}), ("serve x2", serve(2, args)))
    model = run_model(args)
    for name, engine in engines:
        rows = run_config(tempfile.mkdtemp(prefix="bench_pipe_"), engine, args.steps, model=model)
        steady = rows[1:] or rows  # the first step warms up
        episodes = sum(sum(r["rollout/statuses"].values()) for r in steady)
        rollout = sum(r["rollout/s"] for r in steady)
        step = sum(r["rollout/s"] + r["train/step_s"] + r.get("sync/s", 0) for r in steady)
        table[name] = (episodes / rollout, rollout / len(steady), step / len(steady),
                       sum(r.get("sync/s", 0) for r in steady) / len(steady))
        print(name, table[name], flush=True)
    print(f"\n{'engines':10} {'episodes/s':>11} {'rollout s':>10} {'step s':>8} {'sync s':>8}")
    for name, (eps, ro, st, sy) in table.items():
        print(f"{name:10} {eps:>11.2f} {ro:>10.2f} {st:>8.2f} {sy:>8.2f}")


def cmd_fault(args) -> None:
    seen: dict = {}

    async def on_step(step, engines, trainer):
        if step == 1:
            async def kill_soon():
                await asyncio.sleep(0.5)
                seen["killed_at"] = time.perf_counter()
                engines.processes[0].kill()

            seen["task"] = asyncio.ensure_future(kill_soon())
        elif step == 2:
            restarted = next(e for e in engines.pool.engines if e.url == engines.processes[0].url)
            gen = await restarted.generate([1, 2, 3], {"temperature": 0.0, "max_new_tokens": 2})
            seen.update(failovers=engines.pool.failovers, restarts=engines.processes[0].starts - 1,
                        version=gen.weight_version, events=[(u, s) for u, s, _ in engines.pool.events])

    engine = serve(2, args, health_interval_s=0.5)
    rows = run_config(tempfile.mkdtemp(prefix="bench_fault_"), engine, 2, on_step, model=run_model(args))
    for r in rows:
        print(f"step {r['step']}: statuses {r['rollout/statuses']}, rollout {r['rollout/s']:.1f}s, "
              f"engines up after the sync {r.get('engines/up')}")
    print(f"failovers {seen['failovers']}, restarts {seen['restarts']}, the restarted engine's first generation: "
          f"weight version {seen['version']!r}; state changes {seen['events']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--shape", default=None, choices=sorted(SHAPES), help="random bf16 weights at this shape")
    common.add_argument("--gpus", type=gpus_arg, default=None,
                        help="the sender / trainer on GPU 0, the engines on GPUs 1..N-1")
    s = sub.add_parser("sync", parents=[common])
    s.add_argument("--engines", type=int, nargs="+", default=[1, 2, 4])
    s.add_argument("--hidden", type=int, default=2048)
    s.add_argument("--layers", type=int, default=None, help="the Llama's layers (16), or fewer of --shape's")
    s.add_argument("--kinds", nargs="+", default=None, choices=["distributed", "buckets", "tensor", "disk"])
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--train-step", action="store_true", help="GPU: also time one MegatronTrainer step")
    s.add_argument("--engine-gpu", type=int, default=None,
                   help="the engines' GPU (default: 1 where there are two or more and --kinds has no tensor, "
                        "else the sender's)")
    s.add_argument("--out-dir", default="runs/bench_pipeline")
    t = sub.add_parser("throughput", parents=[common])
    t.add_argument("--steps", type=int, default=3)
    f = sub.add_parser("fault", parents=[common])
    for p in (t, f):
        p.add_argument("--layers", type=int, default=None, help="fewer of --shape's layers (a quick check)")
    args = ap.parse_args()
    if args.layers and not args.shape and args.cmd != "sync":
        raise SystemExit("--layers: only with --shape")
    if args.cmd == "sync" and not args.shape:
        args.layers = args.layers or 16
    {"sync": cmd_sync, "throughput": cmd_throughput, "fault": cmd_fault}[args.cmd](args)


if __name__ == "__main__":
    main()
