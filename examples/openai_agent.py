"""An agent written against the plain OpenAI SDK — its own tool loop, no slime_env inside `run` — trained unchanged.

`slime-env train --config examples/agent_train.yaml` makes `make_env()` an `AgentEnv`: every episode calls
`run(base_url, api_key, task)` against its own private gateway session, which records the calls as exact token
ledgers; `score` rewards the final answer. Any agent library that takes an OpenAI `base_url` and `api_key` (OpenAI
Agents SDK, LangGraph, smolagents, ...) plugs in the same way.
"""

from __future__ import annotations

import json
import random
import re

from openai import AsyncOpenAI

SYSTEM = "You are a careful calculator. Use the add tool, then answer with <answer>N</answer>."
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]


def add(a: int, b: int) -> str:
    return str(int(a) + int(b))


async def run(base_url: str, api_key: str, task) -> str | None:
    """The agent: up to four model calls, running the tools the model asks for; returns its final text."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.prompt}]
    try:
        for _ in range(4):
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=48)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return message.content
            for call in message.tool_calls:
                try:
                    result = add(**json.loads(call.function.arguments))
                except (TypeError, ValueError) as e:
                    result = f"error: {e}"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return None
    finally:
        await client.close()


def score(task, result, trajectories) -> float:
    """1.0 for the right number (in <answer> tags, else the last number in the reply), else 0.0."""
    if not result:
        return 0.0
    tagged = re.findall(r"<answer>\s*(-?\d+)\s*</answer>", result)
    numbers = tagged or re.findall(r"-?\d+", result)
    return 1.0 if numbers and numbers[-1] == str(task.label) else 0.0


def make_env(deadline_s: float = 120.0):
    from slime_env import AgentEnv

    return AgentEnv(run, score, parser="hermes", deadline_s=deadline_s)


def tasks(n: int = 64, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(1, 20), rng.randint(1, 9)
        out.append({"prompt": f"What is {a} + {b}?", "label": str(a + b)})
    return out
