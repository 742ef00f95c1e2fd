"""Env servers (`serve-env` + `RemoteEnv`) and the Ray backend."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading

import pytest
from helpers import LocalServer
from test_rollout import CoinEnv  # noqa: F401 - registers TestCoin-v0 in this process

from slime_env import Env, RolloutManager, ScriptedPolicy, Task, get_renderer, make, run_episode
from slime_env.http import HttpClient, RemoteError
from slime_env.rollout.env_server import EnvServer, RemoteEnv, close_shared_clients

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
TASK = Task(prompt="What is 6*7?", label=42)


@pytest.fixture(scope="module")
def renderer(smollm2_tok):
    return get_renderer(smollm2_tok, strict=True)


class Served(LocalServer):
    """An EnvServer on 127.0.0.1 inside the test's event loop."""

    def __init__(self, env_id, **kw):
        self.server = EnvServer(env_id, **kw)
        super().__init__(self.server.app())


def test_cli_server_and_remote_env_match_local(smollm2_tok, renderer):
    proc = subprocess.Popen([sys.executable, "-m", "slime_env", "serve-env", "Calculator-v0", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening on "), line
        url = line.split()[-1]
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # never let its pipe fill up

        async def main():
            remote = RemoteEnv(url)
            a = await run_episode(remote, ScriptedPolicy(smollm2_tok, [CALL, "<answer>42</answer>"]), TASK,
                                  renderer=renderer)
            await remote.close()
            b = await run_episode(make("Calculator-v0"), ScriptedPolicy(smollm2_tok, [CALL, "<answer>42</answer>"]),
                                  TASK, renderer=renderer)
            await close_shared_clients()
            return a, b

        remote_traj, local_traj = asyncio.run(main())
        assert remote_traj.status == "completed" and remote_traj.reward == 1.0, remote_traj.reason
        assert remote_traj.tokens == local_traj.tokens and remote_traj.loss_mask == local_traj.loss_mask
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_capacity_reaper_timeout_and_dead_server(smollm2_tok, renderer):
    async def main():
        out = {}
        async with Served("Calculator-v0", max_sessions=2, idle_timeout_s=0.3) as s:
            envs = [RemoteEnv(s.url) for _ in range(3)]
            for e in envs[:2]:
                await e.reset(options={"task": TASK})
            envs[2].client = HttpClient(s.url, max_retries=0)
            with pytest.raises(RemoteError, match="at capacity: 2 of 2"):
                await envs[2].reset(options={"task": TASK})
            await asyncio.sleep(0.8)  # both sessions idle past 0.3 s: reaped
            out["after_reap"] = len(s.server.sessions)
            traj = await run_episode(envs[0], ScriptedPolicy(smollm2_tok, [CALL]), TASK, renderer=renderer)
            out["reaped"] = traj
        async with Served("TestCoin-v0", request_timeout_s=0.2) as s:
            slow = Task(prompt="slow", metadata={"delay": 1.0})
            out["timeout"] = await run_episode(RemoteEnv(s.url), ScriptedPolicy(smollm2_tok, ["x"]), slow,
                                               renderer=renderer)
            boom = Task(prompt="boom", metadata={"boom": True})
            out["boom"] = await run_episode(RemoteEnv(s.url), ScriptedPolicy(smollm2_tok, ["x"]), boom,
                                            renderer=renderer)
            dying = RemoteEnv(s.url)
            await dying.reset(options={"task": TASK})
        # the server is gone now
        policy = ScriptedPolicy(smollm2_tok, ["x"])
        out["dead"] = await run_episode(RemoteEnv(s.url), policy, TASK, renderer=renderer)
        await close_shared_clients()
        return out

    out = asyncio.run(main())
    assert out["after_reap"] == 0
    assert out["reaped"].status == "failed" and "no session" in out["reaped"].reason
    assert out["timeout"].status == "failed" and "504" in out["timeout"].reason
    assert out["boom"].status == "failed" and "RuntimeError: boom" in out["boom"].reason
    assert out["dead"].status == "failed" and "connection failed" in out["dead"].reason


def test_rollout_manager_through_remote_envs(smollm2_tok, renderer):
    async def main():
        async with Served("Calculator-v0") as s:
            manager = RolloutManager([TASK] * 4, env_factory=lambda task, env_id: RemoteEnv(s.url),
                                     policy=ScriptedPolicy(smollm2_tok, [CALL, "<answer>42</answer>"]),
                                     renderer=renderer, n_samples_per_prompt=3)
            batch = await manager.generate_batch(4)
            await manager.close()
            await close_shared_clients()
            return batch, len(s.server.sessions)

    batch, left = asyncio.run(main())
    assert len(batch.groups) == 4 and all(t.reward == 1.0 for g in batch.groups for t in g.trajectories)
    assert left == 0  # every RemoteEnv closed its session


def test_ray_backend_with_two_actors(smollm2_tok, renderer):
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        async def main():
            manager = RolloutManager([TASK] * 6, env_id="Calculator-v0", backend="ray", ray_actors=2,
                                     policy=ScriptedPolicy(smollm2_tok, [CALL, "<answer>42</answer>"]),
                                     renderer=renderer, n_samples_per_prompt=2)
            batch = await manager.generate_batch(6)
            stats = await manager.runner._ray_pools["Calculator-v0"].stats()
            await manager.close()
            return batch, stats

        batch, stats = asyncio.run(main())
        assert stats == [{"open": 0, "created": 6}, {"open": 0, "created": 6}]  # spread evenly, all closed
        assert len(batch.groups) == 6
        assert all(t.status == "completed" and t.reward == 1.0 for g in batch.groups for t in g.trajectories)
    finally:
        ray.shutdown()


class StopEnv(Env):
    """One turn that ends at a stop string (as Search-v0's turns end at </search>)."""

    stop = ("</search>",)

    async def reset(self, *, seed=None, options=None):
        return self.task_from(options).messages(), {}

    async def step(self, action):
        return [], 1.0, True, False, {}


def test_remote_env_carries_the_envs_stop_strings(smollm2_tok, renderer):
    from slime_env import register

    register("TestStop-v0", StopEnv, override=True)

    class Recording(ScriptedPolicy):
        def plan(self, input_ids, sampling_params):  # every generation path plans its reply here
            self.seen = dict(sampling_params)
            return super().plan(input_ids, sampling_params)

    async def main():
        async with Served("TestStop-v0") as s:
            policy = Recording(smollm2_tok, ["ok"])
            remote = RemoteEnv(s.url)
            traj = await run_episode(remote, policy, TASK, renderer=renderer)
            await remote.close()
            await close_shared_clients()
            return traj, policy.seen, remote.stop

    traj, params, stop = asyncio.run(main())
    assert traj.status != "failed", traj.reason
    assert stop == ("</search>",) and "</search>" in params["stop"]
