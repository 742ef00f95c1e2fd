"""`slime-env harness run NAME TASK` (registered through `slime_env.cli`): one episode of a harness on a Harbor task
folder through a gateway on 127.0.0.1 over the given policy; prints the outcome and the ledger's size."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this package's subcommands to the `slime-env` app."""
    app.add_typer(harness_app, name="harness")


harness_app = typer.Typer(add_completion=False, no_args_is_help=True,
                          help="Coding-agent CLIs (claude-code, codex, opencode, mini-swe-agent) as episode agents.")


@harness_app.callback()
def harness_group() -> None:
    """Coding-agent CLIs as episode agents (a group, so `run` stays a subcommand beside future ones)."""


@harness_app.command("run")
def harness_run(name: str = typer.Argument(..., help="claude-code | codex | opencode | mini-swe-agent"),
                task: str = typer.Argument(..., help="a Harbor task folder"),
                policy: str = typer.Option("default", help="default | sglang://HOST:PORT | openai://HOST:PORT/v1?model=M"),
                tokenizer: str = typer.Option("default", help="'default' (SmolLM2) or a tokenizer folder"),
                parser: str = typer.Option("hermes", help="the model family's tool-call parser"),
                max_turns: int = typer.Option(8, min=1), max_output_tokens: int = typer.Option(512, min=1),
                timeout_s: float = typer.Option(600.0, min=1.0),
                mode: str = typer.Option(None, help="the verifier's mode (default: a fresh container)"),
                backend: str = typer.Option("docker", help="docker | bwrap"),
                out: str = typer.Option(None, help="write the episode's trajectories here (JSON)"),
                seed: int = typer.Option(0)) -> None:
    """Run one episode of harness NAME on TASK and print its status, reward, verifier and ledger."""
    import asyncio
    import json
    from pathlib import Path

    from slime_env import Task
    from slime_env.cli import policy_and_tokenizer
    from slime_env.errors import InvalidInput
    from slime_env.gateway import Gateway
    from slime_env.renderers import get_renderer
    from slime_env.envs.harbor import load_task
    from slime_env.envs.harness import HarnessEnv

    try:
        ht = load_task(task)
        env = HarnessEnv(name, max_turns=max_turns, max_output_tokens=max_output_tokens, timeout_s=timeout_s,
                         mode=mode, backend=backend, parser=parser)
    except InvalidInput as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    pol, tok = policy_and_tokenizer(policy, tokenizer, seed)

    async def main():
        gw = Gateway(pol, get_renderer(tok, strict=True), parser, strict=True, max_new_tokens=max_output_tokens)
        await gw.start()
        try:
            return await env.run(gw, Task.coerce({"prompt": ht.instruction,
                                                  "metadata": {"harbor_task": str(ht.path), "name": ht.name}}, "task"))
        finally:
            await gw.stop()

    trajectories = asyncio.run(main())
    main_t = trajectories[0]
    verdict = (main_t.metadata.get("workspace") or {}).get("harbor") or {}
    typer.echo(f"{name} on {ht.name}: status {main_t.status}, reward {main_t.reward}"
               + (f" ({main_t.reason})" if main_t.reason else ""))
    typer.echo(f"verifier: {verdict.get('status', 'not run')} ({verdict.get('mode', '-')}); "
               f"{len(trajectories)} branch(es), {sum(t.num_turns for t in trajectories)} model calls, "
               f"{sum(sum(t.loss_mask) for t in trajectories)} generated tokens")
    if out:
        Path(out).write_text(json.dumps([t.to_dict() for t in trajectories]))
    if main_t.status == "infra_error":
        raise typer.Exit(3)
