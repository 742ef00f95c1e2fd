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
def demo(episodes: int = typer.Option(3, min=1, help="episodes to run"),
         env_id: str = typer.Option("Calculator-v0", "--env", help="registered env id"),
         seed: int = typer.Option(0, help="seed for the tasks")) -> None:
    """Run a few episodes with a scripted policy and the SmolLM2 tokenizer; show each token ledger."""
    import asyncio

    from slime_env.demo import run_demo

    asyncio.run(run_demo(env_id=env_id, episodes=episodes, seed=seed))


def main() -> None:
    app()
