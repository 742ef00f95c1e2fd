"""Math envs: `Math-v0` (verified single answer), `MathTool-v0` (Python tool in the sandbox),
`ReasoningGym-v0` (reasoning-gym generators and scorers).

Building blocks, reusable on their own: `extract_answer` (boxed / <answer> / Answer: / ####),
`MathVerifier` (math-verify in killable worker processes), `MathReward` (1/0, ±1, format penalty,
</think> requirement; `slime_reward` / `slime_group_reward` for slime's --custom-rm-path),
`load_math_tasks` (slime, chat, GSM8K and MATH layouts), `reasoning_gym_tasks` / `write_tasks_jsonl`.
"""

from slime_env.envs.math.data import load_math_tasks, math_row_to_task
from slime_env.envs.math.extract import FORMATS, extract_answer, gold_answer
from slime_env.envs.math.rewards import MathReward, slime_group_reward, slime_reward
from slime_env.envs.math.verifier import MathVerifier, Verdict, check, shared_verifier

__all__ = ["FORMATS", "MathReward", "MathVerifier", "Verdict", "check", "extract_answer", "gold_answer",
           "load_math_tasks", "math_row_to_task", "shared_verifier", "slime_group_reward", "slime_reward"]
