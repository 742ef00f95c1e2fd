"""Rollout manager throughput against a STUB engine (fixed latency, canned tokens; see stub_engine.py).

Each episode has `--turns` turns; every generation takes `--latency-ms`. With C episodes in flight,
Little's law gives the ideal throughput C / (turns x latency) episodes/s; we print the achieved one
beside it, and the framework's share of episode time (time inside episodes spent neither waiting for
the engine nor in the env). Set-ups, same run: an in-process stub policy (no HTTP: the framework
alone), the stub engine over HTTP through SGLangPolicy, the same with every env behind `serve-env`
(RemoteEnv: HTTP per reset/step), envs in 2 Ray actors, and the in-process stub with the manager's groups
run in 1 and 2 driver worker processes (`workers=`). `--compare-rev REV` also measures the in-process and HTTP
rows with the code of git revision REV (a worktree, same machine, same run): the old path beside the new.
Every row is measured after a warm-up batch of as many episodes as are in flight (steady state).

    python bench/rollout.py [--concurrency 1000 10000] [--turns 3] [--latency-ms 20] [--compare-rev REV]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import slime_env
from slime_env import Env, Generation, Message, RolloutManager, Task, get_renderer
from slime_env.offline_tokenizers import smollm2
from slime_env.rollout import EpisodeOptions, ExecutionOptions, GroupOptions

HERE = Path(__file__).resolve().parent
CANNED = (28120, 905, 30, 2)  # "hello world." + <|im_end|> in SmolLM2's vocabulary


class TurnsEnv(Env):
    """`turns` turns of a fixed observation, reward 1 at the end: the env costs next to nothing."""

    def __init__(self, turns: int = 3):
        self.turns = turns

    async def reset(self, *, seed=None, options=None):
        self.k = 0
        return self.task_from(options).messages(), {}

    async def step(self, action):
        self.k += 1
        done = self.k >= self.turns
        return ([] if done else [Message("user", "next")]), float(done), done, False, {}


slime_env.register("BenchTurns-v0", TurnsEnv)


class StubPolicy:
    """In-process stub: sleeps `latency_s`, returns the canned ids."""

    def __init__(self, latency_s: float):
        self.latency_s = latency_s

    async def generate(self, input_ids, params):
        await asyncio.sleep(self.latency_s)
        return Generation(CANNED, (-0.5,) * len(CANNED), "stop")


def _spawn(args: list[str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(HERE)})
    for line in proc.stdout:
        if line.startswith("listening on "):
            # keep draining its output: a server blocked on a full pipe would stall the benchmark
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, line.split()[-1]
    raise RuntimeError(f"{args} did not start")


async def measure(policy, renderer, concurrency: int, turns: int, env_factory=None, backend="local",
                  workers: int = 0) -> dict:
    n = 8
    groups = 2 * concurrency // n
    # Steady state: a warm-up batch first (worker processes started, engine connections open, caches warm), as
    # in a training run that has been going for a while.
    warm = concurrency // n
    tasks = [Task(prompt=f"task {i}", id=str(i)) for i in range(groups + warm)]
    manager = RolloutManager(tasks, env_id="BenchTurns-v0", env_kwargs={"turns": turns}, env_factory=env_factory,
                             policy=policy, renderer=renderer, episode=EpisodeOptions(max_turns=turns),
                             groups=GroupOptions(n_samples_per_prompt=n, max_concurrency=concurrency),
                             execution=ExecutionOptions(backend=backend, workers=workers))
    if warm:
        await manager.generate_batch(warm)
    # Workers tokenize in their own processes: only an in-process row can time its tokenizer calls.
    with _timed_tokenizer() if not workers else contextlib.nullcontext({}) as tokenizer:
        t0 = time.perf_counter()
        cpu0 = time.process_time()
        batch = await manager.generate_batch(groups)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    await manager.close()
    m = batch.metrics
    if m["rollout/status/completed"] != groups * n:
        first = next(t for g in batch.groups for t in g.trajectories if t.status != "completed")
        raise RuntimeError(f"{int(m['rollout/status/failed'])} episodes failed, e.g.: {first.reason}")
    per_turn = 1e6 / (m["rollout/episodes"] * turns)
    return {"episodes_per_s": m["rollout/episodes"] / wall, "framework_frac": m["rollout/time/framework_frac"],
            "cpu_per_turn_us": cpu * per_turn, **{f"{k}_us": v * per_turn for k, v in tokenizer.items()}}


@contextlib.contextmanager
def _timed_tokenizer() -> Iterator[dict[str, float]]:
    """Seconds spent in tokenizer calls while inside (they all go through TokenCodec): encodes (observations,
    template glue) and decodes (each generated turn for the parser, each response once), so the driver's cost
    per turn can be quoted with and without them."""
    from slime_env.token_codec import TokenCodec

    spent = {"tokenizer_encode": 0.0, "tokenizer_decode": 0.0}
    originals = {"encode": TokenCodec.encode, "decode": TokenCodec.decode}

    def timed(name, fn):
        def call(self, arg):
            t = time.perf_counter()
            try:
                return fn(self, arg)
            finally:
                spent[f"tokenizer_{name}"] += time.perf_counter() - t
        return call

    for name, fn in originals.items():
        setattr(TokenCodec, name, timed(name, fn))
    try:
        yield spent
    finally:
        for name, fn in originals.items():
            setattr(TokenCodec, name, fn)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--skip", nargs="*", default=[], choices=["http", "remote_env", "ray", "workers"])
    ap.add_argument("--compare-rev", default=None, help="also run the in-process row with this git revision's code")
    args = ap.parse_args()
    # here, not at the top: --compare-rev imports this file's `measure` into an older tree without this module
    from slime_env.rollout.loop import loop_name, run_loop

    latency = args.latency_ms / 1000
    renderer = get_renderer(smollm2())
    engine, engine_url = _spawn([str(HERE / "stub_engine.py"), "--latency-ms", str(args.latency_ms)])
    env_server, env_url = _spawn(["-c", "import rollout, slime_env.rollout.env_server as s; "
                                        "s.serve('BenchTurns-v0', port=0, max_sessions=100000)"])
    print(f"bench/rollout.py  STUB engine ({args.latency_ms:g} ms per generation, canned tokens), {args.turns} turns "
          f"per episode, groups of 8, {os.cpu_count()} CPU cores, driver loop: {loop_name()}")
    print(f"{'set-up':<26} {'in flight':>9} {'ideal ep/s':>10} {'achieved':>9} {'ratio':>6} {'framework share':>15} "
          f"{'driver CPU/turn':>15}")
    try:
        from slime_env.rollout.env_server import RemoteEnv

        for c in args.concurrency:
            ideal = c / (args.turns * latency)
            setups = [("in-process stub policy", lambda c=c: measure(StubPolicy(latency), renderer, c, args.turns))]
            if args.compare_rev:
                setups.insert(0, (f"in-process, code of {args.compare_rev[:10]}",
                                  lambda c=c: _at_revision(args.compare_rev, c, args.turns, args.latency_ms)))
            if "workers" not in args.skip:
                for w in (1, 2):
                    setups.append((f"in-process stub, {w} worker{'s' * (w > 1)}", lambda c=c, w=w: measure(
                        StubPolicy(latency), renderer, c, args.turns, workers=w)))
            if "http" not in args.skip:
                if args.compare_rev:
                    setups.append((f"HTTP, code of {args.compare_rev[:10]}", lambda c=c: _at_revision(
                        args.compare_rev, c, args.turns, args.latency_ms, engine_url)))
                setups.append(("stub engine over HTTP", lambda c=c: _with_http(engine_url, c, renderer, args.turns)))
            if "remote_env" not in args.skip:
                setups.append(("HTTP engine + RemoteEnv", lambda c=c: _with_http(
                    engine_url, c, renderer, args.turns, env_factory=lambda t, e: RemoteEnv(env_url))))
            if "ray" not in args.skip:
                setups.append(("HTTP engine + 2 Ray actors", lambda c=c: _with_http(
                    engine_url, c, renderer, args.turns, backend="ray")))
            for name, run in setups:
                r = run() if ", code of " in name else run_loop(run())
                print(f"{name:<26} {c:>9} {ideal:>10.0f} {r['episodes_per_s']:>9.0f} "
                      f"{r['episodes_per_s'] / ideal:>6.2f} {r['framework_frac']:>14.2%} "
                      f"{r['cpu_per_turn_us']:>12.0f} µs", flush=True)
                if "tokenizer_encode_us" in r and name == "in-process stub policy":
                    enc, dec = r["tokenizer_encode_us"], r["tokenizer_decode_us"]
                    print(f"{'':<26} of which tokenizer per turn: encode {enc:.1f} µs, decode {dec:.1f} µs; "
                          f"without the encodes {r['cpu_per_turn_us'] - enc:.0f} µs, without both "
                          f"{r['cpu_per_turn_us'] - enc - dec:.0f} µs", flush=True)
    finally:
        engine.terminate()
        env_server.terminate()


def _at_revision(rev: str, concurrency: int, turns: int, latency_ms: float, engine_url: str | None = None) -> dict:
    """A row measured with another revision's code (a git worktree), in a subprocess on asyncio's loop as that
    code ran: the in-process stub, or with `engine_url` the stub engine over HTTP."""
    from revision import run_at_revision

    run = (f"rollout._with_http({engine_url!r}, {concurrency}, renderer, {turns})" if engine_url else
           f"rollout.measure(rollout.StubPolicy({latency_ms / 1000}), renderer, {concurrency}, {turns})")
    return run_at_revision(rev, "import asyncio, json\nimport rollout\n"
                                "from slime_env import get_renderer\nfrom slime_env.offline_tokenizers import smollm2\n"
                                f"renderer = get_renderer(smollm2())\nprint(json.dumps(asyncio.run({run})))")


async def _with_http(url, c, renderer, turns, env_factory=None, backend="local"):
    from slime_env.clients import SGLangPolicy

    policy = SGLangPolicy(url, max_connections=c, timeout_s=600)
    from slime_env.rollout.env_server import close_shared_clients

    try:
        return await measure(policy, renderer, c, turns, env_factory=env_factory, backend=backend)
    finally:
        await policy.close()
        await close_shared_clients()


if __name__ == "__main__":
    main()
