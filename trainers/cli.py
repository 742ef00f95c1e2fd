"""`slime-env train`, `slime-env sft`, `slime-env report` and `slime-env export`: the trainers package's subcommands
(registered through `slime_env.cli`)."""

from __future__ import annotations

from typing import Any

import typer


def register(app: typer.Typer) -> None:
    """Add this package's subcommands to the `slime-env` app."""
    app.command()(train)
    app.command()(sft)
    app.command()(report)
    app.command()(export)
    app.command("serve-tinker")(serve_tinker)


def serve_tinker(model: str = typer.Option(..., help="the base model name clients ask for (e.g. Qwen/Qwen3-8B): "
                                                     "create_lora_training_client(base_model=...) must match it"),
                 checkpoint: str = typer.Option("default", help="weights: 'default' (embedded SmolLM2-135M-Instruct),"
                                                                 " 'random' (tiny random model, for plumbing) or a "
                                                                 "Hugging Face folder"),
                 tokenizer: str = typer.Option("smollm2", help="qwen3, llama3.1, llama3.2, smollm2 (offline) or a "
                                                               "Hugging Face folder"),
                 host: str = typer.Option("127.0.0.1", help="address to bind"),
                 port: int = typer.Option(8000, help="port (0 picks a free one)"),
                 root: str = typer.Option("tinker_checkpoints", help="where checkpoints are written"),
                 max_context_length: int = typer.Option(8192, min=1, help="longest datum or prompt accepted"),
                 backend: str = typer.Option("torch", help="the trainer of each training client, with LoRA: "
                                                           "torch (one process), fsdp or megatron (one process, or "
                                                           "every rank of `torchrun --nproc-per-node N -m slime_env "
                                                           "serve-tinker ...`: rank 0 serves, all train)"),
                 tp: int = typer.Option(1, help="megatron's tensor-parallel size (DP = ranks / TP)"),
                 pp: int = typer.Option(1, help="pipeline-parallel size: only 1 (Megatron's schedule owns the "
                                                "backward of Tinker's split step)"),
                 sampler_url: str = typer.Option(None, help="an engine server that samples for every sampling "
                                                            "client (e.g. http://127.0.0.1:30000: SGLang or "
                                                            "slime-env serve-engine, started on the same weights; it "
                                                            "must see --root); default: the embedded engine"),
                 sampler_kind: str = typer.Option("sglang", help="the --sampler-url server's API: sglang (SGLang, "
                                                                 "serve-engine) or vllm (no prompt log-probs)")
                 ) -> None:
    """A Tinker-compatible training API (the `tinker` SDK, tinker-cookbook recipes) over our trainer and engine."""
    import asyncio

    from slime_env.errors import InvalidInput
    from slime_env.trainers.tinker import TinkerBackend, start
    from slime_env.trainers.tinker.backend import check_backend, world_size
    from slime_env.trainers.tinker.models import load_model, load_tokenizer
    from slime_env.trainers.tinker.sampler import check_kind

    try:
        check_backend(backend, tp=tp, pp=pp)  # before loading any weights
        check_kind(sampler_kind)
    except InvalidInput as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    group = None
    if world_size() > 1:  # torchrun: every rank holds the trainers, rank 0 serves and broadcasts each training call
        import torch.distributed as dist

        from slime_env.trainers.distributed import init_process_group
        from slime_env.trainers.tinker import ranks

        init_process_group()
        group = ranks.command_group()
    tok = load_tokenizer(tokenizer)
    server = TinkerBackend(model, load_model(checkpoint, tok), tok, root, trainer=backend,
                           max_context_length=max_context_length, tp=tp, sampler_url=sampler_url,
                           sampler_kind=sampler_kind)
    if group is not None:
        if dist.get_rank() != 0:
            ranks.follow(server, group)
            return
        server = ranks.Leader(server, group)

    async def main() -> None:
        runner, url = await start(server, host, port)
        typer.echo(f"serving the Tinker API for {model!r} at {url} (TINKER_BASE_URL={url}; any TINKER_API_KEY)")
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass


