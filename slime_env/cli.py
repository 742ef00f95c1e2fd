"""The `slime-env` command line (also `python -m slime_env`): the application layer.

The core's own subcommands live here (`list`, `demo`, `serve-env`, `rollout`, `view`); every other package owns its
subcommands in its own `cli` module, declared in the `slime_env.cli` entry-point group (`name =
"package.cli:register"`) and added when the command line starts — never at `import slime_env`.
"""

from __future__ import annotations

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="slime_env: environments and token-exact trajectories for agentic RL of LLMs.")


@app.command("list")
def list_envs() -> None:
    """List the registered env ids, one per line."""
    from slime_env.registry import describe, registry_specs

    for spec in registry_specs():
        typer.echo(f"{spec.id}\t{describe(spec)}")


@app.command()
def demo(episodes: int = typer.Option(4, min=1, help="episodes to run (concurrently)"),
         env_id: str = typer.Option("Calculator-v0", "--env", help="registered env id"),
         seed: int = typer.Option(0, help="seed for tasks and sampling"),
         scripted: bool = typer.Option(False, help="use a scripted policy instead of the model"),
         max_new_tokens: int = typer.Option(96, min=1, help="new tokens per turn"),
         max_turns: int = typer.Option(3, min=1, help="turns per episode")) -> None:
    """Run episodes with the embedded SmolLM2-135M-Instruct; show each token ledger."""
    import asyncio

    from slime_env.demo import run_demo

    policy = tokenizer = None
    if not scripted:
        from slime_env.agents import TransformersPolicy, load_default_model  # lazy: the core never imports agents

        model, tokenizer = load_default_model()
        policy = TransformersPolicy(model, tokenizer, seed=seed)
    try:
        asyncio.run(run_demo(env_id=env_id, episodes=episodes, seed=seed, policy=policy, tokenizer=tokenizer,
                             max_new_tokens=max_new_tokens, max_turns=max_turns))
    finally:
        if policy is not None:
            policy.close()


@app.command("serve-env")
def serve_env(env_id: str = typer.Argument(..., help="registered env id"),
              host: str = typer.Option("127.0.0.1", help="address to bind"),
              port: int = typer.Option(8100, help="port (0 picks a free one)"),
              kwargs: str = typer.Option("{}", help="env kwargs as a JSON object"),
              max_sessions: int = typer.Option(1024, min=1, help="open sessions at most ('at capacity' beyond)"),
              idle_timeout_s: float = typer.Option(600.0, help="close sessions idle this long (0: never)"),
              request_timeout_s: float = typer.Option(300.0, help="longest reset/step before a 504")) -> None:
    """Serve a registered env over HTTP for `slime_env.RemoteEnv` (sessions: create/reset/step/close)."""
    import json

    from slime_env.rollout.env_server import serve

    try:
        env_kwargs = json.loads(kwargs)
    except ValueError as e:
        raise typer.BadParameter(f"--kwargs is not JSON: {e}") from None
    serve(env_id, host=host, port=port, env_kwargs=env_kwargs, max_sessions=max_sessions,
          idle_timeout_s=idle_timeout_s or None, request_timeout_s=request_timeout_s)


def policy_and_tokenizer(spec: str, tokenizer: str, seed: int):
    """'default' | 'sglang://host:port' | 'openai://host:port/v1?model=NAME' -> (policy, tokenizer)."""
    from urllib.parse import parse_qs, urlsplit

    tok = None
    if tokenizer != "default":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer)
    if spec == "default":
        from slime_env.agents import TransformersPolicy, load_default_model  # lazy: the core never imports agents

        model, default_tok = load_default_model()
        return TransformersPolicy(model, default_tok, seed=seed), tok or default_tok
    from slime_env.offline_tokenizers import smollm2

    parts = urlsplit(spec)
    if parts.scheme == "sglang":
        from slime_env.clients import SGLangPolicy

        return SGLangPolicy(f"http://{parts.netloc}"), tok or smollm2()
    if parts.scheme == "openai":
        from slime_env.clients import OpenAIPolicy

        model = (parse_qs(parts.query).get("model") or [""])[0]
        return OpenAIPolicy(f"http://{parts.netloc}{parts.path}", model), tok or smollm2()
    raise typer.BadParameter(f"--policy {spec!r}: use default, sglang://HOST:PORT or openai://HOST:PORT/v1?model=M")


