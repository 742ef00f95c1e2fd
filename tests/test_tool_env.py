"""ToolEnv: schemas from signatures, validation, concurrent calls, timeouts, ids through every renderer."""

from __future__ import annotations

import asyncio
import enum
import json
import threading
from typing import Any, Literal, Optional

import pytest

from slime_env import (InvalidInput, Rubric, ScriptedPolicy, StatefulToolEnv, Task, ToolArgumentError, ToolEnv,
                       get_renderer, run_episode, tool)
from slime_env import ToolOutput
from slime_env.rollout.metrics import batch_metrics
from slime_env.tool_env import answer_format, exact_answer, final_answer
from slime_env.types import Action, ParseError, ToolCall


class Unit(enum.Enum):
    CELSIUS = "celsius"
    FAHRENHEIT = "fahrenheit"


def weather(city: str, unit: Unit = Unit.CELSIUS, days: Optional[int] = None) -> str:
    """Get the forecast for a city.

    Args:
        city: the city's name
        unit: temperature unit
        days: how many days ahead
    """
    return f"{city}: 20 {unit.value} for {days} days"


async def lookup(keys: list[str], mode: Literal["fast", "exact"] = "fast", limits: dict[str, float] | None = None,
                 flag: bool = False, ratio: float = 0.5):
    """Look keys up."""
    return {"keys": keys, "mode": mode}


def untyped(x, y=3):
    return x


SCHEMAS = [
    (weather, {"name": "weather", "description": "Get the forecast for a city.", "parameters": {
        "type": "object", "required": ["city"], "properties": {
            "city": {"type": "string", "description": "the city's name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius",
                     "description": "temperature unit"},
            "days": {"type": ["integer", "null"], "default": None, "description": "how many days ahead"}}}}),
    (lookup, {"name": "lookup", "description": "Look keys up.", "parameters": {
        "type": "object", "required": ["keys"], "properties": {
            "keys": {"type": "array", "items": {"type": "string"}},
            "mode": {"type": "string", "enum": ["fast", "exact"], "default": "fast"},
            "limits": {"anyOf": [{"type": "object", "additionalProperties": {"type": "number"}}, {"type": "null"}],
                       "default": None},
            "flag": {"type": "boolean", "default": False},
            "ratio": {"type": "number", "default": 0.5}}}}),
    (untyped, {"name": "untyped", "description": "", "parameters": {
        "type": "object", "required": ["x"], "properties": {"x": {}, "y": {"default": 3}}}}),
]


@pytest.mark.parametrize("fn,expected", SCHEMAS, ids=[s[0].__name__ for s in SCHEMAS])
def test_schema_from_signature_and_docstring(fn, expected):
    assert tool(fn).schema == {"type": "function", "function": expected}


def test_tool_decorator_options_and_refusals():
    @tool(name="forecast", timeout_s=2.0, hidden=["session"])
    def f(city: str, session: Any) -> str:
        """Forecast."""
        return city

    assert f.name == "forecast" and f.timeout_s == 2.0 and f.hidden == ("session",)
    assert list(f.parameters["properties"]) == ["city"]  # the hidden argument is not shown to the model
    with pytest.raises(InvalidInput, match=r"\*args"):
        tool(lambda *args: 0, name="v")
    with pytest.raises(InvalidInput, match="has no name"):
        tool(lambda x: x)
    with pytest.raises(InvalidInput, match="not parameters"):
        tool(weather, hidden=["nope"])
    with pytest.raises(InvalidInput, match="two tools are named 'weather'"):
        ToolEnv([weather, tool(lookup, name="weather")])


