"""Many episodes at once, across driver processes: `RolloutManager(workers=2)` on uvloop (`run_loop`).

A scripted two-turn agent plays Calculator-v0 (a tool call, then the answer) so this runs anywhere in seconds;
for a real model, pass `SGLangPolicy("http://127.0.0.1:30000")` (or `OpenAIPolicy`) as `policy` — workers need a
policy that can be copied into another process. Every group comes back whole and exactly once.

    python examples/rollout_workers.py
"""

from __future__ import annotations

import re

from slime_env import RolloutManager, ScriptedPolicy, Task, get_renderer
from slime_env.offline_tokenizers import smollm2
from slime_env.rollout import EpisodeOptions, ExecutionOptions, GroupOptions, run_loop


def agent(context: str) -> str:
    """Calls the calculator on the question, then answers with what the tool returned."""
    results = re.findall(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", context, re.DOTALL)  # SmolLM2's template
    if results:
        return f"<answer>{results[-1]}</answer>"
    expression = re.findall(r"What is (.*?)\?", context)[-1]
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


async def main() -> None:
    tok = smollm2()
    tasks = [Task(prompt=f"What is {a} * {a + 3}?", label=a * (a + 3), id=str(a)) for a in range(64)]
    manager = RolloutManager(tasks, env_id="Calculator-v0", policy=ScriptedPolicy(tok, agent),
                             renderer=get_renderer(tok), episode=EpisodeOptions(max_turns=3),
                             groups=GroupOptions(n_samples_per_prompt=8, max_concurrency=256),
                             execution=ExecutionOptions(workers=2))
    try:
        batch = await manager.generate_batch(len(tasks))
    finally:
        await manager.close()
    m = batch.metrics
    print(f"{len(batch.groups)} groups, {int(m['rollout/episodes'])} episodes, "
          f"{m['rollout/episodes_per_s']:.0f} episodes/s, completed {int(m['rollout/status/completed'])}, "
          f"mean reward {m['rollout/reward_mean/Calculator-v0']:.2f}")


if __name__ == "__main__":  # workers are spawned processes: they import this file without running main()
    run_loop(main())
