"""`slime-env harbor validate | check | eval` (registered through `slime_env.cli`)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this package's subcommands to the `slime-env` app."""
    app.add_typer(harbor_app, name="harbor")


harbor_app = typer.Typer(add_completion=False, no_args_is_help=True,
                         help="Harbor task folders (slime_env.envs.harbor): validate, check with the oracle, "
                              "evaluate a policy.")


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


def _mode(mode: str | None) -> str | None:
    """`--mode` checked before anything starts; `shared` is run only when named, with a warning on stderr."""
    from slime_env.envs.harbor.verifier import MODES, SHARED_WARNING

    if mode is not None and mode not in MODES:
        raise typer.BadParameter(f"--mode {mode!r}: must be one of {', '.join(MODES)} (or left out: a fresh container)")
    if mode == "shared":
        typer.echo(f"WARNING: {SHARED_WARNING}", err=True)
    return mode


MODE_HELP = ("where the verifier runs: isolated | separate | shared (default: a fresh container, the task's own "
             "separate verifier if it asks for one, else isolated; shared only when named: an agent that ran as root "
             "can fake the verdict there)")


@harbor_app.command("check")
def harbor_check(path: str = typer.Argument(..., help="a task folder, a folder of task folders, or a list file"),
                 concurrency: int = typer.Option(2, min=1, help="tasks checked at once"),
                 mode: str = typer.Option(None, help=MODE_HELP),
                 nop: bool = typer.Option(True, help="also check that the task does not score 1 without a solution")
                 ) -> None:
    """Build each task's image, run solution/solve.sh as the agent and verify; list the tasks that do not score 1
    with their oracle (or do score 1 with no agent), and every task that is not valid. Exits 1 if any does."""
    import asyncio
    import time

    from slime_env.envs.harbor.check import check_tasks
    from slime_env.envs.harbor.task import load_task, task_dirs
    from slime_env.errors import InvalidInput

    mode = _mode(mode)
    try:
        dirs = task_dirs(path)
    except InvalidInput as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    # every task is read before any is checked, and an invalid one is reported beside the others, as `validate`
    # reports them (one bad task.toml does not hide the verdicts of the rest)
    tasks, invalid = [], []
    for d in dirs:
        try:
            tasks.append(load_task(d))
        except InvalidInput as e:
            invalid.append(d.name)
            typer.echo(f"INVALID {d.name}: {e}")

    def show(r) -> None:
        if r.ok:
            nop_text = f", nop {r.nop.rewards or r.nop.status}" if r.nop is not None else ""
            typer.echo(f"PASS {r.task} (oracle {r.oracle.rewards}{nop_text}) {r.duration_s:.1f}s")
        else:
            typer.echo(f"FAIL {r.task}: {r.problem()}")
        for agent, result in (("oracle", r.oracle), ("nop", r.nop)):
            for line in (result.dropped if result is not None else ()):
                typer.echo(f"     dropped ({agent}): {line}")

    t0 = time.monotonic()
    try:
        results = asyncio.run(check_tasks(tasks, concurrency=concurrency, mode=mode, nop=nop, on_result=show)) \
            if tasks else []
    except InvalidInput as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    failed = invalid + [r.task for r in results if not r.ok]
    typer.echo(f"{len(results) + len(invalid) - len(failed)} of {len(results) + len(invalid)} tasks pass "
               f"({time.monotonic() - t0:.0f}s)" + (": failing " + ", ".join(failed) if failed else ""))
    if failed or not dirs:
        raise typer.Exit(1)


