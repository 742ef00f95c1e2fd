"""MCP servers as ToolEnv tools, against a real MCP server (tests/servers/mcp_demo.py, written with the
SDK's server API) over stdio and over streamable HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mcp", reason="the [mcp] extra is not installed")

from slime_env import ScriptedPolicy, ToolEnv, get_renderer, run_episode  # noqa: E402
from slime_env.integrations.mcp import MCPConnectionError, MCPServer  # noqa: E402
from slime_env.tool_env import exact_answer  # noqa: E402
from slime_env.types import Action, ToolCall  # noqa: E402

SERVER = str(Path(__file__).parent / "servers" / "mcp_demo.py")
STDIO = [sys.executable, SERVER, "stdio"]


def _call(name, **arguments):
    return ToolCall(name, arguments)


async def _step(env, *calls):
    obs, *_ = await env.step(Action("..", tool_calls=calls))
    return [m.content for m in obs]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def http_server():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, SERVER, "http", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            assert proc.poll() is None, "the MCP test server exited"
            time.sleep(0.1)
    yield proc, f"http://127.0.0.1:{port}/mcp"
    proc.kill()
    proc.wait()


def test_stdio_round_trip_through_an_episode(smollm2_tok):
    async def main():
        async with MCPServer(STDIO, timeout_s=20) as server:
            env = ToolEnv([server], rubric=exact_answer)
            calls = ('<tool_call>{"name": "add", "arguments": {"a": 40, "b": 2}}</tool_call>'
                     '<tool_call>{"name": "fail", "arguments": {"message": "no luck"}}</tool_call>'
                     '<tool_call>{"name": "add", "arguments": {"a": "x"}}</tool_call>')
            policy = ScriptedPolicy(smollm2_tok, [calls, "<answer>42</answer>"])
            traj = await run_episode(env, policy, {"prompt": "q", "label": 42},
                                     renderer=get_renderer(smollm2_tok, strict=True))
            schema = {t["function"]["name"]: t["function"] for t in env.tools}
            return traj, schema

    traj, schema = asyncio.run(main())
    assert set(schema) == {"add", "count", "pid", "fail", "sleep", "busy", "long_job", "attachments", "die"}
    assert schema["add"]["parameters"]["required"] == ["a", "b"]
    assert schema["add"]["description"].startswith("Add two integers.")
    assert traj.status == "completed" and traj.reward == 1.0, traj.reason
    tool_msgs = [(m.name, m.tool_call_id, m.content) for m in traj.messages if m.role == "tool"]
    assert tool_msgs[0] == ("add", "call_1_0", "42")
    assert tool_msgs[1][0] == "fail" and tool_msgs[1][2].startswith("error: fail raised MCPToolError")
    assert "missing required argument 'b'" in tool_msgs[2][2] and "argument 'a': expected integer" in tool_msgs[2][2]
    assert traj.info["tool_stats"]["add"] == {"calls": 2, "errors": 0, "timeouts": 0, "invalid": 1,
                                              "latency_s": traj.info["tool_stats"]["add"]["latency_s"]}


def test_http_round_trip_shared_connection_and_server_death(http_server):
    proc, url = http_server

    async def main():
        server = MCPServer(url=url, timeout_s=5, connect_timeout_s=20, prefix="demo_", include=["add", "count"])
        first, second = ToolEnv([server]), ToolEnv([server])
        await first.reset(options={"task": {"prompt": "q"}})
        await second.reset(options={"task": {"prompt": "q"}})
        assert first.tool_names == ["demo_add", "demo_count"]
        assert await _step(first, _call("demo_add", a=1, b=2)) == ["3"]
        # One shared connection to one server process: the counter goes on across episodes.
        assert await _step(first, _call("demo_count")) == ["1"]
        assert await _step(second, _call("demo_count")) == ["2"]
        proc.kill()
        proc.wait()
        out = await _step(first, _call("demo_add", a=1, b=2))
        # Not a hang, and not cut by the call timeout either: the dead server is detected as such.
        assert out[0].startswith("error: demo_add raised") and "timed out" not in out[0]
        await server.close()

    asyncio.run(main())


def test_stdio_server_dying_mid_call_is_an_error_observation_then_reconnects(capfd):
    async def main():
        async with MCPServer(STDIO, timeout_s=20) as server:
            env = ToolEnv([server])
            await env.reset(options={"task": {"prompt": "q"}})
            pid_before = (await _step(env, _call("pid")))[0]
            out = await _step(env, _call("die"))  # timeout_s=20 would say "timed out": this is the death itself
            assert "MCPConnectionError" in out[0] and "closed the connection" in out[0]
            assert "demo server: dying now" in out[0]  # the server's own last words, from its captured stderr
            pid_after = (await _step(env, _call("pid")))[0]  # a new server process answers
            assert pid_after.isdigit() and pid_after != pid_before

    asyncio.run(main())
    assert "dying now" not in capfd.readouterr().err  # never in the training process's own stderr


def test_a_hanging_mcp_tool_is_cut_at_its_timeout():
    async def main():
        async with MCPServer(STDIO, timeout_s=0.5) as server:
            env = ToolEnv([server])
            await env.reset(options={"task": {"prompt": "q"}})
            out = await _step(env, _call("sleep", seconds=30), _call("add", a=1, b=1))
            assert out == ["error: sleep timed out after 0.5s", "2"]

    asyncio.run(main())


def test_per_episode_sessions_are_separate_and_closed():
    async def main():
        server = MCPServer(STDIO, per_episode=True, timeout_s=20)
        a, b = ToolEnv([server]), ToolEnv([server])
        await a.reset(options={"task": {"prompt": "q"}})
        await b.reset(options={"task": {"prompt": "q"}})
        pid_a, pid_b = (await _step(a, _call("pid")))[0], (await _step(b, _call("pid")))[0]
        assert pid_a != pid_b and await _step(a, _call("count")) == ["1"] and await _step(b, _call("count")) == ["1"]
        await a.close()
        await b.close()
        for pid in (int(pid_a), int(pid_b)):
            for _ in range(100):
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError(f"server process {pid} still runs after close()")

    asyncio.run(main())


def test_unreachable_server_fails_the_episode_with_the_reason(smollm2_tok):
    missing = [sys.executable, "-c", "import sys; sys.exit(5)"]

    async def main():
        with pytest.raises(MCPConnectionError, match="cannot connect to MCP server"):
            await ToolEnv([MCPServer(missing, connect_timeout_s=20)]).reset(options={"task": {"prompt": "q"}})
        env = ToolEnv([MCPServer(url=f"http://127.0.0.1:{_free_port()}/mcp", connect_timeout_s=5)])
        return await run_episode(env, ScriptedPolicy(smollm2_tok, ["hi"]), {"prompt": "q"},
                                 renderer=get_renderer(smollm2_tok))

    traj = asyncio.run(main())
    assert traj.status == "failed" and "MCPConnectionError" in traj.reason and "127.0.0.1" in traj.reason


def test_bad_configuration_is_refused():
    from slime_env import InvalidInput

    with pytest.raises(InvalidInput, match="exactly one of"):
        MCPServer()
    with pytest.raises(InvalidInput, match="non-empty list"):
        MCPServer("python server.py")


def test_whole_number_floats_count_as_integers_and_reach_the_server_as_ints():
    """JSON Schema (draft-06 on) counts 1.0 as an integer: the demo server's `add(a: int, b: int)` gets 40.0 + 2.0
    as ints (the answer is "42", not "42.0"); 2.5 is still refused."""
    async def main():
        async with MCPServer(STDIO, timeout_s=20) as server:
            env = ToolEnv([server])
            await env.reset(options={"task": {"prompt": "q"}})
            ok = await _step(env, _call("add", a=40.0, b=2.0))
            bad = await _step(env, _call("add", a=2.5, b=1))
            await env.close()
            return ok, bad

    ok, bad = asyncio.run(main())
    assert ok == ["42"]
    assert "argument 'a': expected integer, got float" in bad[0]
    from slime_env.tools import _validate_by_schema

    schema = {"properties": {"n": {"type": "integer"}, "x": {"type": ["number", "null"]}}, "required": ["n"]}
    out = _validate_by_schema("t", schema, {"n": 3.0, "x": 1.0})
    assert out == {"n": 3, "x": 1.0} and type(out["n"]) is int and type(out["x"]) is float


def test_resource_links_binary_resources_and_images_are_rendered_with_what_the_model_needs():
    async def main():
        async with MCPServer(STDIO, timeout_s=20) as server:
            env = ToolEnv([server])
            await env.reset(options={"task": {"prompt": "q"}})
            out = await _step(env, _call("attachments"))
            await env.close()
            return out[0]

    text = asyncio.run(main())
    assert "[resource link report.csv <file:///data/report.csv> (text/csv, 1234 bytes): the quarterly report]" in text
    assert "[binary resource file:///data/notes.gz (application/gzip, 20 bytes)]" in text
    assert "[image (image/png, 64 bytes)]" in text


def test_a_server_concurrency_limit_serialises_its_calls():
    """server-memory loses writes under concurrent calls; `max_concurrency=1` is the fix: one turn's four calls reach
    the server one at a time (without it they overlap)."""
    async def peak(**limits):
        async with MCPServer(STDIO, timeout_s=20, **limits) as server:
            env = ToolEnv([server])
            await env.reset(options={"task": {"prompt": "q"}})
            out = await _step(env, *[_call("busy", seconds=0.3) for _ in range(4)])
            await env.close()
            return max(int(x) for x in out)

    assert asyncio.run(peak()) > 1
    assert asyncio.run(peak(max_concurrency=1)) == 1
    assert asyncio.run(peak(tool_concurrency={"busy": 2})) == 2
    from slime_env import InvalidInput

    with pytest.raises(InvalidInput, match="concurrency limits"):
        MCPServer(STDIO, max_concurrency=0)


def test_tools_that_need_task_augmented_calls_are_not_offered():
    """server-everything's `simulate-research-query` declares execution.taskSupport "required": every plain call
    fails, so it is left out of the tools and named in `skipped_tools` (checked on the SDK's own Tool type)."""
    from mcp.types import Tool as MCPTool
    from mcp.types import ToolExecution

    from slime_env.integrations.mcp import _Holder

    server = MCPServer(STDIO)
    holder = _Holder(server)
    holder.listed = [MCPTool(name="plain", input_schema={"type": "object"}),
                     MCPTool(name="research", input_schema={"type": "object"},
                             execution=ToolExecution(task_support="required")),
                     MCPTool(name="optional", input_schema={"type": "object"},
                             execution=ToolExecution(task_support="optional"))]
    assert [t.name for t in holder.tools()] == ["plain", "optional"]
    assert "taskSupport is 'required'" in server.skipped_tools["research"]


def test_the_env_tool_timeout_applies_to_mcp_tools_unless_the_server_sets_its_own():
    async def main():
        async with MCPServer(STDIO) as server:  # no timeout of its own: the env's 0.5 s cuts sleep(3)
            env = ToolEnv([server], tool_timeout_s=0.5)
            await env.reset(options={"task": {"prompt": "q"}})
            cut = await _step(env, _call("sleep", seconds=3))
        async with MCPServer(STDIO, timeout_s=10) as server:  # the server's own (explicit) 10 s wins for its tools
            env = ToolEnv([server], tool_timeout_s=0.5)
            await env.reset(options={"task": {"prompt": "q"}})
            kept = await _step(env, _call("sleep", seconds=1))
        return cut[0], kept[0]

    cut, kept = asyncio.run(main())
    assert "timed out" in cut and "0.5" in cut
    assert kept == "slept"


def test_progress_notifications_of_a_long_running_tool_are_requested_and_kept():
    async def main():
        async with MCPServer(STDIO, timeout_s=20) as server:
            env = ToolEnv([server])
            await env.reset(options={"task": {"prompt": "q"}})
            out = await _step(env, _call("long_job", steps=3))
            await env.close()
            return out[0], dict(server.progress)

    out, progress = asyncio.run(main())
    assert out == "done"
    assert progress["long_job"] == {"notifications": 3, "progress": 3, "total": 3, "message": "step 3 of 3"}
