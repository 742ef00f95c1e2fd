"""WorkspaceEnv's tools in a real container, through `run_episode` with exact ledgers, and black-box harnesses
(mini-swe-agent unchanged, a plain OpenAI-SDK loop) through the gateway into a workspace.

The policies are `ScriptedPolicy`s on real tokenizers and templates: the tool calls are scripted (no small model makes
them on cue) — a stand-in for the engine only; the env, the workspace, the gateway and the harnesses are real."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from slime_env import ScriptedPolicy, Task, get_renderer, run_episode
from slime_env.rollout.metrics import time_split
from slime_env.envs.workspace import WorkspaceEnv
from slime_env.envs.workspace.editor import insert, str_replace, view_file
from slime_env.tools import ToolError
from slime_env.tools_sandbox.workspace import WorkspaceSpec
from slime_env.tools_sandbox.workspace.pool import WorkspacePool
from workspace_support import require_backend, workspace_image



def _require_mini_swe_agent() -> None:
    """Skip without mini-swe-agent (`make` installs it; CI fails instead). Found, not imported: importing it here,
    before our harness sets its environment, would print its banner and make ~/.config/mini-swe-agent."""
    import importlib.util
    import os

    if importlib.util.find_spec("minisweagent") is None:
        if os.environ.get("CI"):
            pytest.fail("CI must have mini-swe-agent (the dev extra)")
        pytest.skip("mini-swe-agent is not installed")


def call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def test_editor_rules_without_a_workspace():
    text = "a = 1\nb = 2\na = 1\n"
    with pytest.raises(ToolError, match=r"Multiple occurrences .* lines \[1, 3\]"):
        str_replace("/f.py", text, "a = 1", "a = 3")
    with pytest.raises(ToolError, match="did not appear verbatim"):
        str_replace("/f.py", text, "c = 3", "")
    new, message = str_replace("/f.py", text, "b = 2", "b = 20")
    assert new == "a = 1\nb = 20\na = 1\n" and "     2\tb = 20" in message
    assert insert("/f.py", text, 0, "# top")[0].startswith("# top\na = 1")
    assert insert("/f.py", text, 3, "end")[0] == text + "end\n"
    with pytest.raises(ToolError, match="outside"):
        insert("/f.py", text, 9, "x")
    assert view_file("/f.py", text, [2, 3]).splitlines()[1:] == ["     2\tb = 2", "     3\ta = 1"]
    with pytest.raises(ToolError, match="view_range"):
        view_file("/f.py", text, [3, 1])


async def _episode(tok, replies, task, *, pool, max_turns=20, **env_kw):
    env = WorkspaceEnv(spec=WorkspaceSpec(image=workspace_image(), workdir="/app"), pool=pool, **env_kw)
    try:
        return await run_episode(env, ScriptedPolicy(tok, replies), task, renderer=get_renderer(tok, strict=True),
                                 max_turns=max_turns)
    finally:
        await env.close()


def test_the_tools_in_a_workspace_with_exact_ledgers(smollm2_tok):
    require_backend("docker")
    replies = [
        call("bash", command="mkdir -p /app/proj && cd /app/proj && export FOO=bar && x=5 && f() { echo fn$1; }"),
        call("bash", command='pwd; echo "$FOO $x"; f 7; exit 4'),
        call("bash", command="pwd"),  # the state survived the `exit`
        call("str_replace_editor", command="create", path="/app/proj/m.py", file_text="def f(x):\n    return x < 3\n"),
        call("str_replace_editor", command="create", path="/app/proj/m.py", file_text="again"),
        call("str_replace_editor", command="str_replace", path="proj/m.py", old_str="x < 3", new_str="x <= 3"),
        call("str_replace_editor", command="insert", path="/app/proj/m.py", insert_line=0, new_str="import os"),
        call("str_replace_editor", command="undo_edit", path="/app/proj/m.py"),
        call("str_replace_editor", command="view", path="/app/proj/m.py", view_range=[2, 2]),
        call("str_replace_editor", command="view", path="/app/proj"),
        call("search", pattern="x <= [0-9]", path="/app", include="*.py"),
        call("search", pattern="nothing-like-this"),
        call("bash", command="sleep 30", timeout=1),
        call("bash", command="yes | head -c 100000"),
        # a 70 MB file of 100-character lines: viewed and searched through the workspace, never read whole here
        call("bash", command="head -c 70000000 /dev/zero | tr '\\0' a | fold -w 100 > /app/big.txt"),
        call("str_replace_editor", command="view", path="/app/big.txt"),
        call("str_replace_editor", command="view", path="/app/big.txt", view_range=[500000, 500001]),
        call("search", pattern="a", path="/app/big.txt"),
        call("bash", command="yes | head -c 3000000"),  # past the command's output limit: killed, and told so
        call("submit"),
    ]

    async def main():
        async with WorkspacePool(warm=0) as pool:
            return await _episode(smollm2_tok, replies, "Fix the comparison.", pool=pool)

    traj = asyncio.run(main())
    assert traj.status == "completed", traj.reason
    tools = [m.content for m in traj.messages if m.role == "tool"]
    assert tools[0] == "(no output)"
    assert tools[1] == "/app/proj\nbar 5\nfn7\n[exit code 4]"
    assert tools[2] == "/app/proj"
    assert tools[3] == "File created successfully at: /app/proj/m.py"
    assert tools[4].startswith("error: File already exists at: /app/proj/m.py")
    assert "     2\t    return x <= 3" in tools[5]
    assert "     1\timport os" in tools[6]
    assert tools[7].startswith("Last edit to /app/proj/m.py undone successfully")
    assert tools[8].splitlines()[1:] == ["     2\t    return x <= 3"]
    assert "/app/proj/m.py" in tools[9]
    assert tools[10] == "/app/proj/m.py:2:    return x <= 3"
    assert tools[11].startswith("No matches")
    assert tools[12] == "[the command timed out after 1s and was killed]"
    assert "characters cut ...]" in tools[13]
    assert tools[15].startswith("Here's the result of running `cat -n` on /app/big.txt:\n     1\taaa")
    assert tools[15].endswith("[/app/big.txt is 70,699,999 bytes: only the lines shown fit; view_range shows any "
                              "other lines]")
    assert tools[16].splitlines()[1:] == [f"{500000:6}\t{'a' * 100}", f"{500001:6}\t{'a' * 100}"]
    assert len(tools[17].splitlines()) == 51 and tools[17].endswith("there are too many; narrow the search]")
    # the env cuts a long result in the middle: how the command ended stays visible
    assert "characters cut ...]" in tools[18]
    assert tools[18].endswith("[the output was too long and was cut; the command was killed]")
    # the system message carries the tools in hermes format: SmolLM2's template has no tool section
    assert '"name": "str_replace_editor"' in traj.messages[0].content and "<tool_call>" in traj.messages[0].content
    traj.check()
    generated = sum(sp.end - sp.start for sp in traj.spans if sp.kind == "generated")
    assert sum(traj.loss_mask) == generated > 0
    # the container's share of the episode: its start, its commands (the 1 s timeout among them), the scoring
    assert traj.info["workspace"]["commands"] >= 5  # the info stays deterministic; the seconds are in timings
    t = traj.timings
    assert t["container_exec_s"] >= 1.0 and t["container_start_s"] > 0 and t["container_verify_s"] >= 0
    split = time_split([traj])
    assert split["rollout/time/container_s"] == pytest.approx(
        t["container_start_s"] + t["container_exec_s"] + t["container_verify_s"])
    assert split["rollout/time/container_s"] <= traj.timings["env_s"] + 1e-6


def test_a_template_with_a_tool_section_gets_the_tools_there(qwen3_tok):
    require_backend("docker")

    async def main():
        async with WorkspacePool(warm=0) as pool:
            return await _episode(qwen3_tok, [call("submit")], "Nothing to do.", pool=pool)

    traj = asyncio.run(main())
    assert traj.status == "completed"
    assert "str_replace_editor" not in traj.messages[0].content  # the template writes its own tool section
    assert "str_replace_editor" in qwen3_tok.decode(traj.prompt_ids)


def test_verify_runs_on_submit_and_when_the_turns_run_out(smollm2_tok):
    require_backend("docker")

    class FileTask(WorkspaceEnv):
        async def verify(self, task, ws):
            try:
                return float(await ws.read_file("/app/out.txt") == b"42\n"), {"checked": True}
            except FileNotFoundError:
                return 0.0, {"checked": True}

    async def episode(replies, max_turns):
        async with WorkspacePool(warm=0) as pool:
            env = FileTask(spec=WorkspaceSpec(image=workspace_image(), workdir="/app"), pool=pool, max_turns=max_turns)
            try:
                return await run_episode(env, ScriptedPolicy(smollm2_tok, replies), "Write 42 to /app/out.txt.",
                                         renderer=get_renderer(smollm2_tok), max_turns=10)
            finally:
                await env.close()

    done = asyncio.run(episode([call("bash", command="echo 42 > /app/out.txt"), call("submit")], 5))
    assert (done.status, done.reward) == ("completed", 1.0)
    cut = asyncio.run(episode([call("bash", command="echo 42 > /app/out.txt"), call("bash", command="ls")], 2))
    assert (cut.status, cut.reward) == ("truncated", 1.0)  # the env's turn limit: the work is still checked
    forged = asyncio.run(episode([call("bash", command="echo 41 > /app/out.txt"), call("submit")], 5))
    assert forged.reward == 0.0


@pytest.mark.parametrize("backend", ["docker", "bwrap"])
def test_a_process_the_agent_leaves_behind_cannot_touch_the_verifiers_files(smollm2_tok, backend):
    """The reward hack of an agent that outlives its turn: a `setsid` loop (out of the command's process group, so
    the command's end does not stop it) keeps overwriting the hidden test the verifier writes after submit. Every
    process of the workspace is killed before the verifier runs, so the wrong solution scores 0."""
    require_backend(backend)

    class HiddenTest(WorkspaceEnv):
        async def verify(self, task, ws):
            await ws.write_file("/app/hidden_test.sh", b"exit 1\n")  # the solution is wrong: the test fails
            await asyncio.sleep(1.0)  # a real verifier's own work, while the loop (if alive) rewrites the file
            result = await ws.exec("sh /app/hidden_test.sh", timeout_s=30)
            return float(result.exit_code == 0), {"test": (await ws.read_file("/app/hidden_test.sh")).decode()}

    loop = "setsid sh -c 'while :; do echo \"exit 0\" > /app/hidden_test.sh; sleep 0.02; done' >/dev/null 2>&1 &"

    async def episode():
        async with WorkspacePool(backend=backend, warm=0) as pool:
            env = HiddenTest(spec=WorkspaceSpec(image=workspace_image(), workdir="/app"), pool=pool)
            try:
                return await run_episode(env, ScriptedPolicy(smollm2_tok, [call("bash", command=loop),
                                                                           call("submit")]),
                                         "Make the hidden test pass.", renderer=get_renderer(smollm2_tok), max_turns=4)
            finally:
                await env.close()

    done = asyncio.run(episode())
    assert done.status == "completed", done.reason
    assert done.reward == 0.0 and done.info["test"] == "exit 1\n", done.info


def _gateway(tok, replies):
    from slime_env.gateway import Gateway

    return Gateway(ScriptedPolicy(tok, replies), get_renderer(tok, strict=True), "hermes", strict=True)


async def _hello_verify(task, ws):
    try:
        return float((await ws.read_file("/app/hello.txt")).strip() == b"hello"), {"checked": "hello.txt"}
    except FileNotFoundError:
        return 0.0, {"checked": "missing"}


def test_mini_swe_agent_unchanged_runs_its_commands_in_the_workspace(smollm2_tok):
    require_backend("docker")
    _require_mini_swe_agent()
    from slime_env.envs.workspace.harness import WorkspaceAgentEnv
    from slime_env.envs.workspace.mini_swe import mini_swe_agent

    replies = ["THOUGHT: write it.\n\n```mswea_bash_command\necho hello > /app/hello.txt && hostname\n```",
               "THOUGHT: done.\n\n```mswea_bash_command\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```"]

    async def main():
        gw = _gateway(smollm2_tok, replies)
        async with WorkspacePool(warm=0) as pool:
            env = WorkspaceAgentEnv(mini_swe_agent(), _hello_verify, pool=pool,
                                    spec=WorkspaceSpec(image=workspace_image(), workdir="/app"))
            await gw.start()
            try:
                return await env.run(gw, Task.coerce({"prompt": "Create /app/hello.txt with hello."}, "t"))
            finally:
                await gw.stop()

    (traj,) = asyncio.run(main())
    assert (traj.status, traj.reward) == ("completed", 1.0), traj.reason
    assert traj.metadata["workspace"]["checked"] == "hello.txt"
    text = smollm2_tok.decode(traj.response_ids)
    assert "<output>\nworkspace\n</output>" in text  # the command ran in the workspace (its hostname), not here
    traj.check()
    assert len(traj.metadata["calls"]) == 2


def test_an_agent_that_only_claims_success_scores_zero(smollm2_tok):
    require_backend("docker")
    _require_mini_swe_agent()
    from slime_env.envs.workspace.harness import WorkspaceAgentEnv
    from slime_env.envs.workspace.mini_swe import mini_swe_agent

    replies = ["All done, the file exists.\n\n```mswea_bash_command\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```"]

    async def main():
        gw = _gateway(smollm2_tok, replies)
        async with WorkspacePool(warm=0) as pool:
            env = WorkspaceAgentEnv(mini_swe_agent(), _hello_verify, pool=pool,
                                    spec=WorkspaceSpec(image=workspace_image(), workdir="/app"))
            await gw.start()
            try:
                return await env.run(gw, Task.coerce({"prompt": "Create /app/hello.txt with hello."}, "t"))
            finally:
                await gw.stop()

    (traj,) = asyncio.run(main())
    assert traj.status == "completed" and traj.reward == 0.0


def test_the_plain_openai_sdk_agent_example_in_a_workspace(qwen3_tok):
    require_backend("docker")
    from slime_env.loading import load_object

    make_env = load_object("examples/workspace_openai_agent.py:make_env")
    replies = [call("bash", command="echo hello > /app/hello.txt"), call("submit")]

    async def main():
        gw = _gateway(qwen3_tok, replies)
        async with WorkspacePool(warm=0) as pool:
            env = make_env(verify=_hello_verify, pool=pool, image=workspace_image())
            await gw.start()
            try:
                return await env.run(gw, Task.coerce({"prompt": "Create /app/hello.txt with hello."}, "t"))
            finally:
                await gw.stop()

    (traj,) = asyncio.run(main())
    assert (traj.status, traj.reward) == ("completed", 1.0), traj.reason
    traj.check()


def test_gymnasiums_close_takes_the_warm_workspaces_with_it():
    """`gymnasium.make("slime_env/Workspace-v0")`: the env's workspaces come from the process's shared pool on the
    adapter's own loop, which keeps warm ones started; `close()` ends them, not the process's exit."""
    require_backend("docker")
    import socket

    import gymnasium

    from slime_env.tools_sandbox.workspace.docker import LABEL, OWNER_LABEL, docker_client

    def ours() -> list[str]:
        prefix = f"{socket.gethostname()}:{os.getpid()}:"
        return [c.id for c in docker_client().containers.list(all=True, filters={"label": LABEL}, sparse=True)
                if (c.attrs.get("Labels") or {}).get(OWNER_LABEL, "").startswith(prefix)]

    before = ours()
    env = gymnasium.make("slime_env/Workspace-v0", spec=WorkspaceSpec(image=workspace_image(), workdir="/app"),
                         warm=2)
    env.reset(seed=0)
    assert len(ours()) > len(before)  # the episode's workspace, and the warm ones started beside it
    env.close()
    assert ours() == before


def test_a_harness_episode_with_branches_counts_its_time_once():
    """The issue's mini-swe-agent run: 147.8 s, 144.6 s generating over three branches, 2.8 s in the container.
    Every branch came back with the session's whole `total_s` and the same container record, so `time_split`
    reported 443 s, 8.4 s in containers and a generation share of 0.33. Counted once: 147.8 s and 0.98."""
    from types import SimpleNamespace

    from slime_env.envs.workspace.harness import WorkspaceAgentEnv
    from slime_env.trajectory import Trajectory

    task = Task.coerce({"prompt": "p"}, "t")
    gens = [100.0, 30.0, 14.6]

    class Gateway:
        def open_session(self, task):
            return SimpleNamespace(id="s", key="k")

        def session_url(self, session, api):
            return "http://gateway.invalid/v1"

        def close_session(self, sid, status, reason):
            return [Trajectory(task=task, prompt_ids=[], response_ids=[], loss_mask=[], rollout_logprobs=[], spans=[],
                               turn_rewards=[0.0], reward=0.0, status="completed",
                               timings={"total_s": 147.8, "generate_s": g, "env_s": 0.0, "framework_s": 0.0},
                               metadata={"session": "s", "calls": [{"at": float(i)}]}) for i, g in enumerate(gens)]

    class Space:
        exec_s = 2.6

        async def kill_processes(self):
            return 0

    class Pool:
        async def acquire(self, spec):
            return Space()

        async def release(self, ws):
            return None

    async def agent(url, key, task, ws):
        return "done"

    env = WorkspaceAgentEnv(agent, lambda task, ws: 1.0, pool=Pool(), spec=WorkspaceSpec(image="none"))
    trajs = asyncio.run(env.run(Gateway(), task))
    assert [t.reward for t in trajs] == [1.0] * 3 and "branch_of" not in trajs[0].metadata
    m = time_split(trajs)
    assert m["rollout/time/generate_s"] == pytest.approx(144.6)
    assert sum(t.timings["total_s"] for t in trajs) == pytest.approx(147.8)
    assert m["rollout/time/generate_frac"] == pytest.approx(144.6 / 147.8)
    # the container's seconds once (on the main trajectory); the verifier's record on every branch
    assert [("exec_s" in t.metadata["workspace"]) for t in trajs] == [True, False, False]
    assert m["rollout/time/container_s"] < 2.7 + 0.5  # exec 2.6 plus this test's start and verify, not 3x
    assert all(t.timings["total_s"] >= t.timings["generate_s"] for t in trajs)


def test_a_workspace_that_dies_ends_the_episode_at_once_with_its_reason(smollm2_tok):
    """The workspace is killed while a command runs (as the limits' watchdog kills one at its disk limit): the
    episode ends after that turn with the reason. Before, the agent was answered "workspace is dead" turn after turn
    until it submitted or ran out of turns. The workspace was the agent's (a disk it filled): truncated with reward 0,
    never an excluded status an agent could reach by breaking its machine (before this: `failed`, out of the loss)."""
    require_backend("docker")

    class Killed(WorkspaceEnv):
        async def step(self, action):
            ws = self.state["workspace"]
            killer = asyncio.get_running_loop().call_later(
                1.0, lambda: asyncio.ensure_future(ws.kill("its disk limit (1 GiB) was reached")))
            try:
                return await super().step(action)
            finally:
                killer.cancel()

    async def episode():
        async with WorkspacePool(warm=0) as pool:
            env = Killed(spec=WorkspaceSpec(image=workspace_image(), workdir="/app"), pool=pool)
            try:
                replies = [call("bash", command="sleep 20"), call("bash", command="ls"), call("submit")]
                return await run_episode(env, ScriptedPolicy(smollm2_tok, replies), "Do the task.",
                                         renderer=get_renderer(smollm2_tok), max_turns=5)
            finally:
                await env.close()

    done = asyncio.run(episode())
    assert (done.status, done.reward) == ("truncated", 0.0), (done.status, done.reason)
    assert "disk limit (1 GiB) was reached" in done.info["workspace_dead"], done.info
    assert done.num_turns == 1 and not done.to_slime_sample()["remove_sample"]
