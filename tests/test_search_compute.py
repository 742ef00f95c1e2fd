"""SearchCompute-v0 and the ready-made tools (search, python, calculator) through a whole episode."""

from __future__ import annotations

import asyncio
import json
import re

import gymnasium
import pytest
from slime_env.envs.search.compute_env import count_word, numeric_facts, search_compute_tasks
from slime_env.envs.search.corpus import demo_corpus
from slime_env.envs.tools import calculator_tool, search_tool

import slime_env
from slime_env import ScriptedPolicy, ToolError, get_renderer, run_episode
from sandbox_support import make_sandbox


def test_tasks_are_answerable_from_the_corpus():
    tasks = search_compute_tasks(60, seed=3)
    assert tasks == search_compute_tasks(60, seed=3) and len({t.id for t in tasks}) == 60
    passages = {p.id: p for p in demo_corpus()}
    facts = {f.passage_id: f for f in numeric_facts()}
    kinds = set()
    for t in tasks:
        if t.metadata["expression"].startswith("count("):
            kinds.add("count")
            word = re.search(r'the word "(\w+)"', t.prompt).group(1)
            passage = passages[t.metadata["passages"][0]]
            assert _opening(t) in " ".join(passage.text.split())
            assert str(count_word(word, passage.text)) == t.label
        else:
            kinds.add("arithmetic")
            assert all(p in facts for p in t.metadata["passages"])
            assert str(eval(t.metadata["expression"])) == t.label  # noqa: S307 - our own digits and operators
    assert kinds == {"count", "arithmetic"}


def test_ready_made_tools_report_errors_in_their_own_words():
    async def main():
        calc, search = calculator_tool(), search_tool()
        assert await calc.call({"expression": "6 * 7"}, {}) == "42"
        with pytest.raises(ToolError, match="division by zero"):
            await calc.call({"expression": "1/0"}, {})
        with pytest.raises(ToolError, match="empty"):
            await search.call({"query": "  "}, {})
        assert "Doc 1(Title:" in await search.call({"query": "right shift floor division"}, {})

    asyncio.run(main())


def _opening(task) -> str:
    return re.search(r'begins "(.*) \.\.\."', task.prompt).group(1)


def _solver(task):
    """A scripted agent that really uses the three tools: search the opening, count with python,
    check with the calculator, answer."""
    opening = _opening(task)
    word = re.search(r'the word "(\w+)"', task.prompt).group(1)

    def reply(context: str) -> str:
        turns = context.count("<|im_start|>tool")
        if turns == 0:
            return '<tool_call>' + json.dumps({"name": "search", "arguments": {"query": opening}}) + '</tool_call>'
        if turns == 1:
            start = context.rindex(opening)
            text = context[start:].split("\nDoc ")[0].split("<|im_end|>")[0]
            code = f"import re\nprint(len(re.findall(r'\\b{word}\\b', {text!r}, re.I)))"
            return '<tool_call>' + json.dumps({"name": "python", "arguments": {"code": code}}) + '</tool_call>'
        last = context.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0].strip()
        if turns == 2:
            return '<tool_call>' + json.dumps({"name": "calculator", "arguments": {"expression": f"{last} + 0"}}) \
                + '</tool_call>'
        return f"The word occurs <answer>{last}</answer> times."

    return reply


def test_an_episode_uses_search_python_and_calculator(runner, smollm2_tok):
    task = next(t for t in search_compute_tasks(40, seed=1) if t.metadata["expression"].startswith("count("))
    sandbox = make_sandbox("bwrap")
    env = slime_env.make("SearchCompute-v0", sandbox=sandbox)
    traj = runner.run(run_episode(env, ScriptedPolicy(smollm2_tok, _solver(task)), task,
                                  renderer=get_renderer(smollm2_tok, strict=True), max_turns=6))
    runner.run(sandbox.close())
    assert traj.status == "completed", traj.reason
    assert traj.reward == pytest.approx(1.1) and traj.info["rubric"] == {"exact_answer": 1.0, "answer_format": 1.0}
    assert [m.name for m in traj.messages if m.role == "tool"] == ["search", "python", "calculator"]
    assert {k: v["calls"] for k, v in traj.info["tool_stats"].items()} == {"search": 1, "python": 1, "calculator": 1}
    traj.check()


def test_gymnasium_make_without_arguments():
    env = gymnasium.make("slime_env/SearchCompute-v0")
    obs, _ = env.reset(seed=5)
    assert "Python reference" in obs
    names = [t["function"]["name"] for t in env.unwrapped.env.tools]
    assert names == ["search", "calculator", "python"]
    env.close()