@harbor_app.command("eval")
def harbor_eval(path: str = typer.Argument(..., help="a task folder, a folder of task folders, or a list file"),
                policy: str = typer.Option("default", help="default | sglang://HOST:PORT | openai://HOST:PORT/v1?model=M"),
                tokenizer: str = typer.Option("default", help="'default' (SmolLM2) or a tokenizer folder"),
                samples: int = typer.Option(4, min=1, help="episodes per task (n of pass@k)"),
                k: list[int] = typer.Option([1], help="report pass@k for these k (k <= samples)"),
                mode: str = typer.Option(None, help=MODE_HELP),
                concurrency: int = typer.Option(8, min=1, help="episodes in flight at most"),
                max_turns: int = typer.Option(20, min=1), max_new_tokens: int = typer.Option(512, min=1),
                temperature: float = typer.Option(1.0, min=0.0),
                out: str = typer.Option(None, help="write groups.jsonl, summary.json (and ATIF files) here"),
                atif: bool = typer.Option(False, help="also write each episode as Harbor's ATIF JSON under OUT/atif"),
                seed: int = typer.Option(0)) -> None:
    """Run a policy over a Harbor dataset (`samples` episodes per task, verified as `mode` says) and report the mean
    reward and pass@k (the unbiased estimator over the samples; solved: reward 1)."""
    import json
    from pathlib import Path

    from slime_env.cli import policy_and_tokenizer
    from slime_env.envs.harbor.atif import write_atif
    from slime_env.envs.harbor.env import HarborEnv, harbor_tasks
    from slime_env.errors import InvalidInput
    from slime_env.renderers import get_renderer
    from slime_env.rollout import RolloutManager
    from slime_env.rollout.loop import run_loop
    from slime_env.trainers.run.evaluation import pass_at_k

    if any(not 1 <= x <= samples for x in k):
        raise typer.BadParameter(f"--k {k}: each k must be in [1, --samples={samples}]")
    mode = _mode(mode)
    try:
        tasks = harbor_tasks(path)
    except InvalidInput as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    pol, tok = policy_and_tokenizer(policy, tokenizer, seed)
    manager = RolloutManager(tasks, policy=pol, renderer=get_renderer(tok), env_id="Harbor-v0",
                             env_factory=lambda task, _: HarborEnv(mode=mode, max_turns=max_turns),
                             sampling_params={"temperature": temperature}, n_samples_per_prompt=samples,
                             max_concurrency=max(concurrency, samples), max_turns=max_turns,
                             max_new_tokens=max_new_tokens, out_dir=out, progress=True, seed=seed)
    groups = []

    async def main() -> None:
        try:
            while manager.remaining():
                batch = await manager.generate_batch(min(8, manager.remaining()))
                groups.extend(batch.groups)
                if not batch.groups and not batch.dropped:
                    break
        finally:
            await manager.close()

    run_loop(main())
    rows, totals = [], {x: 0.0 for x in k}
    for g in groups:
        name = g.task.metadata["name"]
        rewards = [t.reward for t in g.trajectories]
        solved = sum(r >= 1.0 for r in rewards)
        row = {"task": name, "rewards": rewards, "statuses": [t.status for t in g.trajectories],
               **{f"pass@{x}": pass_at_k(len(rewards), solved, x) for x in k}}
        rows.append(row)
        for x in k:
            totals[x] += row[f"pass@{x}"]
        typer.echo(f"{name:32s} solved {solved}/{len(rewards)}  mean reward {sum(rewards) / len(rewards):.2f}")
        if out and atif:
            (Path(out) / "atif" / name).mkdir(parents=True, exist_ok=True)
            for i, t in enumerate(g.trajectories):
                write_atif(t, Path(out) / "atif" / name / f"{i}.json")
    n = max(1, len(rows))
    summary = {"tasks": len(rows), "samples": samples, "mode": mode or "fresh (isolated, or the task's separate)",
               "mean_reward": sum(sum(r["rewards"]) / len(r["rewards"]) for r in rows) / n,
               **{f"pass@{x}": totals[x] / n for x in k}, "per_task": rows}
    typer.echo(", ".join(f"pass@{x} {summary[f'pass@{x}']:.3f}" for x in k)
               + f", mean reward {summary['mean_reward']:.3f} over {len(rows)} tasks")
    if out:
        Path(out, "summary.json").write_text(json.dumps(summary, indent=1))
