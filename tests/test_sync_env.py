"""from_sync: a blocking env runs in a bounded pool and never blocks the event loop."""

from __future__ import annotations

import asyncio
import threading
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


class RendezvousEnv(SlowEchoEnv):
    """Blocks in `reset` until all `parties` envs are inside `reset` at once (only possible if they run
    concurrently), and in `step` until the event loop has run while this thread was blocked."""

    def __init__(self, barrier, in_call, loop_ran):
        super().__init__(delay=0)
        self.barrier, self.in_call, self.loop_ran = barrier, in_call, loop_ran

    def reset(self, *, seed=None, options=None):
        self.barrier.wait(timeout=60)  # BrokenBarrierError (a failed episode) if the resets were serialised
        return super().reset(seed=seed, options=options)

    def step(self, text):
        self.in_call.set()
        if not self.loop_ran.wait(timeout=60):
            raise RuntimeError("the event loop did not run while a blocking step was in progress")
        return super().step(text)


def test_blocking_envs_run_concurrently_and_loop_stays_responsive(smollm2_tok):
    """No clocks: the four resets meet at a barrier (they overlap or the episodes fail), and each step waits
    for a sign, given by a coroutine, that the loop kept running while the step's thread was blocked."""
    renderer = get_renderer(smollm2_tok, strict=True)
    barrier, in_call, loop_ran = threading.Barrier(4), threading.Event(), threading.Event()
    envs = [RendezvousEnv(barrier, in_call, loop_ran) for _ in range(4)]

    async def heartbeat(stop):
        while not stop.is_set():
            if in_call.is_set():  # a blocking step is in progress in a worker thread, and the loop runs
                loop_ran.set()
            await asyncio.sleep(0.005)

    async def main():
        stop = asyncio.Event()
        hb = asyncio.create_task(heartbeat(stop))
        trajs = await asyncio.gather(*(run_episode(from_sync(e), ScriptedPolicy(smollm2_tok, ["hi"]), task("cats"),
                                                   renderer=renderer) for e in envs))
        stop.set()
        await hb
        return trajs

    trajs = asyncio.run(main())
    assert all(t.status == "completed" and t.reward == 1.0 for t in trajs), [t.reason for t in trajs]
    assert not barrier.broken and loop_ran.is_set()
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
