"""Infrastructure failures never become rewards (docs/agentic.md, "Infrastructure failures"): each cause, injected for
real, ends its episode `infra_error` — out of the loss and out of its group's statistics, counted in the metrics — while
the agent's own failures keep their 0: an agent that breaks what its verifier runs on is scored, not excluded.

Real workspaces (bubblewrap and Docker), a real gateway on loopback, the real Harbor verifier; the policies are
`ScriptedPolicy`s on a real tokenizer (no model load). Faults are injected where the host would fail: the Docker engine
refusing a container, the verifier's container failing or hanging at its start, a harness package missing, the
gateway stopping and serving again between two of the agent's calls, the engine failing a call."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import aiohttp
import pytest
import torch

from slime_env import Env, InfraError, ScriptedPolicy, Task, get_renderer, run_episode
from slime_env.agent_env import AgentEnv
from slime_env.rollout.metrics import batch_metrics
from slime_env.trainers.algorithms import grpo_advantages
from slime_env.trainers.batch import pack
from slime_env.trajectory import Trajectory
from slime_env.tools_sandbox.workspace import WorkspaceError, WorkspaceSpec
from slime_env.tools_sandbox.workspace.pool import WorkspacePool
from workspace_support import require_backend, workspace_image


def call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def _traj(reward: float, status: str = "completed") -> Trajectory:
    return Trajectory(task=Task(prompt="p"), prompt_ids=[1, 2], response_ids=[3, 4], loss_mask=[1, 1],
                      rollout_logprobs=[-1.0, -1.0], spans=[], turn_rewards=[reward], reward=reward, status=status)


# --- the trainer's side ----------------------------------------------------------------------------------------
def test_the_trainer_leaves_infra_errors_out_of_the_loss_and_the_group_statistics():
    """A group of 4 where one container did not start: its row trains nothing, and the other three get the advantages
    of a group of three (before: the row counted as a 0 and lifted the 1 beside it)."""
    group = [_traj(1.0), _traj(0.0), _traj(1.0, "infra_error"), _traj(0.0)]
    batch = pack(group, group_size=4, pad_id=0)
    assert batch.loss_mask[2].sum() == 0 and batch.rewards[2] == 0.0
    expected = grpo_advantages(torch.tensor([1.0, 0.0, 0.0]), 3)
    got = batch.advantages[[0, 1, 3]][:, -1]
    assert torch.allclose(got, expected), (got, expected)
    per_turn = pack(group, group_size=4, pad_id=0, reward_assignment="per_turn")
    assert torch.allclose(per_turn.advantages[[0, 1, 3]][:, -1], expected, atol=1e-5)
    sample = group[2].to_slime_sample()
    assert sample["remove_sample"] and sample["reward"] == 0.0 and set(sample["loss_mask"]) == {0}
    assert sample["status"] == "failed" and sample["metadata"]["status"] == "infra_error"  # slime has no status for it

    class G:  # a finished group as the rollout manager hands it over
        env_id, trajectories = "e", group

    m = batch_metrics([G()], [], 1.0)
    assert m["rollout/status/infra_error"] == 1 and m["rollout/status/completed"] == 3


def test_an_env_that_raises_infra_error_gives_the_status_not_a_reward(smollm2_tok):
    class HostGone(Env):
        async def reset(self, *, seed=None, options=None):
            try:
                raise ConnectionRefusedError("the sandbox host refused the connection")
            except OSError as e:
                raise InfraError("the episode's sandbox host is gone") from e

        async def step(self, action):
            raise AssertionError("never reached")

    traj = asyncio.run(run_episode(HostGone(), ScriptedPolicy(smollm2_tok, ["x"]), "p",
                                   renderer=get_renderer(smollm2_tok)))
    assert traj.status == "infra_error" and "sandbox host is gone" in traj.reason, (traj.status, traj.reason)


# --- a container that fails to start ------------------------------------------------------------------------
@pytest.mark.parametrize("fault", ["missing image", "docker engine error"])
def test_a_container_that_does_not_start_is_an_infra_error(smollm2_tok, monkeypatch, fault):
    """Before: `failed` (no status of its own, not counted apart)."""
    require_backend("docker")
    from slime_env.envs.workspace import WorkspaceEnv
    from slime_env.tools_sandbox.workspace.docker import DockerWorkspace

    image = "slime-env-no-such-image:never" if fault == "missing image" else workspace_image()
    if fault == "docker engine error":
        import docker

        def refuse(self, image):
            raise docker.errors.APIError("500 Server Error: Internal Server Error (\"failed to create task for "
                                         "container: failed to create shim task: OCI runtime create failed\")")

        monkeypatch.setattr(DockerWorkspace, "_create", refuse)

    async def episode():
        async with WorkspacePool(warm=0) as pool:
            env = WorkspaceEnv(spec=WorkspaceSpec(image=image, workdir="/app"), pool=pool)
            try:
                return await run_episode(env, ScriptedPolicy(smollm2_tok, [call("submit")]), "Do it.",
                                         renderer=get_renderer(smollm2_tok), max_turns=2)
            finally:
                await env.close()

    traj = asyncio.run(episode())
    assert traj.status == "infra_error" and "the workspace did not start" in traj.reason, (traj.status, traj.reason)
    assert traj.response_ids == [] and traj.to_slime_sample()["remove_sample"]


# --- Harbor: the verifier's container, and an agent that breaks the verifier ---------------------------------
def _harbor_task(root: Path) -> Path:
    d = root / "answer-42"
    for sub in ("environment", "tests", "solution"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    (d / "task.toml").write_text(f'[verifier]\ntimeout_sec = 30.0\n\n[environment]\ndocker_image = '
                                 f'"{workspace_image()}"\nworkdir = "/app"\n')
    (d / "instruction.md").write_text("Write 42 to /app/out.txt.\n")
    # the task's tests run a checker the agent writes (as a task's tests run the agent's code)
    (d / "tests" / "test.sh").write_text(
        "#!/bin/bash\n[ -f /app/check.sh ] && bash /app/check.sh\n"
        "if [ \"$(cat /app/out.txt)\" = 42 ]; then echo 1 > /logs/verifier/reward.txt; "
        "else echo 0 > /logs/verifier/reward.txt; fi\n")
    (d / "solution" / "solve.sh").write_text("#!/bin/bash\necho 42 > /app/out.txt\n")
    return d


async def _bwrap_open(spec):
    from slime_env.tools_sandbox.workspace.open import open_workspace

    return await open_workspace(spec, backend="bwrap")


async def _bwrap_task_workspace(task):
    from slime_env.envs.harbor import environment
    from slime_env.envs.harbor.env import harbor_task

    return await environment.open_task_workspace(harbor_task(task), open_workspace=_bwrap_open)


@pytest.fixture(scope="module")
def harbor_episode(smollm2_tok, tmp_path_factory):
    """`episode(replies)`: one Harbor-v0 episode on the answer-42 task, the agent's workspace in bubblewrap, the
    verifier's fresh workspace from `verifier.docker_open` (each test puts its own there)."""
    require_backend("bwrap")
    from slime_env.envs.harbor import HarborEnv

    folder = _harbor_task(tmp_path_factory.mktemp("harbor"))

    def episode(replies):
        async def main():
            env = HarborEnv(workspace=_bwrap_task_workspace, max_turns=4)
            try:
                return await run_episode(env, ScriptedPolicy(smollm2_tok, replies),
                                         Task(prompt="Write 42 to /app/out.txt.",
                                              metadata={"harbor_task": str(folder)}),
                                         renderer=get_renderer(smollm2_tok), max_turns=4)
            finally:
                await env.close()

        return asyncio.run(main())

    return episode