@pytest.mark.parametrize("arguments,problem", [
    ({}, "missing required argument 'city'"),
    ({"city": "Oslo", "when": 1}, "unexpected argument 'when' (parameters: city, unit, days)"),
    ({"city": 5}, "argument 'city': Input should be a valid string"),
    ({"city": "Oslo", "days": "3"}, "argument 'days': Input should be a valid integer"),
    ({"city": "Oslo", "days": 2.5}, "argument 'days'"),
    ({"city": "Oslo", "unit": "kelvin"}, "argument 'unit': Input should be 'celsius' or 'fahrenheit'"),
])
def test_validation_names_the_argument(arguments, problem):
    with pytest.raises(ToolArgumentError) as e:
        tool(weather).validate(arguments)
    assert problem in str(e.value) and "'weather'" in str(e.value)


def test_validation_converts_to_declared_types():
    args = tool(weather).validate({"city": "Oslo", "unit": "fahrenheit", "days": 2})
    assert args == {"city": "Oslo", "unit": Unit.FAHRENHEIT, "days": 2}
    with pytest.raises(ToolArgumentError, match=r"argument 'keys\[1\]'"):
        tool(lookup).validate({"keys": ["a", 2]})
    assert tool(lookup).validate({"keys": [], "ratio": 1})["ratio"] == 1.0  # an int is a valid number


def _run(coro):
    return asyncio.run(coro)


async def _start(env: ToolEnv, prompt: str = "q", label: Any = "42"):
    return await env.reset(options={"task": {"prompt": prompt, "label": label}})


def test_calls_results_errors_and_ids():
    def fails(x: int) -> int:
        """Always fails."""
        raise KeyError(x)

    async def main():
        env = ToolEnv([weather, fails], rubric=exact_answer)
        msgs, _ = await _start(env)
        assert msgs[0].role == "system" and msgs[1].content == "q"
        assert [t["function"]["name"] for t in env.tools] == ["weather", "fails"]
        calls = (ToolCall("weather", {"city": "Oslo", "days": 2}), ToolCall("fails", {"x": 1}, id="abc"),
                 ToolCall("nope", {}), ToolCall("weather", {"town": "x"}))
        obs, r, term, trunc, info = await env.step(Action("..", tool_calls=calls,
                                                          parse_errors=(ParseError("bad json", "<tool_call>{"),)))
        assert [(m.role, m.name, m.tool_call_id) for m in obs] == [
            ("tool", "weather", "call_1_0"), ("tool", "fails", "abc"), ("tool", "nope", "call_1_2"),
            ("tool", "weather", "call_1_3"), ("tool", None, None)]
        assert obs[0].content == "Oslo: 20 celsius for 2 days"
        assert obs[1].content == "error: fails raised KeyError: 1"
        assert obs[2].content == "error: unknown tool 'nope'; the tools are: weather, fails"
        assert "missing required argument 'city'" in obs[3].content and "unexpected argument 'town'" in obs[3].content
        assert obs[4].content == "error: bad json"
        assert (r, term, trunc) == (0.0, False, False)
        assert info["tool_calls"] == 4
        assert info["tool_stats"]["weather"] == {"calls": 2, "errors": 0, "timeouts": 0, "invalid": 1,
                                                 "latency_s": pytest.approx(info["tool_stats"]["weather"]["latency_s"])}
        assert info["tool_stats"]["fails"]["errors"] == 1 and info["tool_stats"]["unknown_tool"]["errors"] == 1
        assert [r.status for r in env.tool_history] == ["ok", "error", "unknown", "invalid"]
        obs, r, term, trunc, info = await env.step(Action("It is <answer>42</answer>"))
        assert (obs, r, term, info["rubric"]) == ([], 1.0, True, {"exact_answer": 1.0})

    _run(main())


