"""`slime-env` subcommands of the ecosystem integrations: `serve-openenv` (extra `[openenv]`) and `export-verifiers`
(extra `[verifiers]`)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    app.command("serve-openenv")(serve_openenv)
    app.command("export-verifiers")(export_verifiers)


def serve_openenv(env_id: str = typer.Argument(..., help="registered env id (or pkg.mod:factory)"),
                  host: str = typer.Option("127.0.0.1", help="address to bind"),
                  port: int = typer.Option(8000, help="port (0 picks a free one)"),
                  kwargs: str = typer.Option("{}", help="env kwargs as a JSON object"),
                  max_sessions: int = typer.Option(64, min=1, help="concurrent WebSocket sessions (one env each)"),
                  session_timeout_s: float = typer.Option(600.0, help="close sessions idle this long (0: never)"),
                  ) -> None:
    """Serve an env as an OpenEnv environment (HTTP + WebSocket; OpenEnv's EnvClient, TRL, SkyRL, torchforge)."""
    import json

    from slime_env.integrations.versions import IntegrationVersionError

    try:
        env_kwargs = json.loads(kwargs)
    except ValueError as e:
        raise typer.BadParameter(f"--kwargs is not JSON: {e}") from None
    try:
        from slime_env.integrations.openenv_server import serve_openenv as serve
    except IntegrationVersionError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    serve(env_id, host=host, port=port, env_kwargs=env_kwargs, max_sessions=max_sessions,
          session_timeout_s=session_timeout_s or None)


def export_verifiers(env_id: str = typer.Argument(..., help="registered env id (or path/to/file.py:factory)"),
                     out: str = typer.Option(".", help="folder to write the package (and its pyproject.toml) into"),
                     name: str = typer.Option(None, help="package name = taskset id (default: the id in snake case)"),
                     kwargs: str = typer.Option("{}", help="env kwargs as a JSON object")) -> None:
    """Write a verifiers environment package for an env: `pip install OUT` then `vf-eval NAME`."""
    import json

    from slime_env.errors import SlimeEnvError

    try:
        from slime_env.integrations.verifiers_export import write_verifiers_package

        package = write_verifiers_package(env_id, out, name=name, env_kwargs=json.loads(kwargs))
    except (SlimeEnvError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"wrote {package} (taskset id {package.name!r}): pip install {out} && vf-eval {package.name}")
