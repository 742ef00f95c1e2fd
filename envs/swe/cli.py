"""`slime-env swe build | check` (registered through `slime_env.cli`)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this package's subcommands to the `slime-env` app."""
    app.add_typer(swe_app, name="swe")


swe_app = typer.Typer(add_completion=False, no_args_is_help=True,
                      help="SWE-style repository tasks built offline (slime_env.envs.swe).")


@swe_app.command("build")
def swe_build(out: str = typer.Option(..., help="folder for the task folders, BUILD_LOG.jsonl, BUILD_SUMMARY.json"),
              repos: str = typer.Option(None, help="comma-separated repository names (default: all of the manifest)"),
              per_repo: int = typer.Option(30, min=1, help="tasks to keep per repository"),
              seed: int = typer.Option(0, help="the seed of the candidates' order"),
              parallel: int = typer.Option(2, min=1, help="validations at once (one workspace each)"),
              max_fail_to_pass: int = typer.Option(30, min=1, help="drop bugs that fail more tests than this"),
              max_candidates: int = typer.Option(None, min=1, help="validate at most this many per repository"),
              manifest: str = typer.Option(None, help="repository manifest (default: the shipped repos.toml)")) -> None:
    """Build validated bug-fix tasks from the pinned repositories (needs Docker; see docs/agentic.md)."""
    import asyncio

    from slime_env.envs.swe.build import BuildConfig, build_dataset
    from slime_env.envs.swe.manifest import load_manifest
    from slime_env.errors import InvalidInput

    try:
        specs = load_manifest(manifest)
        names = [n.strip() for n in repos.split(",")] if repos else list(specs)
        unknown = [n for n in names if n not in specs]
        if unknown:
            raise InvalidInput(f"--repos: {', '.join(unknown)} not in the manifest (it has {', '.join(specs)})")
        config = BuildConfig(per_repo=per_repo, seed=seed, parallel=parallel, max_fail_to_pass=max_fail_to_pass,
                             max_candidates=max_candidates)
        summary = asyncio.run(build_dataset(out, [specs[n] for n in names], config, log=typer.echo))
    except InvalidInput as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"wrote {summary['tasks']} tasks to {out} in {summary['wall_s']:.0f}s: "
               + ", ".join(f"{k} {v['tasks']}" for k, v in summary["repos"].items()))


@swe_app.command("check")
def swe_check(tasks: str = typer.Argument(..., help="a task folder, or a folder of task folders"),
              limit: int = typer.Option(None, min=1, help="check at most this many tasks"),
              keep_images: bool = typer.Option(False, help="keep the task images built for the check")) -> None:
    """Run tasks end to end: build the agent's image, then the unchanged code must earn 0 and the oracle 1."""
    import asyncio
    from pathlib import Path

    from slime_env.envs.swe.check import check_task
    from slime_env.envs.swe.task import find_tasks

    root = Path(tasks)
    folders = [root] if (root / "task.toml").exists() else find_tasks(root)
    folders = folders[:limit] if limit else folders
    failed = 0
    for folder in folders:
        try:
            report = asyncio.run(check_task(folder, keep_image=keep_images))
        except Exception as e:  # noqa: BLE001 - one broken task is a FAIL line, not the end of the check
            report = {"ok": False, "nop": None, "oracle": None, "reward_s": 0.0, "why": f"{type(e).__name__}: {e}"}
        failed += not report["ok"]
        why = "" if report["ok"] else ": " + report["why"]
        typer.echo(f"{'ok  ' if report['ok'] else 'FAIL'} {folder.name}: nop {report['nop']}, oracle "
                   f"{report['oracle']} ({report['reward_s']:.1f}s per reward){why}")
    if failed:
        raise typer.Exit(1)