def test_concurrent_calls_really_overlap():
    """Each call waits until the other has started: run one after the other, both would time out."""
    started = {"a": asyncio.Event(), "b": asyncio.Event()}

    async def wait_for_peer(me: str, peer: str) -> str:
        """Async: start, then wait for the peer."""
        started[me].set()
        await started[peer].wait()
        return "met " + peer

    barrier = threading.Barrier(2, timeout=10)

    def sync_meet(me: str) -> str:
        """Sync, in the thread pool: both threads must reach the barrier."""
        barrier.wait()
        return me + " passed"

    async def main():
        env = ToolEnv([wait_for_peer, sync_meet], tool_timeout_s=10)
        await _start(env)
        obs, *_ = await env.step(Action("..", tool_calls=(
            ToolCall("wait_for_peer", {"me": "a", "peer": "b"}), ToolCall("wait_for_peer", {"me": "b", "peer": "a"}),
            ToolCall("sync_meet", {"me": "x"}), ToolCall("sync_meet", {"me": "y"}))))
        assert [m.content for m in obs] == ["met b", "met a", "x passed", "y passed"]

    _run(main())


def test_max_parallel_calls_bounds_concurrency():
    running, peak = 0, 0

    async def slow(i: int) -> int:
        """Count how many run at once."""
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01)
        running -= 1
        return i

    async def main():
        env = ToolEnv([slow], max_parallel_calls=2)
        await _start(env)
        obs, *_ = await env.step(Action("..", tool_calls=tuple(ToolCall("slow", {"i": i}) for i in range(6))))
        assert [m.content for m in obs] == [str(i) for i in range(6)] and peak == 2

    _run(main())


def test_hanging_tool_is_cut_and_the_episode_goes_on(smollm2_tok):
    never = threading.Event()

    async def hang() -> str:
        """Never returns."""
        await asyncio.Event().wait()
        return "unreachable"

    def hang_sync() -> str:
        """Blocks its thread until the test ends."""
        never.wait(30)
        return "late"

    @tool(timeout_s=0.2)
    def quick_timeout() -> str:
        """Blocks longer than its own timeout."""
        never.wait(30)
        return "late"

    hang_call = '<tool_call>{"name": "hang", "arguments": {}}</tool_call>'
    sync_calls = ('<tool_call>{"name": "hang_sync", "arguments": {}}</tool_call>'
                  '<tool_call>{"name": "quick_timeout", "arguments": {}}</tool_call>')
    env = ToolEnv([hang, hang_sync, quick_timeout], rubric=exact_answer, tool_timeout_s=0.3)
    policy = ScriptedPolicy(smollm2_tok, [hang_call, sync_calls, "<answer>42</answer>"])
    try:
        traj = _run(run_episode(env, policy, {"prompt": "q", "label": 42},
                                renderer=get_renderer(smollm2_tok, strict=True), max_turns=5))
    finally:
        never.set()
    assert traj.status == "completed" and traj.reward == 1.0, traj.reason
    tool_msgs = [m.content for m in traj.messages if m.role == "tool"]
    assert tool_msgs == ["error: hang timed out after 0.3s", "error: hang_sync timed out after 0.3s",
                         "error: quick_timeout timed out after 0.2s"]
    assert traj.info["tool_stats"]["hang"]["timeouts"] == 1


def _episode_with_parallel_calls(tok, family_kwargs=None):
    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first
            b: the second
        """
        return a + b

    def echo(text: str) -> dict:
        """Echo text back as JSON."""
        return {"echo": text, "len": len(text)}

    # Qwen3 drops the empty <think></think> of earlier turns when it renders history (a documented rewrite,
    # recorded); every bridge is still compared token for token.
    rewrite = "keep" if family_kwargs else "error"
    renderer = get_renderer(tok, strict=True, on_history_rewrite=rewrite, **(family_kwargs or {}))
    calls = ('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 40}}</tool_call>\n'
             '<tool_call>{"name": "echo", "arguments": {"text": "hi there"}}</tool_call>')
    env = ToolEnv([add, echo], rubric=Rubric(exact_answer, (answer_format, 0.5)))
    policy = ScriptedPolicy(tok, [calls, '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>',
                                  "So <answer>42</answer>"], end_token_id=renderer.stop_token_ids[0])
    return _run(run_episode(env, policy, {"prompt": "What is 2+40?", "label": 42}, renderer=renderer, max_turns=5))


@pytest.mark.parametrize("family", ["smollm2", "qwen2.5", "qwen3", "llama3.1", "deepseek_r1"])
def test_tool_messages_carry_ids_through_the_strict_renderer(tokenizers, family):
    """Strict mode compares every bridge and the whole ledger with a full render of the conversation
    (tools included), so the ids equal what each family's template writes for tool results."""
    tok = tokenizers[family]
    traj = _episode_with_parallel_calls(tok, {"enable_thinking": False} if family == "qwen3" else None)
    assert traj.status == "completed", traj.reason
    assert traj.reward == 1.5 and traj.info["rubric"] == {"exact_answer": 1.0, "answer_format": 1.0}
    tools = [(m.name, m.tool_call_id, m.content) for m in traj.messages if m.role == "tool"]
    assert tools[:2] == [("add", "call_1_0", "42"), ("echo", "call_1_1", '{"echo": "hi there", "len": 8}')]
    assert tools[2][:2] == ("add", "call_2_0") and "missing required argument 'b'" in tools[2][2]
    inserted = tok.decode([t for t, m in zip(traj.response_ids, traj.loss_mask) if m == 0])
    assert "hi there" in inserted and "missing required argument" in inserted
    traj.check()


