"""LangGraph's prebuilt ReAct agent on `langchain-openai`'s ChatOpenAI — a framework's agent, its graph and tool
node untouched — trained unchanged, like examples/openai_agent.py:

    slime-env train --config examples/agent_train.yaml --env examples/langgraph_agent.py:make_env

The only thing pointed at slime_env is ChatOpenAI's `base_url` / `api_key` (the episode's private gateway session).
The score is examples/openai_agent.py's; the tasks are agent_train.yaml's (openai_agent.py's).
"""

from __future__ import annotations

from pathlib import Path

from slime_env.loading import load_object

_CALC = Path(__file__).with_name("openai_agent.py")
score = load_object(f"{_CALC}:score")

SYSTEM = "You are a careful calculator. Use the add tool, then answer with <answer>N</answer>."


async def run(base_url: str, api_key: str, task) -> str | None:
    """The agent: LangGraph's ReAct loop (at most four model calls); returns the last message's text."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.errors import GraphRecursionError
    from langgraph.prebuilt import create_react_agent

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    llm = ChatOpenAI(model="policy", base_url=base_url, api_key=api_key, max_tokens=48, max_retries=0)
    agent = create_react_agent(llm, [add], prompt=SYSTEM)
    try:
        state = await agent.ainvoke({"messages": [("user", task.prompt)]}, {"recursion_limit": 8})
    except GraphRecursionError:  # the model kept calling tools: no final answer
        return None
    return state["messages"][-1].content


def make_env(deadline_s: float = 120.0):
    from slime_env import AgentEnv

    return AgentEnv(run, score, parser="hermes", deadline_s=deadline_s)
