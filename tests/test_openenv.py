"""OpenEnv both ways, with the real `openenv` package (PyPI `openenv`, the 0.10 series) and real servers on loopback.

In: the echo environment OpenEnv itself scaffolds (`openenv init`, shipped in the package: the envs of OpenEnv's
repository are not on PyPI) served by uvicorn and run in process; an MCP environment (`MCPEnvironment` + FastMCP, as
OpenEnv's MCP envs are written) whose tools become ours. Out: `slime-env serve-openenv Calculator-v0` driven by
OpenEnv's `GenericEnvClient` and passing OpenEnv's runtime validator (`openenv validate URL`). Ledgers exact (strict).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("openenv")

from slime_env import ScriptedPolicy, get_renderer, run_episode  # noqa: E402
from slime_env.integrations.openenv import OpenEnvEnv  # noqa: E402
from slime_env.integrations.versions import IntegrationVersionError, require  # noqa: E402

TESTS = Path(__file__).parent


@contextlib.contextmanager
def server(argv: list[str], cwd: str | Path | None = None, marker: str = "listening on ", timeout_s: float = 60.0):
    """A server subprocess; yields its URL once it printed `marker URL` (uvicorn: 'Uvicorn running on URL')."""
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(cwd or "")})
    url, seen, deadline = None, [], time.time() + timeout_s
    try:
        while time.time() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            if marker in line:
                url = line.split(marker, 1)[1].split()[0]
                threading.Thread(target=proc.stdout.read, daemon=True).start()
                break
        assert url, "server did not start:\n" + "".join(seen[-30:])
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def echo_dir(tmp_path_factory):
    """OpenEnv's own echo environment, scaffolded by its CLI (`openenv init echo_env`)."""
    root = tmp_path_factory.mktemp("openenv_init")
    subprocess.run([sys.executable, "-m", "openenv.cli", "init", "echo_env", "--output-dir", str(root)], check=True,
                   capture_output=True, text=True)
    assert (root / "echo_env" / "server" / "app.py").exists()
    return root