@app.command()
def rollout(env: str = typer.Option(..., help="registered env id (tasks may override with metadata.env_id)"),
            data: str = typer.Option(..., help="tasks: .jsonl or .parquet"),
            out: str = typer.Option(..., help="output directory (groups.jsonl, manifest.json)"),
            policy: str = typer.Option("default", help="default | sglang://HOST:PORT | openai://HOST:PORT/v1?model=M"),
            tokenizer: str = typer.Option("default", help="'default' (SmolLM2) or a tokenizer folder"),
            n: int = typer.Option(8, min=1, help="samples per prompt (group size)"),
            batch_size: int = typer.Option(16, min=1, help="groups per batch"),
            concurrency: int = typer.Option(64, min=1, help="episodes in flight at most"),
            max_turns: int = typer.Option(4, min=1), max_new_tokens: int = typer.Option(256, min=1),
            temperature: float = typer.Option(1.0, min=0.0),
            dynamic_filter: str = typer.Option(None, "--filter", help="e.g. nonzero_std, or pkg.mod:fn"),
            input_key: str = typer.Option("prompt"), label_key: str = typer.Option("label"),
            metadata_key: str = typer.Option("metadata"),
            resume: bool = typer.Option(False, help="continue the rollout already in --out"),
            parquet: bool = typer.Option(False, help="also write one Parquet file per batch"),
            workers: int = typer.Option(0, min=0, help="driver processes running the groups (0: this one); "
                                                        "needs a remote --policy"),
            seed: int = typer.Option(0)) -> None:
    """Run the rollout manager over a dataset and write the trajectories."""
    import asyncio

    from slime_env.errors import InvalidInput
    from slime_env.renderers import get_renderer
    from slime_env.rollout import (EpisodeOptions, ExecutionOptions, GroupOptions, RolloutManager, StoreOptions,
                                   load_tasks)
    from slime_env.rollout.loop import run_loop

    tasks = load_tasks(data, input_key=input_key, label_key=label_key, metadata_key=metadata_key)
    pol, tok = policy_and_tokenizer(policy, tokenizer, seed)
    try:
        manager = RolloutManager(
            tasks, env_id=env, policy=pol, renderer=get_renderer(tok), sampling_params={"temperature": temperature},
            seed=seed, episode=EpisodeOptions(max_turns=max_turns, max_new_tokens=max_new_tokens),
            groups=GroupOptions(n_samples_per_prompt=n, max_concurrency=max(concurrency, n),
                                dynamic_filter=dynamic_filter),
            store=StoreOptions(out_dir=out, resume=resume, parquet=parquet),
            execution=ExecutionOptions(progress=True, workers=workers))
    except InvalidInput as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None

    async def main() -> None:
        try:
            while manager.remaining():
                batch = await manager.generate_batch(min(batch_size, manager.remaining()))
                m = batch.metrics
                statuses = ", ".join(f"{k}={int(m['rollout/status/' + k])}" for k in STATUS_KEYS)
                reward = m.get(f"rollout/reward_mean/{env}", float("nan"))
                typer.echo(f"batch {manager.batches}: {len(batch.groups)} groups ({len(batch.dropped)} dropped), "
                           f"{m['rollout/episodes_per_s']:.1f} episodes/s, {m['rollout/tokens_per_s']:.0f} tokens/s, "
                           f"reward {reward:.3f}, status {statuses}")
                if not batch.groups and not batch.dropped:
                    break
        finally:
            await manager.close()
            if hasattr(pol, "close"):
                result = pol.close()
                if asyncio.iscoroutine(result):
                    await result
        typer.echo(f"wrote {out}/groups.jsonl")

    run_loop(main())


STATUS_KEYS = ("completed", "truncated", "aborted", "failed", "infra_error")


@app.command()
def view(path: str = typer.Argument(..., help="a rollout directory (groups.jsonl), a `slime-env train` run directory, "
                                              "or a trajectories .jsonl / .parquet file"),
         out: str = typer.Option(None, help="HTML file to write (default: view.html in the directory, or FILE.html)"),
         tokenizer: str = typer.Option(None, help="how to cut ids into tokens: default | qwen2.5 | qwen3 | llama3.1 | "
                                                  "llama3.2 | deepseek_r1 | none | a tokenizer folder (default: the "
                                                  "run's model, else SmolLM2)"),
         port: int = typer.Option(None, help="also serve the page on http://127.0.0.1:PORT until Ctrl-C")) -> None:
    """Write a self-contained HTML viewer of trajectories: turns, the token ledger, log-probs, groups, agents."""
    from slime_env.errors import InvalidInput
    from slime_env.viewer import build_view

    try:
        target, loaded = build_view(path, out, tokenizer=tokenizer)
    except InvalidInput as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    for warning in loaded.warnings:
        typer.echo(f"warning: {warning}", err=True)
    typer.echo(f"{len(loaded.episodes)} episodes -> {target}")
    if port is not None:
        import functools
        import http.server

        handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(target.parent.resolve()))
        with http.server.ThreadingHTTPServer(("127.0.0.1", port), handler) as server:
            typer.echo(f"serving http://127.0.0.1:{server.server_address[1]}/{target.name} (Ctrl-C to stop)")
            try:
                server.serve_forever()
            except KeyboardInterrupt:
                pass


def _register_package_commands() -> None:
    from importlib.metadata import entry_points

    from slime_env.loading import load_object

    for ep in sorted(entry_points(group="slime_env.cli"), key=lambda e: e.name):
        load_object(ep.value)(app)


def main() -> None:
    from slime_env.lifeline import hold_lifeline
    from slime_env.malloc_tuning import tune_malloc

    hold_lifeline()  # started by a run as one of its processes (an engine, a gateway): die with it
    tune_malloc()  # before torch starts its threads: a training run's memory stays flat across steps
    _register_package_commands()
    app()
