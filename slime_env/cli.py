"""The `slime-env` command line (also `python -m slime_env`). Later issues add subcommands here."""

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
        from agents import TransformersPolicy, load_default_model  # lazy: the core never imports agents

        model, tokenizer = load_default_model()
        policy = TransformersPolicy(model, tokenizer, seed=seed)
    try:
        asyncio.run(run_demo(env_id=env_id, episodes=episodes, seed=seed, policy=policy, tokenizer=tokenizer,
                             max_new_tokens=max_new_tokens, max_turns=max_turns))
    finally:
        if policy is not None:
            policy.close()


@app.command("serve-engine")
def serve_engine(model: str = typer.Option("default", help="'default' (embedded SmolLM2-135M-Instruct) or a "
                                                           "Hugging Face model folder"),
                 host: str = typer.Option("127.0.0.1", help="address to bind"),
                 port: int = typer.Option(30000, help="port (0 picks a free one)"),
                 max_batch_size: int = typer.Option(16, min=1, help="requests generated together"),
                 batch_window_ms: float = typer.Option(
                     20.0, min=0, help="how long to wait to fill a batch (HTTP requests arrive spread out)")) -> None:
    """Serve a local transformers model through SGLang's native HTTP API (/generate, ...)."""
    from agents.engine_server import serve

    serve(model=model, host=host, port=port, max_batch_size=max_batch_size, batch_window_s=batch_window_ms / 1000)


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


def main() -> None:
    app()