def uvicorn(app: str, cwd: Path):
    return server([sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", "0"], cwd=cwd,
                  marker="Uvicorn running on ")


@pytest.fixture(scope="module")
def strict(smollm2_tok):
    return get_renderer(smollm2_tok, strict=True)


def test_echo_env_served_by_openenv(echo_dir, smollm2_tok, strict):
    """Text actions: the assistant text goes to the action's one string field (`message`), the echo comes back as a
    user message, OpenEnv's reward (0.1 per character, at most 1) is the turn's; the echo never ends: max_turns."""
    with uvicorn("echo_env.server.app:app", echo_dir) as url:
        async def main():
            env = OpenEnvEnv(url, max_turns=3)
            traj = await run_episode(env, ScriptedPolicy(smollm2_tok, ["hi", "hello", "hey you"]), "Say something.",
                                     renderer=strict, max_turns=10)
            await env.close()
            return traj

        traj = asyncio.run(main())
    traj.check()
    assert traj.status == "truncated", traj.reason
    assert traj.turn_rewards == pytest.approx([0.2, 0.5, 0.7])
    shown = smollm2_tok.decode(traj.prompt_ids)
    assert "Say something." in shown and "Echo Env environment ready!" in shown  # the task, then the first observation
    inserted = smollm2_tok.decode([t for t, m in zip(traj.response_ids, traj.loss_mask) if not m])
    assert "hello" in inserted  # the echo of turn 2, inserted (mask 0)


def test_echo_env_in_process(echo_dir, smollm2_tok, strict):
    """The same env class in process: its `step` annotation gives the action class; sync methods run in a thread."""
    sys.path.insert(0, str(echo_dir))
    try:
        module = importlib.import_module("echo_env.server.echo_env_environment")
    finally:
        sys.path.remove(str(echo_dir))

    async def main():
        env = OpenEnvEnv(environment=module.EchoEnvironment, max_turns=2)
        traj = await run_episode(env, ScriptedPolicy(smollm2_tok, ["abc", "abcdefghijklmnop"]), "Talk.",
                                 renderer=strict, max_turns=10)
        await env.close()
        return traj

    traj = asyncio.run(main())
    traj.check()
    assert traj.turn_rewards == pytest.approx([0.3, 1.0]) and traj.status == "truncated"


GUESS = '<tool_call>\n{{"name": "guess", "arguments": {{"number": {}}}}}\n</tool_call>'


def guesser(context: str) -> str:
    """Binary search over 0..9 from the tool results shown so far."""
    lo, hi = 0, 9
    for number, verdict in zip(_numbers(context), _verdicts(context)):
        lo, hi = (number + 1, hi) if verdict == "higher" else (lo, number - 1) if verdict == "lower" else (lo, hi)
    return GUESS.format((lo + hi) // 2)


def _numbers(context: str) -> list[int]:
    import re

    return [int(n) for n in re.findall(r'"number": (\d+)', context)]


def _verdicts(context: str) -> list[str]:
    import re

    return re.findall(r"(higher|lower|correct)<\|im_end\|>", context)


@pytest.mark.parametrize("where", ["served", "in_process"])
def test_mcp_tools_become_our_tools(where, smollm2_tok, strict):
    """OpenEnv's MCP tool actions: tools listed at reset (their schemas reach the template), each hermes tool call a
    `CallToolAction` step, results as tool messages with the call ids, OpenEnv's rewards and `done` kept."""
    async def episode(env):
        traj = await run_episode(env, ScriptedPolicy(smollm2_tok, guesser), "Find the number.", renderer=strict,
                                 max_turns=8, seed=3)
        names = [t["function"]["name"] for t in env.tools]
        await env.close()
        return traj, names

    if where == "served":
        with uvicorn("openenv_support:app", TESTS) as url:
            traj, names = asyncio.run(episode(OpenEnvEnv(url)))
    else:
        from openenv_support import GuessEnvironment  # noqa: F401 - tests/ is on sys.path under pytest

        traj, names = asyncio.run(episode(OpenEnvEnv(environment=GuessEnvironment)))
    traj.check()
    assert sorted(names) == ["guess", "hint"]
    assert traj.status == "completed", traj.reason
    # seed 3: guesses 4 (lower), 1 (higher), 2 (higher), 3 (correct): three misses at -0.1, then 1.0
    assert traj.turn_rewards == pytest.approx([-0.1, -0.1, -0.1, 1.0])
    assert '"name": "guess"' in smollm2_tok.decode(traj.prompt_ids)  # the MCP schema, in the parser's tool prompt


def test_serve_openenv_passes_openenvs_client_and_validator(smollm2_tok, strict):
    """Out: our Calculator-v0 as an OpenEnv server; OpenEnv's `GenericEnvClient` plays it over the WebSocket, OpenEnv's
    runtime validator passes, and `OpenEnvEnv` on it gives the same ledger as the env run directly."""
    from openenv.cli._validation import validate_running_environment
    from openenv.core import GenericEnvClient

    from slime_env import make

    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "(32 + 77) * 19"}}\n</tool_call>'
    task = {"prompt": "What is (32 + 77) * 19?", "label": "2071"}
    with server([sys.executable, "-m", "slime_env", "serve-openenv", "Calculator-v0", "--port", "0"]) as url:
        async def main():
            async with GenericEnvClient(base_url=url) as client:
                first = await client.reset(seed=0, task=task)
                tool = await client.step({"text": call})
                final = await client.step({"text": "<answer>2071</answer>"})
            report = await asyncio.to_thread(validate_running_environment, url)
            remote = OpenEnvEnv(url, tools=False, action="text", send_task=True)
            a = await run_episode(remote, ScriptedPolicy(smollm2_tok, [call, "<answer>2071</answer>"]), task,
                                  renderer=strict)
            await remote.close()
            b = await run_episode(make("Calculator-v0"), ScriptedPolicy(smollm2_tok, [call, "<answer>2071</answer>"]),
                                  task, renderer=strict)
            return first, tool, final, report, a, b

        first, tool, final, report, a, b = asyncio.run(main())
    assert first.observation["messages"][-1] == {"role": "user", "content": "What is (32 + 77) * 19?"}
    assert first.observation["tools"][0]["function"]["name"] == "calculator" and first.observation["parser"] == "hermes"
    assert tool.observation["messages"][0]["content"] == "2071" and not tool.done
    assert final.done and final.reward == 1.0
    assert report["passed"], [c for c in report["criteria"] if not c["passed"]]
    a.check()
    assert a.status == "completed" and a.reward == 1.0
    assert a.tokens == b.tokens and a.loss_mask == b.loss_mask  # through OpenEnv's wire, the same ledger


