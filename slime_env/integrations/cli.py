"""`slime-env` subcommands of the ecosystem integrations: `serve-openenv` (extra `[openenv]`)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    app.command("serve-openenv")(serve_openenv)


def serve_openenv(env_id: str = typer.Argument(..., help="registered env id (or pkg.mod:factory)"),
                  host: str = typer.Option("127.0.0.1", help="address to bind"),
                  port: int = typer.Option(8000, help="port (0 picks a free one)"),
                  kwargs: str = typer.Option("{}", help="env kwargs as a JSON object"),
                  max_sessions: int = typer.Option(64, min=1, help="concurrent WebSocket sessions (one env each)"),
                  session_timeout_s: float = typer.Option(600.0, help="close sessions idle this long (0: never)")) -> None:
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
