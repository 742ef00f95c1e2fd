"""Math envs end to end with a scripted policy: a verified answer, a Python tool call, reasoning-gym.

    python examples/math_envs.py
"""

import asyncio
import tempfile

from slime_env.envs.math.reasoning_gym_env import write_tasks_jsonl

import slime_env
from slime_env import ScriptedPolicy, get_renderer, load_tasks, run_episode
from slime_env.offline_tokenizers import smollm2


async def main() -> None:
    tok = smollm2()
    renderer = get_renderer(tok)

    # 1. Math-v0: one answer, checked by math-verify (3/4 == 0.75).
    traj = await run_episode(slime_env.make("Math-v0"), ScriptedPolicy(tok, ["1/2 + 1/4 = \\boxed{\\frac{3}{4}}"]),
                             {"prompt": "What is 1/2 + 1/4?", "label": "0.75"}, renderer=renderer)
    print(f"Math-v0       reward={traj.reward} verdict={traj.info['verdict']}")

    # 2. MathTool-v0: the model runs Python in the sandbox, reads the (masked) output, answers.
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(sum(i*i for i in range(11)))"}}</tool_call>'
    traj = await run_episode(slime_env.make("MathTool-v0"), ScriptedPolicy(tok, [call, "So \\boxed{385}."]),
                             {"prompt": "Sum of squares of 0..10?", "label": 385}, renderer=renderer, max_turns=4)
    masked = sum(1 for m in traj.loss_mask if m == 0)
    tool_output = next(m.content for m in traj.messages if m.role == "tool")
    print(f"MathTool-v0   reward={traj.reward} turns={traj.num_turns} tool output={tool_output!r} "
          f"({masked} of {len(traj.loss_mask)} response tokens masked)")

    # 3. ReasoningGym-v0: tasks written to JSONL (for the rollout manager), scored by reasoning-gym.
    with tempfile.TemporaryDirectory() as tmp:
        task = load_tasks(write_tasks_jsonl(f"{tmp}/rg.jsonl", "basic_arithmetic", size=3, seed=0))[0]
    traj = await run_episode(slime_env.make("ReasoningGym-v0"), ScriptedPolicy(tok, [f"<answer>{task.label}</answer>"]),
                             task, renderer=renderer)
    print(f"ReasoningGym  {task.prompt[:40]!r}... reward={traj.reward}")


if __name__ == "__main__":
    asyncio.run(main())
