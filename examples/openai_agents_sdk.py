"""An agent built with the OpenAI Agents SDK (`openai-agents`: two function tools and a hand-off between two agents)
trained unchanged, in the same process as the gateway (the SDK imports as `agents`; ours as `slime_env.agents`):

    slime-env train --config examples/agent_train.yaml --env examples/openai_agents_sdk.py:make_env

The score is examples/openai_agent.py's; the tasks are agent_train.yaml's (openai_agent.py's).
"""

from __future__ import annotations

from pathlib import Path


async def run(base_url: str, api_key: str, task) -> str:
    """One episode against this episode's gateway session, in the SDK's own terms: a triage agent hands arithmetic off
    to a calculator with two tools; its final output."""
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
    result = await Runner.run(triage, task.prompt, max_turns=8)
    return str(result.final_output)


def make_env(deadline_s: float = 120.0):
    from slime_env import AgentEnv
    from slime_env.loading import load_object

    score = load_object(f"{Path(__file__).with_name('openai_agent.py')}:score")
    return AgentEnv(run, score, parser="hermes", deadline_s=deadline_s)

