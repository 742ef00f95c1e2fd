"""from_sync: a blocking env runs in a bounded pool and never blocks the event loop."""

from __future__ import annotations

import asyncio
import time

import pytest
from helpers import task

from slime_env import ScriptedPolicy, from_sync, get_renderer, run_episode
from slime_env.errors import InvalidInput


class SlowEchoEnv:
    """A synchronous text env that blocks (time.sleep) in every call."""

    def __init__(self, delay=0.2, turns=2):
        self.delay, self.turns, self.n = delay, turns, 0
        self.closed = False

    def reset(self, *, seed=None, options=None):
        time.sleep(self.delay)
        self.n = 0
        return f"Say something about {options['task']['prompt']}", {"seed": seed}

    def step(self, text):
        time.sleep(self.delay)
        self.n += 1
        done = self.n >= self.turns
        return f"you said {text!r}", float(done), done, False, {"n": self.n}

    def close(self):
        self.closed = True


def test_blocking_envs_run_concurrently_and_loop_stays_responsive(smollm2_tok):
    renderer = get_renderer(smollm2_tok, strict=True)
    envs = [SlowEchoEnv() for _ in range(4)]
    ticks = []

    async def heartbeat(stop):
        while not stop.is_set():
            ticks.append(time.perf_counter())
            await asyncio.sleep(0.01)

    async def main():
        stop = asyncio.Event()
        hb = asyncio.create_task(heartbeat(stop))
        t0 = time.perf_counter()
        trajs = await asyncio.gather(*(run_episode(from_sync(e), ScriptedPolicy(smollm2_tok, ["hi"]), task("cats"),
                                                   renderer=renderer) for e in envs))
        elapsed = time.perf_counter() - t0
        stop.set()
        await hb
        return trajs, elapsed

    trajs, elapsed = asyncio.run(main())
    assert all(t.status == "completed" and t.reward == 1.0 for t in trajs)
    # 4 envs x 3 blocking calls x 0.2 s = 2.4 s if serial; concurrent: about 0.6 s
    assert elapsed < 1.5
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    assert max(gaps) < 0.15  # the loop kept ticking while envs slept
    t = trajs[0]
    assert [m.role for m in t.messages] == ["user", "assistant", "user", "assistant", "user"]
    assert t.messages[0].content == "Say something about cats"


def test_close_and_contract_errors():
    env = SlowEchoEnv(delay=0)
    wrapped = from_sync(env)
    asyncio.run(wrapped.close())
    assert env.closed
    with pytest.raises(InvalidInput, match="object has no reset"):
        from_sync(object())

    class Bad:
        def reset(self, *, seed=None, options=None):
            return "only obs"

        def step(self, text):
            return "x"

    with pytest.raises(InvalidInput, match=r"Bad.reset must return \(observation, info\)"):
        asyncio.run(from_sync(Bad()).reset())