def test_version_skew_names_both_versions(monkeypatch):
    import slime_env.integrations.versions as versions

    monkeypatch.setattr(versions, "version", lambda name: "0.3.0")
    with pytest.raises(IntegrationVersionError, match=r"supports openenv>=0.10,<0.11, but openenv 0.3.0 is installed"):
        require("openenv", ">=0.10,<0.11", extra="openenv", what="slime_env.integrations.openenv")
    monkeypatch.undo()
    with pytest.raises(IntegrationVersionError, match="not installed: pip install 'slime_env\\[verifiers\\]'"):
        require("no-such-distribution-xyz", ">=1", extra="verifiers", what="x")


def test_roundtrip_example():
    out = subprocess.run([sys.executable, "-P", str(TESTS.parent / "examples" / "openenv_roundtrip.py")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "through OpenEnv: status=completed reward=1.0" in out.stdout and "same ledger: True" in out.stdout


@pytest.fixture(scope="module")
def calculator_openenv():
    """`serve-openenv Calculator-v0`'s app (what the CLI serves) under uvicorn on loopback, in a thread."""
    import socket

    import uvicorn as uvicorn_server

    from slime_env.integrations.openenv_server import openenv_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    srv = uvicorn_server.Server(uvicorn_server.Config(openenv_app("Calculator-v0"), log_level="error"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started and time.time() < deadline:
        time.sleep(0.05)
    assert srv.started, "uvicorn did not start"
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    srv.should_exit = True
    thread.join(10)


def test_serve_openenv_refuses_steps_after_the_episode_ended(calculator_openenv):
    """A correct answer ends the episode (reward 1, done); further steps are refused with the reason and earn nothing,
    until a reset starts the next one (before: four correct answers earned 1, 1, 1, 1 — total_reward 4.0)."""
    from openenv.core import GenericEnvClient

    task = {"prompt": "What is 2 + 3?", "label": "5"}

    async def main():
        async with GenericEnvClient(base_url=calculator_openenv) as client:
            await client.reset(task=task)
            first = await client.step({"text": "<answer>5</answer>"})
            refused = []
            for _ in range(2):
                with pytest.raises(Exception) as e:
                    await client.step({"text": "<answer>5</answer>"})
                refused.append(str(e.value))
            state = await client.state()
            await client.reset(task=task)
            again = await client.step({"text": "<answer>5</answer>"})
            return first, refused, state, again

    first, refused, state, again = asyncio.run(main())
    assert first.done and first.reward == 1.0
    assert all("step after the episode ended (done after 1 steps, total_reward 1.0): reset" in r for r in refused)
    assert state["total_reward"] == 1.0 and state["step_count"] == 1
    assert again.done and again.reward == 1.0


def test_serve_openenv_bad_input_is_a_4xx_naming_it(calculator_openenv):
    """A task that is not a prompt, a task without a prompt or without the label Calculator-v0 scores, a tool call
    without a name: 400 with the reason; the stateless `POST /step` (a fresh env per call: never an episode) is a 409
    saying to use the WebSocket (before: each a bare 500 "Internal Server Error"). Over the WebSocket the same
    reasons come back as OpenEnv's error messages."""
    import httpx

    from openenv.core import GenericEnvClient

    url = calculator_openenv
    no_name = {"action": {"text": "x", "tool_calls": [{"arguments": {"expression": "1+1"}}]}}
    for route, body, status, reason in [
            ("/reset", {"task": 42}, 400, "reset task: expected a Task, str or dict, got int"),
            ("/reset", {"task": {"label": "5"}}, 400, "reset task: no 'prompt' field"),
            ("/reset", {"task": {"prompt": "What is 2 + 3?"}}, 400, "Calculator-v0 task's 'label' must be the answer"),
            ("/step", no_name, 400, "SlimeAction.tool_calls[0].name: each call needs the tool's name"),
            ("/step", {"action": {"text": "<answer>5</answer>"}}, 409, "stateless HTTP POST /step builds a fresh env")]:
        r = httpx.post(url + route, json=body, timeout=30)
        assert r.status_code == status and reason in r.json()["detail"], (route, body, r.status_code, r.text)

    async def main():
        async with GenericEnvClient(base_url=url) as client:
            await client.reset(task={"prompt": "What is 2 + 3?", "label": 5})
            with pytest.raises(Exception) as e:
                await client.step({"text": "x", "tool_calls": [{"id": "c1"}]})
            return str(e.value)

    assert "SlimeAction.tool_calls[0].name" in asyncio.run(main())
