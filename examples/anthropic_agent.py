"""An agent written against the Anthropic SDK — the Messages API with `tool_use` / `tool_result` blocks, its own
tool loop, no slime_env inside `run` — trained unchanged, like examples/openai_agent.py:

    slime-env train --config examples/agent_train.yaml --env examples/anthropic_agent.py:make_env

`AgentEnv(..., api="anthropic")` hands `run` the session's root URL (the SDK adds `/v1/messages`); the gateway renders
the Messages request with the model's own chat template and records the calls as exact token ledgers. The score is
examples/openai_agent.py's; the tasks are agent_train.yaml's (openai_agent.py's).
"""

from __future__ import annotations

from pathlib import Path

from anthropic import AsyncAnthropic

from slime_env.loading import load_object

_CALC = Path(__file__).with_name("openai_agent.py")
score = load_object(f"{_CALC}:score")

SYSTEM = "You are a careful calculator. Use the add tool, then answer with <answer>N</answer>."
TOOLS = [{"name": "add", "description": "Add two integers.",
          "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "required": ["a", "b"]}}]


async def run(base_url: str, api_key: str, task) -> str | None:
    """The agent: up to four model calls, running the tools the model asks for; returns its final text."""
    client = AsyncAnthropic(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": task.prompt}]
    try:
        for _ in range(4):
            reply = await client.messages.create(model="policy", system=SYSTEM, messages=messages, tools=TOOLS,
                                                 max_tokens=48)
            messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
            uses = [b for b in reply.content if b.type == "tool_use"]
            if not uses:
                return "".join(b.text for b in reply.content if b.type == "text")
            results = []
            for use in uses:
                try:
                    result = str(int(use.input["a"]) + int(use.input["b"]))
                except (KeyError, TypeError, ValueError) as e:
                    result = f"error: {e}"
                results.append({"type": "tool_result", "tool_use_id": use.id, "content": result})
            messages.append({"role": "user", "content": results})
        return None
    finally:
        await client.close()


def make_env(deadline_s: float = 120.0):
    from slime_env import AgentEnv

    return AgentEnv(run, score, parser="hermes", deadline_s=deadline_s, api="anthropic")