def test_rubric_weights_arguments_and_errors():
    seen = {}

    def uses_tools(tool_calls, state) -> float:
        seen["tools"], seen["state"] = [r.name for r in tool_calls], state
        return len(tool_calls)

    async def judge(**context) -> float:
        seen["keys"] = sorted(context)
        return 0.25

    async def main():
        rubric = Rubric(uses_tools, judge, weights=[0.5, 2.0])
        env = ToolEnv([weather], rubric=rubric)
        await _start(env)
        await env.step(Action("..", tool_calls=(ToolCall("weather", {"city": "A"}),)))
        _, reward, term, _, info = await env.step(Action("done"))
        assert term and reward == pytest.approx(0.5 * 1 + 2.0 * 0.25)
        assert info["rubric"] == {"uses_tools": 1.0, "judge": 0.25}
        assert seen["tools"] == ["weather"] and seen["state"] == {}
        assert seen["keys"] == ["answer", "info", "label", "messages", "state", "task", "tool_calls"]

    _run(main())
    with pytest.raises(InvalidInput, match=r"asks for \['completion'\]"):
        Rubric(lambda completion: 1.0)
    with pytest.raises(InvalidInput, match="2 functions but 1 weights"):
        Rubric(exact_answer, answer_format, weights=[1.0])

    async def bad():
        env = ToolEnv([weather], rubric=lambda answer: float("nan"))
        await _start(env)
        await env.step(Action("x"))

    with pytest.raises(InvalidInput, match="must be finite"):
        _run(bad())


def test_answer_helpers():
    assert final_answer("a <answer> 1 </answer> b <answer>2</answer>") == "2" and final_answer("none") is None
    assert exact_answer("<answer>1,000.0</answer>", 1000) == 1.0 and exact_answer("<answer>Paris.</answer>", "paris")
    assert exact_answer("<answer>7</answer>", ["6", "7"]) == 1.0 and exact_answer("7", "7") == 0.0
    assert answer_format("<answer>x</answer>") == 1.0 and answer_format("<answer> </answer>") == 0.0
    assert answer_format("<answer>1</answer><answer>2</answer>") == 0.0


def test_custom_is_done_nudges_and_truncates():
    class NeedsAnswer(ToolEnv):
        def is_done(self, action):
            return final_answer(action.text) is not None

    async def main():
        env = NeedsAnswer([weather], max_turns=2)
        await _start(env)
        obs, _, term, trunc, _ = await env.step(Action("thinking"))
        assert obs[0].role == "user" and "weather" in obs[0].content and not term and not trunc
        _, _, term, trunc, _ = await env.step(Action("still thinking"))
        assert (term, trunc) == (False, True)

    _run(main())