def train(config: str = typer.Option(None, help="run config (YAML); default: the embedded demo run "
                                                "(trainers/configs/demo.yaml)"),
          steps: int = typer.Option(None, min=1, help="override the config's steps"),
          run_dir: str = typer.Option(None, help="override the config's run_dir"),
          env: str = typer.Option(None, help="override the config's env (an id, or path/to/file.py:make_env)"),
          set_: list[str] = typer.Option(None, "--set", help="override one field: KEY=VALUE, KEY a dotted path "
                                                              "(trainer.lr=1e-5, eval_data.n=4), VALUE as YAML; "
                                                              "repeatable")
          ) -> None:
    """RL training: rollouts -> TorchTrainer or MegatronTrainer -> weight sync -> held-out eval (metrics, curves)."""
    from importlib.resources import files

    from slime_env.trainers.run import TrainConfig
    from slime_env.trainers.run import train as run_train

    from slime_env.errors import InvalidInput

    path = config or str(files("slime_env.trainers") / "configs" / "demo.yaml")
    try:
        cfg = TrainConfig.from_yaml(path, set_ or (), **({"env": env} if env else {}))
    except InvalidInput as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    if steps:
        cfg.steps = steps
    if run_dir:
        cfg.run_dir = run_dir
    typer.echo(f"training {cfg.env} with {cfg.trainer.get('estimator', 'grpo')} for {cfg.steps} steps -> {cfg.run_dir}")
    summary = _run_or_exit(run_train(cfg, log=typer.echo), path)
    typer.echo(f"held-out accuracy {summary['first_accuracy']:.3f} -> {summary['last_accuracy']:.3f} in "
               f"{summary['elapsed_s']:.0f}s; curves: {summary['curves']}, metrics: {summary['metrics']}")
    import resource

    # this process's peak (the embedded engine and trainer live here; engine servers and ranks have their own logs)
    typer.echo(f"peak memory {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GB resident")


def _run_or_exit(run: Any, config: str) -> dict[str, Any]:
    """The run's summary; a config problem found as it starts (`trainers/run/preflight.py`: the model, the env, the
    data) is one `error:` line naming the file and the field, exit status 1, no traceback."""
    import asyncio

    from slime_env.errors import InvalidInput

    try:
        return asyncio.run(run)
    except InvalidInput as e:
        typer.echo(f"error: {config}: {e}", err=True)
        raise typer.Exit(1) from None


def sft(config: str = typer.Option(..., help="run config (YAML) with a warmup section: steps, lr, batch_size, data"),
        run_dir: str = typer.Option(None, help="override the config's run_dir"),
        set_: list[str] = typer.Option(None, "--set", help="override one field: KEY=VALUE (as `train --set`)")
        ) -> None:
    """Supervised fine-tuning alone: the config's `warmup` (conversations, or a teacher's successful episodes of its
    env), held-out accuracy before and after, the model saved as an HF folder a later run's `model:` can name."""

    from slime_env.trainers.run import TrainConfig
    from slime_env.trainers.run import train as run_train

    from slime_env.errors import InvalidInput

    try:
        cfg = TrainConfig.from_yaml(config, set_ or ())
        if not cfg.warmup:
            raise InvalidInput(f"{config}: slime-env sft needs a warmup section (steps, lr, batch_size, data)")
    except InvalidInput as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    if run_dir:
        cfg.run_dir = run_dir
    summary = _run_or_exit(run_train(cfg, log=typer.echo, sft_only=True), config)
    typer.echo(f"SFT done: model {summary['model']}")


def report(run_dir: str = typer.Argument(..., help="a `slime-env train` run directory"),
           out: str = typer.Option(None, help="HTML file to write (default: RUN_DIR/report.html)")) -> None:
    """Write the training report: curves, summary, config and the first/last steps' trajectories in the viewer."""
    from slime_env.trainers.run.report import write_report

    from slime_env.errors import InvalidInput

    try:
        path = write_report(run_dir, out)
    except InvalidInput as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"report: {path}")


def export(checkpoint: str = typer.Argument(..., help="a trainer checkpoint (run_dir/checkpoints/step_N) or a PEFT "
                                                      "adapter folder"),
           out: str = typer.Option(..., help="folder to write"),
           merge: bool = typer.Option(False, "--merge", help="LoRA: write the base model with the adapter merged in "
                                                             "(HF weights) instead of the adapter alone"),
           base: str = typer.Option(None, help="LoRA --merge: the base model (default: the adapter's "
                                               "base_model_name_or_path)")) -> None:
    """Write a checkpoint's weights for serving: the HF model folder, or with LoRA the PEFT adapter (loadable by peft,
    SGLang and vLLM), or with --merge the merged HF weights."""
    import shutil
    from pathlib import Path

    from slime_env.trainers.lora import adapter_folder, export_merged

    folder = adapter_folder(checkpoint)
    try:
        if folder is not None and merge:
            path = export_merged(checkpoint, out, base)
        elif folder is not None:
            path = Path(shutil.copytree(folder, out, dirs_exist_ok=True))
        elif (Path(checkpoint) / "model").is_dir():
            path = Path(shutil.copytree(Path(checkpoint) / "model", out, dirs_exist_ok=True))
        else:
            raise FileNotFoundError(f"{checkpoint} is no trainer checkpoint (model/ or adapter/)")
    except (FileNotFoundError, ValueError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"exported {'merged weights' if folder is not None and merge else 'weights'} -> {path}")
