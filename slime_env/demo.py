"""The README demo: episodes of a built-in env, printed with their loss masks visible.

`slime-env demo` drives the real SmolLM2-135M-Instruct (slime_env.agents.TransformersPolicy, built by the CLI);
`--scripted` uses `ScriptedPolicy` instead (no model, for a quick look at the ledger).
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from rich.console import Console
from rich.text import Text

from slime_env.offline_tokenizers import smollm2
from slime_env.policy import Policy, ScriptedPolicy
from slime_env.registry import make
from slime_env.renderers import get_renderer
from slime_env.runner import run_episode
from slime_env.trajectory import Trajectory


def scripted_replies(task, style: int) -> list[str]:
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


async def run_demo(env_id: str = "Calculator-v0", episodes: int = 3, seed: int = 0, *, policy: Policy | None = None,
                   tokenizer: Any = None, max_new_tokens: int = 96, max_turns: int = 3,
                   temperature: float = 0.7) -> list[Trajectory]:
    """Run `episodes` concurrent episodes and print them. Without `policy`, a scripted one is used."""
    console = Console()
    tokenizer = tokenizer or smollm2()
    renderer = get_renderer(tokenizer, strict=True)
    who = "scripted policy" if policy is None else f"{type(policy).__name__} (SmolLM2-135M-Instruct)"
    console.print(f"[bold]slime_env demo[/]: {episodes} episodes of {env_id}, {who}, renderer {renderer.family} "
                  "(strict). [bold green]green[/] = generated (loss_mask 1), [dim cyan]dim[/] = inserted by the "
                  "env or the chat template (loss_mask 0).\n")
    rng = random.Random(seed)

    async def one(i: int) -> Trajectory:
        env = make(env_id)
        try:
            task = env.sample_task(rng) or {"prompt": "What is 2 + 2?", "label": 4}
            pol = policy or ScriptedPolicy(tokenizer, scripted_replies(task, i % 3))
            return await run_episode(env, pol, task, renderer=renderer, max_turns=max_turns,
                                     max_new_tokens=max_new_tokens, metadata={"index": i},
                                     sampling_params={"temperature": temperature, "sampling_seed": seed + i})
        finally:
            await env.close()

    t0 = time.perf_counter()
    trajectories = await asyncio.gather(*(one(i) for i in range(episodes)))
    elapsed = time.perf_counter() - t0
    for i, traj in enumerate(trajectories):
        console.rule(f"episode {i}: {traj.task.prompt if isinstance(traj.task.prompt, str) else ''}")
        traj.check()
        show(console, traj, renderer)
    generated = sum(sum(t.loss_mask) for t in trajectories)
    console.print(f"[bold]{episodes} episodes in {elapsed:.1f}s[/]: {generated} generated tokens "
                  f"({generated / elapsed:.0f} tokens/s), mean reward "
                  f"{sum(t.reward for t in trajectories) / episodes:.2f}")
    return list(trajectories)
