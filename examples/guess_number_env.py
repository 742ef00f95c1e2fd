"""Write your own env: a number-guessing game, registered, run, and exported to slime.

Copy this file, change `GuessEnv`, run it: `python examples/guess_number_env.py`.
"""

from __future__ import annotations

import asyncio
import random
import re

import slime_env
from slime_env import Action, Env, Message, ScriptedPolicy, Task, get_renderer, run_episode
from slime_env.offline_tokenizers import smollm2


class GuessEnv(Env):
    """The model guesses a secret number in <guess>N</guess>; the env says higher or lower."""

    def __init__(self, low: int = 1, high: int = 100):
        self.low, self.high = low, high

    def sample_task(self, rng: random.Random) -> Task:
        return Task(prompt=f"Guess my number between {self.low} and {self.high}.",
                    label=rng.randint(self.low, self.high))

    async def reset(self, *, seed=None, options=None):
        self.task = self.task_from(options, seed)  # options["task"], or a sampled one
        system = "Reply with <guess>N</guess>. I will answer 'higher', 'lower' or 'correct'."
        return self.task.messages(system=system), {}

    async def step(self, action: Action):
        m = re.search(r"<guess>\s*(-?\d+)\s*</guess>", action.text)
        if m is None:
            return [Message("user", "Please answer with <guess>N</guess>.")], 0.0, False, False, {}
        guess, secret = int(m.group(1)), int(self.task.label)
        if guess == secret:
            return [], 1.0, True, False, {"guess": guess}
        hint = "higher" if guess < secret else "lower"
        return [Message("user", hint)], 0.0, False, False, {"guess": guess}


slime_env.register("GuessNumber-v0", GuessEnv, description="guess a number with higher/lower hints")


def binary_search_player(low: int, high: int):
    """A scripted 'policy' that plays perfectly by reading the hints in the conversation."""
    def reply(context: str) -> str:
        lo, hi = low, high
        for guess, hint in re.findall(r"<guess>(\d+)</guess><\|im_end\|>\n<\|im_start\|>user\n(\w+)", context):
            if hint == "higher":
                lo = int(guess) + 1
            elif hint == "lower":
                hi = int(guess) - 1
        return f"<guess>{(lo + hi) // 2}</guess>"
    return reply


async def main() -> None:
    tokenizer = smollm2()  # the real SmolLM2-135M-Instruct tokenizer, built offline
    renderer = get_renderer(tokenizer, strict=True)
    env = slime_env.make("GuessNumber-v0", low=1, high=100)
    policy = ScriptedPolicy(tokenizer, binary_search_player(1, 100))
    traj = await run_episode(env, policy, {"prompt": "Guess my number between 1 and 100.", "label": 37},
                             renderer=renderer, max_turns=10)
    traj.check()  # ledger invariants
    print(f"status={traj.status} turns={traj.num_turns} reward={traj.reward}")
    print(f"{sum(traj.loss_mask)} generated tokens (trained on), "
          f"{len(traj.loss_mask) - sum(traj.loss_mask)} inserted tokens (masked)")
    sample = traj.to_slime_sample()  # exactly the fields of a slime Sample
    print(f"slime sample: {sample['response_length']} response tokens, status={sample['status']}")


if __name__ == "__main__":
    asyncio.run(main())