SOLVE = [call("bash", command="echo 42 > /app/out.txt"), call("submit")]


def test_harbor_verifier_control_scores_the_work(harbor_episode, monkeypatch):
    monkeypatch.setattr("slime_env.envs.harbor.verifier.docker_open", _bwrap_open)
    traj = harbor_episode(SOLVE)
    assert (traj.status, traj.reward) == ("completed", 1.0), traj.reason


@pytest.mark.parametrize("fault", ["crash", "hang"])
def test_a_verifier_container_that_fails_or_hangs_at_its_start_is_an_infra_error(harbor_episode, monkeypatch, fault):
    """Before: the verifier's status `error` and reward 0.0 in a `completed` episode — a fake 0 that trained."""
    if fault == "crash":
        async def opener(spec):
            raise WorkspaceError(f"could not start a workspace from {spec.image!r}: APIError: 500 Server Error "
                                 "(\"Error response from daemon: no space left on device\")")
    else:
        monkeypatch.setattr("slime_env.envs.harbor.verifier.VERIFIER_START_TIMEOUT_S", 0.5)

        async def opener(spec):
            await asyncio.sleep(3600)  # the engine never answers

    monkeypatch.setattr("slime_env.envs.harbor.verifier.docker_open", opener)
    traj = harbor_episode(SOLVE)
    assert traj.status == "infra_error", (traj.status, traj.reason)
    assert "the verifier" in traj.reason and ("no space left" in traj.reason if fault == "crash"
                                              else "within 0.5s" in traj.reason), traj.reason


def test_an_agent_that_kills_the_verifier_gets_its_0_not_an_exclusion(harbor_episode, monkeypatch):
    """Adversarial: the agent's checker, run by the task's tests, kills every process it can in the verifier's
    workspace (the tests, and in bubblewrap the workspace's own agent). That happens after the agent's work is in the
    verifier's workspace: the agent's doing — `completed` with reward 0, never `infra_error`."""
    monkeypatch.setattr("slime_env.envs.harbor.verifier.docker_open", _bwrap_open)
    sabotage = [call("bash", command="echo 41 > /app/out.txt; printf 'kill -9 -1\\n' > /app/check.sh"),
                call("submit")]
    traj = harbor_episode(sabotage)
    assert (traj.status, traj.reward) == ("completed", 0.0), (traj.status, traj.reason)
    assert traj.info["harbor"]["status"] != "ok", traj.info["harbor"]


