"""`slime-env sandbox build-image | cleanup | info | run`, `slime-env workspace build-base | reap` and
`slime-env serve-sandbox` (registered through `slime_env.cli`)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this package's subcommands to the `slime-env` app."""
    app.add_typer(sandbox_app, name="sandbox")
    app.add_typer(workspace_app, name="workspace")
    app.command("serve-sandbox")(serve_sandbox)


sandbox_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Sandboxed code execution (tools_sandbox).")


def _sandbox(backend: str, max_concurrency: int | None):
    from slime_env.tools_sandbox import auto  # lazy: the core never imports tools_sandbox at import time

    common = {"max_concurrency": max_concurrency} if max_concurrency else {}
    return auto(None if backend == "auto" else backend, shared=False, **common)


@sandbox_app.command("build-image")
def sandbox_build_image(tag: str = typer.Option("slime-env-sandbox:py3", help="image name:tag"),
                        method: str = typer.Option("auto", help="auto | dockerfile | mmdebstrap"),
                        suite: str = typer.Option("bookworm", help="Debian suite for mmdebstrap"),
                        mirror: str = typer.Option(None, help="Debian mirror URL for mmdebstrap")) -> None:
    """Build the local Python sandbox image (Dockerfile if a registry answers, else mmdebstrap + docker import)."""
    from slime_env.tools_sandbox.image import build_image
    from slime_env.tools_sandbox.types import SandboxError

    try:
        used = build_image(tag, method=method, suite=suite, mirror=mirror, log=typer.echo)
    except SandboxError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"built {tag} ({used})")


@sandbox_app.command("cleanup")
def sandbox_cleanup(all_owners: bool = typer.Option(False, "--all", help="also containers of live processes")) -> None:
    """Remove sandbox containers left behind by crashed processes."""
    from slime_env.tools_sandbox import cleanup

    typer.echo(f"removed {cleanup(all_owners=all_owners)} container(s)")


@sandbox_app.command("info")
def sandbox_info(runs: int = typer.Option(5, help="timed runs of a one-line program per working backend (0: none)")
                 ) -> None:
    """Which backend `slime_env.tools_sandbox.auto()` picks here and why stronger ones were skipped;
    each backend's latency."""
    import asyncio
    import statistics
    import time

    from slime_env.tools_sandbox.auto import BACKENDS, auto, make_sandbox
    from slime_env.tools_sandbox.types import SandboxError

    chosen = auto(shared=False)
    typer.echo(f"auto() picks: {chosen.backend} ({chosen.describe()})")
    for note in getattr(chosen, "auto_notes", []):
        typer.echo(f"  skipped {note}")

    async def latency(sandbox) -> float:
        await sandbox.run("print(1)", "python")  # warm: images, fork servers
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            await sandbox.run("print(1)", "python")
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    async def main() -> None:
        await chosen.close()
        for name in BACKENDS:
            try:
                sandbox = make_sandbox(name, {})
            except SandboxError as e:
                typer.echo(f"{name:8s} unavailable: {e}")
                continue
            try:
                typer.echo(f"{name:8s} p50 {await latency(sandbox) * 1000:.1f} ms per run" if runs else f"{name:8s} ok")
            finally:
                await sandbox.close()

    asyncio.run(main())


@sandbox_app.command("run")
def sandbox_run(file: str = typer.Argument(..., help="code file to run ('-' reads stdin)"),
                language: str = typer.Option("python"), backend: str = typer.Option("auto"),
                timeout_s: float = typer.Option(10.0), memory_mb: int = typer.Option(512)) -> None:
    """Run one file in the sandbox and print the ExecResult as JSON."""
    import asyncio
    import json
    import sys

    code = sys.stdin.read() if file == "-" else open(file).read()

    async def main():
        sandbox = _sandbox(backend, None)
        try:
            return await sandbox.run(code, language, timeout_s=timeout_s, memory_mb=memory_mb)
        finally:
            await sandbox.close()

    typer.echo(json.dumps(asyncio.run(main()).to_dict(), indent=1))


def serve_sandbox(host: str = typer.Option("127.0.0.1", help="address to bind"),
                  port: int = typer.Option(8080, help="port (0 picks a free one)"),
                  backend: str = typer.Option("auto", help="auto | docker | bwrap | process"),
                  max_concurrency: int = typer.Option(None, help="runs executing at once (default: the backend's)"),
                  queue_timeout_s: float = typer.Option(30.0, help="503 after waiting this long for a slot")) -> None:
    """Serve a sandbox with SandboxFusion's POST /run_code API (plus GET /health)."""
    from slime_env.tools_sandbox.server import serve

    serve(_sandbox(backend, max_concurrency), host=host, port=port, max_concurrency=max_concurrency,
          queue_timeout_s=queue_timeout_s)


workspace_app = typer.Typer(add_completion=False, no_args_is_help=True,
                            help="Per-episode workspaces (slime_env.tools_sandbox.workspace): base images, reaper.")


@workspace_app.command("build-base")
def workspace_build_base(tags: list[str] = typer.Argument(..., help="public image tags, e.g. python:3.11-slim"),
                         force: bool = typer.Option(False, help="rebuild even if the host has the tag")) -> None:
    """Build local stand-ins for public base images (from Debian's / Ubuntu's archives) so that unchanged
    Dockerfiles `FROM` them build on a host without an image registry."""
    from slime_env.tools_sandbox.workspace.base_images import build_base_image, ensure_base_image
    from slime_env.tools_sandbox.workspace.types import WorkspaceError

    for tag in tags:
        try:
            if force:
                build_base_image(tag, log=typer.echo)
                typer.echo(f"built {tag}")
            else:
                typer.echo(f"built {tag}" if ensure_base_image(tag, log=typer.echo) else f"{tag}: already here")
        except WorkspaceError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(1) from None


@workspace_app.command("reap")
def workspace_reap(run_id: str = typer.Option(None, "--run", help="remove every workspace of this run id"),
                   all_owners: bool = typer.Option(False, "--all", help="also workspaces of live processes")) -> None:
    """Remove workspaces (containers, snapshots) whose owner process is gone."""
    from slime_env.tools_sandbox.workspace.docker import reap

    removed = reap(run_id=run_id, all_owners=all_owners)
    typer.echo(f"removed {removed['containers']} container(s), {removed['images']} snapshot image(s), "
               f"{removed['networks']} network(s)")
