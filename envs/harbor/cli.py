"""`slime-env harbor validate | check` (registered through `slime_env.cli`)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this package's subcommands to the `slime-env` app."""
    app.add_typer(harbor_app, name="harbor")


harbor_app = typer.Typer(add_completion=False, no_args_is_help=True,
                         help="Harbor task folders (slime_env.envs.harbor): validate, check with the oracle.")


@harbor_app.command("validate")
def harbor_validate(path: str = typer.Argument(..., help="a task folder, a folder of task folders, or a list file")
                    ) -> None:
    """Parse every task (task.toml and the folder's layout, as Harbor checks them); no container runs."""
    from slime_env.envs.harbor.task import load_task, task_dirs
    from slime_env.errors import InvalidInput

    try:
        dirs = task_dirs(path)
    except InvalidInput as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    failed = 0
    for d in dirs:
        try:
            task = load_task(d)
        except InvalidInput as e:
            failed += 1
            typer.echo(f"INVALID {d.name}: {e}")
            continue
        typer.echo(f"ok      {task.name}" + "".join(f"\n        note: {n}" for n in task.notes))
    typer.echo(f"{len(dirs) - failed} of {len(dirs)} tasks valid")
    if failed or not dirs:
        raise typer.Exit(1)


@harbor_app.command("check")
def harbor_check(path: str = typer.Argument(..., help="a task folder, a folder of task folders, or a list file"),
                 concurrency: int = typer.Option(2, min=1, help="tasks checked at once"),
                 mode: str = typer.Option(None, help="where the verifier runs: shared | isolated | separate "
                                                     "(default: each task's own)"),
                 nop: bool = typer.Option(True, help="also check that the task does not score 1 without a solution")
                 ) -> None:
    """Build each task's image, run solution/solve.sh as the agent and verify; list the tasks that do not score 1
    with their oracle (or do score 1 with no agent). Exits 1 if any does."""
    import asyncio
    import time

    from slime_env.envs.harbor.check import check_tasks
    from slime_env.envs.harbor.task import load_dataset
    from slime_env.errors import InvalidInput

    try:
        tasks = load_dataset(path)
    except InvalidInput as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None

    def show(r) -> None:
        if r.ok:
            nop_text = f", nop {r.nop.rewards or r.nop.status}" if r.nop is not None else ""
            typer.echo(f"PASS {r.task} (oracle {r.oracle.rewards}{nop_text}) {r.duration_s:.1f}s")
        else:
            typer.echo(f"FAIL {r.task}: {r.problem()}")

    t0 = time.monotonic()
    try:
        results = asyncio.run(check_tasks(tasks, concurrency=concurrency, mode=mode, nop=nop, on_result=show))
    except InvalidInput as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    failed = [r for r in results if not r.ok]
    typer.echo(f"{len(results) - len(failed)} of {len(results)} tasks pass ({time.monotonic() - t0:.0f}s)"
               + (": failing " + ", ".join(r.task for r in failed) if failed else ""))
    if failed:
        raise typer.Exit(1)