def test_long_results_are_cut():
    def big() -> str:
        """Big output."""
        return "z" * 5000

    async def main():
        env = ToolEnv([big], max_output_chars=100)
        await _start(env)
        obs, *_ = await env.step(Action("..", tool_calls=(ToolCall("big", {}),)))
        # the head and the tail (where a command's exit status or a note sits): 75 + 25 characters kept
        assert obs[0].content == "z" * 75 + "\n[... 4900 characters cut ...]\n" + "z" * 25

    _run(main())


def test_stateful_tool_env_injects_hidden_state_and_releases_it():
    log = []

    def query(sql: str, db: dict) -> str:
        """Run a query.

        Args:
            sql: the query
            db: injected by the env
        """
        db["queries"].append(sql)
        return f"{len(db['queries'])} queries on {db['name']}"

    class DB(StatefulToolEnv):
        async def setup_state(self, task):
            log.append(("open", task.prompt))
            return {"db": {"name": task.prompt, "queries": []}}

        async def cleanup_state(self, state):
            log.append(("close", state["db"]["name"], list(state["db"]["queries"])))

    async def main():
        env = DB([query], hidden_args=["db"])
        assert env.tools[0]["function"]["parameters"] == {
            "type": "object", "required": ["sql"],
            "properties": {"sql": {"type": "string", "description": "the query"}}}
        await _start(env, prompt="first")
        obs, *_ = await env.step(Action("..", tool_calls=(ToolCall("query", {"sql": "select 1"}),)))
        assert obs[0].content == "1 queries on first"
        obs, *_ = await env.step(Action("..", tool_calls=(ToolCall("query", {"sql": "x", "db": "forged"}),)))
        assert "unexpected argument 'db'" in obs[0].content  # the model cannot pass the hidden argument
        await _start(env, prompt="second")  # a new episode releases the old state first
        await env.close()
        await env.close()
        assert log == [("open", "first"), ("close", "first", ["select 1"]), ("open", "second"),
                       ("close", "second", [])]

        class Forgetful(StatefulToolEnv):
            async def setup_state(self, task):
                return {}

        with pytest.raises(InvalidInput, match=r"did not provide \['db'\]"):
            await _start(Forgetful([query], hidden_args=["db"]))

    _run(main())


def test_tool_stats_reach_rollout_metrics(smollm2_tok):
    from slime_env.rollout.manager import Group

    env = ToolEnv([weather], rubric=exact_answer)
    policy = ScriptedPolicy(smollm2_tok, ['<tool_call>{"name": "weather", "arguments": {"city": "A"}}</tool_call>',
                                          '<tool_call>{"name": "weather", "arguments": {}}</tool_call>',
                                          "<answer>42</answer>"])
    traj = _run(run_episode(env, policy, Task(prompt="q", label="42"), renderer=get_renderer(smollm2_tok)))
    group = Group(group_index=0, task=traj.task, env_id="tools", trajectories=[traj])
    m = batch_metrics([group], [], 1.0)
    assert m["rollout/tools/weather/calls"] == 2 and m["rollout/tools/weather/invalid"] == 1
    assert m["rollout/tools/weather/errors"] == 0 and m["rollout/tools/weather/latency_mean_s"] >= 0
    assert json.loads(json.dumps(traj.info))["tool_stats"]["weather"]["calls"] == 2


def test_a_tool_output_shows_its_text_and_keeps_its_data_on_the_record():
    def fetch(url: str) -> ToolOutput:
        """Fetch url."""
        return ToolOutput(f"fetched {url} (3 bytes)", {"bytes": "YWJj", "url": url})

    async def main():
        env = ToolEnv([fetch])
        await _start(env)
        obs, *_ = await env.step(Action("..", tool_calls=(ToolCall("fetch", {"url": "file:///a"}),)))
        return obs, env.tool_history[-1]

    obs, record = _run(main())
    assert obs[0].content == "fetched file:///a (3 bytes)" and "YWJj" not in obs[0].content  # never shown
    assert record.data == {"bytes": "YWJj", "url": "file:///a"} and record.to_dict()["data"] == record.data
