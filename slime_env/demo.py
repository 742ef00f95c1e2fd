"""The README demo: scripted episodes of a built-in env, printed with their loss masks visible."""

from __future__ import annotations

import asyncio
import random

from rich.console import Console
from rich.text import Text

from slime_env.offline_tokenizers import smollm2
from slime_env.policy import ScriptedPolicy
from slime_env.registry import make
from slime_env.renderers import get_renderer
from slime_env.runner import run_episode
from slime_env.trajectory import Trajectory


def _script(task, style: int) -> list[str]:
    """Replies of a scripted agent for the Calculator task: a good one, a sloppy one, a guesser."""
    expr = task.metadata.get("expression", "1+1")
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>' % expr
    answer = f"The result is <answer>{task.label}</answer>"
    if style == 0:
        return ["I will use the calculator.\n" + call, answer]
    if style == 1:
        return ['<tool_call>{"name": "calculator", "arguments": {"expression": }</tool_call>', call, answer]
    return [f"I think it is <answer>{int(task.label) + 1}</answer>"]


def show(console: Console, traj: Trajectory, renderer) -> None:
    """Print a trajectory: generated tokens bright (loss_mask 1), inserted tokens dim (loss_mask 0)."""
    text = Text()
    text.append(renderer.decode(traj.prompt_ids), style="dim")
    for span in traj.spans:
        piece = renderer.decode(traj.response_ids[span.start:span.end])
        text.append(piece, style="bold green" if span.kind == "generated" else "dim cyan")
    console.print(text)
    n_gen = sum(traj.loss_mask)
    mean_lp = sum(lp for lp, m in zip(traj.rollout_logprobs, traj.loss_mask) if m) / max(1, n_gen)
    reason = f" ({traj.reason})" if traj.reason else ""
    console.print(f"[bold]status[/] {traj.status}{reason}  [bold]reward[/] {traj.reward:.2f}  "
                  f"[bold]turns[/] {traj.num_turns}  [bold]ids[/] {len(traj.prompt_ids)} prompt + "
                  f"{len(traj.response_ids)} response = [green]{n_gen} generated[/] (mask 1, mean log-prob "
                  f"{mean_lp:.2f}) + [cyan]{len(traj.loss_mask) - n_gen} inserted[/] (mask 0)\n")


async def run_demo(env_id: str = "Calculator-v0", episodes: int = 3, seed: int = 0) -> list[Trajectory]:
    console = Console()
    tokenizer = smollm2()
    renderer = get_renderer(tokenizer, strict=True)
    console.print(f"[bold]slime_env demo[/]: {episodes} episodes of {env_id}, SmolLM2 tokenizer, "
                  f"renderer {renderer.family} (strict). [bold green]green[/] = generated (loss_mask 1), "
                  "[dim cyan]dim[/] = inserted by env/template (loss_mask 0).\n")
    rng = random.Random(seed)

    async def one(i: int) -> Trajectory:
        env = make(env_id)
        try:
            task = env.sample_task(rng) or {"prompt": "What is 2 + 2?", "label": 4}
            policy = ScriptedPolicy(tokenizer, _script(task, i % 3))
            return await run_episode(env, policy, task, renderer=renderer, max_turns=4, max_new_tokens=128,
                                     metadata={"index": i})
        finally:
            await env.close()

    trajectories = await asyncio.gather(*(one(i) for i in range(episodes)))
    for i, traj in enumerate(trajectories):
        console.rule(f"episode {i}: {traj.task.prompt if isinstance(traj.task.prompt, str) else ''}")
        traj.check()
        show(console, traj, renderer)
    return list(trajectories)
