"""An agent built with the OpenAI Agents SDK (`openai-agents`: two function tools and a hand-off between two agents)
trained unchanged. The SDK's import name is `agents`, which is also this repository's engine package, so the agent
runs as its own process — as agents in sandboxes or on other hosts do — with the SDK on its path (`make test` installs
it into `.venv/openai-agents`; elsewhere `pip install --target DIR openai-agents` and set `OPENAI_AGENTS_SITE=DIR`):

    slime-env train --config examples/agent_train.yaml --env examples/openai_agents_sdk.py:make_env

Run as a script (`python -S -P examples/openai_agents_sdk.py BASE_URL API_KEY PROMPT`, the SDK on PYTHONPATH) it is
the agent: it prints its final output as JSON. Loaded by slime_env, `run` starts that process for each episode.
The score is examples/openai_agent.py's; the tasks are agent_train.yaml's (openai_agent.py's).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

SDK_SITE = os.environ.get("OPENAI_AGENTS_SITE", str(Path(__file__).resolve().parents[1] / ".venv" / "openai-agents"))


async def agent_main(base_url: str, api_key: str, prompt: str) -> str:
    """The agent, in the SDK's own terms: a triage agent hands arithmetic off to a calculator with two tools."""
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # the SDK would upload traces to OpenAI

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @function_tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    model = OpenAIChatCompletionsModel(model="policy",
                                       openai_client=AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0))
    calculator = Agent(name="calculator", model=model, tools=[add, multiply],
                       instructions="Compute with the tools, then answer with <answer>N</answer>.")
    triage = Agent(name="triage", model=model, handoffs=[calculator],
                   instructions="Hand any arithmetic question to the calculator.")
    result = await Runner.run(triage, prompt, max_turns=8)
    return str(result.final_output)


async def run(base_url: str, api_key: str, task) -> str:
    """One episode: the agent process against this episode's gateway session; its final output."""
    if not Path(SDK_SITE, "agents").is_dir():
        raise RuntimeError(f"the OpenAI Agents SDK is not in {SDK_SITE} (pip install --target {SDK_SITE} "
                           "openai-agents, or set OPENAI_AGENTS_SITE)")
    # -S: no site-packages (where this repository's `agents` package is installed); -P: not this file's folder
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-S", "-P", __file__, base_url, api_key, task.prompt,
        env={**os.environ, "PYTHONPATH": SDK_SITE}, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await proc.communicate()
    finally:
        if proc.returncode is None:  # the episode's deadline cancelled us: the agent goes too
            proc.kill()
            await proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"the agent process exited with {proc.returncode}: {err.decode()[-1500:]}")
    return json.loads(out.decode().strip().splitlines()[-1])["final_output"]


def make_env(deadline_s: float = 120.0):
    from slime_env import AgentEnv
    from slime_env.loading import load_object

    score = load_object(f"{Path(__file__).with_name('openai_agent.py')}:score")
    return AgentEnv(run, score, parser="hermes", deadline_s=deadline_s)


if __name__ == "__main__":
    final = asyncio.run(agent_main(*sys.argv[1:4]))
    print(json.dumps({"final_output": final}))