# --- harnesses through the gateway -----------------------------------------------------------------------------
async def _chat(http: aiohttp.ClientSession, base_url: str, key: str) -> str:
    async with http.post(f"{base_url}/chat/completions", headers={"Authorization": f"Bearer {key}"},
                         json={"model": "m", "messages": [{"role": "user", "content": "go"}]}) as r:
        if r.status != 200:
            raise RuntimeError(f"the gateway answered {r.status}: {await r.text()}")
        return (await r.json())["choices"][0]["message"]["content"]


def _gateway(tok, policy=None):
    from slime_env.gateway import Gateway

    return Gateway(policy or ScriptedPolicy(tok, ["ok"]), get_renderer(tok), "hermes")


def test_a_harness_whose_package_is_missing_is_an_infra_error(smollm2_tok, monkeypatch):
    """mini-swe-agent not importable on the host (the harness's 'binary' missing). Before: `failed`."""
    require_backend("bwrap")
    from slime_env.envs.workspace.harness import WorkspaceAgentEnv
    from slime_env.envs.workspace.mini_swe import mini_swe_agent

    monkeypatch.setitem(sys.modules, "minisweagent.agents.default", None)  # import fails as if not installed

    async def main():
        gw = _gateway(smollm2_tok)
        await gw.start()
        async with WorkspacePool(backend="bwrap", warm=0) as pool:
            env = WorkspaceAgentEnv(mini_swe_agent(), lambda task, ws: 1.0, pool=pool,
                                    spec=WorkspaceSpec(image=workspace_image(), workdir="/app"))
            try:
                return await env.run(gw, Task(prompt="Do it."))
            finally:
                await gw.stop()

    (traj,) = asyncio.run(main())
    assert traj.status == "infra_error" and "mini-swe-agent is not installed" in traj.reason, (traj.status,
                                                                                               traj.reason)


def test_a_gateway_restart_between_the_agents_calls_is_an_infra_error(smollm2_tok):
    """The gateway stops and serves again (on another port, as a restarted process would) between two calls: the
    agent's second call is refused and it crashes. Before: `failed`, its one recorded call counted apart from
    nothing. Its recorded call is kept in the record, out of the loss."""
    gw = _gateway(smollm2_tok)

    async def agent(base_url, key, task):
        async with aiohttp.ClientSession() as http:
            await _chat(http, base_url, key)
            await gw.stop()  # the injected restart
            await gw.start()
            await _chat(http, base_url, key)

    async def main():
        await gw.start()
        try:
            return await AgentEnv(agent, lambda *a: 1.0, strict=False).run(gw, Task(prompt="go"))
        finally:
            await gw.stop()

    (traj,) = asyncio.run(main())
    assert traj.status == "infra_error" and "the gateway stopped" in traj.reason, (traj.status, traj.reason)
    assert traj.num_turns == 1 and traj.to_slime_sample()["remove_sample"]


def test_an_engine_failure_the_agent_gives_up_on_is_an_infra_error_one_it_survives_is_not(smollm2_tok):
    """The engine fails one call (the gateway's 502). An agent that gives up on it: infra_error. An agent that retries
    and goes on: its own outcome stands. An agent that crashes on its own, with no host fault: `failed` as before."""

    class Flaky(ScriptedPolicy):
        fail_next = False

        async def generate(self, input_ids, sampling_params):
            if Flaky.fail_next:
                Flaky.fail_next = False
                raise ConnectionResetError("the engine's connection was reset")
            return await super().generate(input_ids, sampling_params)

    gw = _gateway(smollm2_tok, Flaky(smollm2_tok, ["ok"]))

    def agent(retry: bool, own_crash: bool = False):
        async def run(base_url, key, task):
            async with aiohttp.ClientSession() as http:
                await _chat(http, base_url, key)
                if own_crash:
                    raise ValueError("the harness's own bug")
                Flaky.fail_next = True
                try:
                    await _chat(http, base_url, key)
                except RuntimeError:
                    if not retry:
                        raise
                    await _chat(http, base_url, key)
        return run

    async def main():
        await gw.start()
        try:
            return [(await AgentEnv(agent(*how), lambda *a: 1.0, strict=False).run(gw, Task(prompt="go")))[0]
                    for how in ((False,), (True,), (False, True))]
        finally:
            await gw.stop()

    gave_up, survived, own = asyncio.run(main())
    assert gave_up.status == "infra_error" and "the engine failed" in gave_up.reason, gave_up.reason
    assert (survived.status, survived.reward) == ("completed", 1.0), survived.reason
    assert own.status == "failed" and "the harness's own bug" in own.reason, (own.status, own.reason)
