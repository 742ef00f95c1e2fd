"""Per-step overhead of the ecosystem integrations beside calling the env directly, one run, one machine.

Each row times `--steps` sequential steps of an echo env (the work per step is nothing, so what is measured is the
integration) and reports µs per step at p50 and the mean, with the direct call it is compared with:
- OpenEnv in, remote: `OpenEnvEnv(url).step` vs OpenEnv's own `GenericEnvClient.step` on the same WebSocket server
  (OpenEnv's scaffolded echo env under uvicorn). The difference is our mapping (action field, observation to messages).
- OpenEnv in, in process: `OpenEnvEnv(environment=EchoEnvironment).step` vs `EchoEnvironment.step` called directly.
- OpenEnv out: `GenericEnvClient.step` on `slime-env serve-openenv` (our echo env) vs the same client on OpenEnv's
  echo server, and vs our env's `step` called directly.
- verifiers in: `VerifiersEnv.step` for a taskset turn (trace bookkeeping, `@vf.stop` checks) and a multi-turn
  `vf.Env.run()` turn (the program's `interaction.turn` through two queues), vs a plain `Env.step`.
- verifiers out: a turn of verifiers' eval loop (`run_eval`: interception server, its eval client, our gateway over
  HTTP) vs the same turns through an OpenAI client on our gateway with the env stepped directly, and vs a turn of
  `run_episode` (no HTTP at all), on the same env and scripted policy, per model call.

Usage: python -P bench/ecosystem.py [--steps 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the offline verifiers tasksets of the tests

from slime_env import Action, Env, Message, Task  # noqa: E402


class EchoEnv(Env):
    """Our echo env: the observation repeats the action; reward 0.1 per character (at most 1); never ends."""

    async def reset(self, *, seed=None, options=None):
        self.task = self.task_from(options, seed)
        return self.task.messages(), {}

    async def step(self, action: Action):
        return [Message("user", action.text)], min(len(action.text) * 0.1, 1.0), False, False, {}

    def default_tasks(self):
        return [Task("Say something.")]


def stats(samples: list[float]) -> tuple[float, float]:
    return statistics.median(samples) * 1e6, statistics.fmean(samples) * 1e6


async def paired(a, b, n: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """`a` and `b` timed alternately (ABAB...), so both see the same machine (this one is shared and noisy)."""
    for _ in range(min(50, n)):
        await a()
        await b()
    xs, ys = [], []
    for _ in range(n):
        t = time.perf_counter()
        await a()
        u = time.perf_counter()
        await b()
        xs.append(u - t)
        ys.append(time.perf_counter() - u)
    return stats(xs), stats(ys)


async def timed(step, n: int) -> tuple[float, float]:
    for _ in range(min(50, n)):  # warm-up
        await step()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        await step()
        out.append(time.perf_counter() - t)
    return stats(out)


def server(argv: list[str], cwd: Path, marker: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})
    for line in proc.stdout:
        if marker in line:
            return proc, line.split(marker, 1)[1].split()[0]
    raise RuntimeError(f"{argv} did not start")


ROWS: list[tuple[str, tuple[float, float], str, tuple[float, float]]] = []


def row(name: str, ours: tuple[float, float], baseline_name: str, baseline: tuple[float, float]) -> None:
    ROWS.append((name, ours, baseline_name, baseline))
    print(f"{name:48s} p50 {ours[0]:8.1f} µs  mean {ours[1]:8.1f} µs | {baseline_name:34s} p50 {baseline[0]:8.1f} "
          f"µs  mean {baseline[1]:8.1f} µs | +{ours[0] - baseline[0]:.1f} µs", flush=True)


async def openenv_rows(n: int, tmp: Path) -> None:
    import importlib

    from openenv.core import GenericEnvClient

    from slime_env.integrations.openenv import OpenEnvEnv

    subprocess.run([sys.executable, "-m", "openenv.cli", "init", "echo_env", "--output-dir", str(tmp)], check=True,
                   capture_output=True)
    app = tmp / "echo_env" / "server" / "app.py"  # the template's own knob: sessions at once (1 as scaffolded)
    app.write_text(app.read_text().replace("max_concurrent_envs=1", "max_concurrent_envs=4"))
    theirs, url = server([sys.executable, "-m", "uvicorn", "echo_env.server.app:app", "--port", "0", "--log-level",
                          "info"], tmp, "Uvicorn running on ", {"PYTHONPATH": str(tmp)})
    ours_proc, ours_url = server([sys.executable, "-m", "slime_env", "serve-openenv",
                                  f"{ROOT}/bench/ecosystem.py:EchoEnv", "--port", "0"], ROOT, "listening on ")
    try:
        action = Action(text="hello")
        async with GenericEnvClient(base_url=url) as client:
            await client.reset()
            env = OpenEnvEnv(url)
            await env.reset()
            ours, their_client = await paired(lambda: env.step(action), lambda: client.step({"message": "hello"}), n)
            row("OpenEnv in, remote: OpenEnvEnv.step", ours, "GenericEnvClient.step (OpenEnv's)", their_client)
            await env.close()

        sys.path.insert(0, str(tmp))
        module = importlib.import_module("echo_env.server.echo_env_environment")
        models = importlib.import_module("echo_env.models")
        direct_env = module.EchoEnvironment()
        direct_env.reset()
        echo = models.EchoAction(message="hello")

        async def direct_step():
            direct_env.step(echo)

        for threads in (True, False):
            local = OpenEnvEnv(environment=module.EchoEnvironment, threads=threads)
            await local.reset()
            ours, direct = await paired(lambda: local.step(action), direct_step, n)
            row(f"OpenEnv in, in process (threads={threads})", ours, "EchoEnvironment.step (direct)", direct)
            await local.close()

        ours_env = EchoEnv()
        await ours_env.reset()
        async with GenericEnvClient(base_url=ours_url) as mine, GenericEnvClient(base_url=url) as theirs_client:
            await mine.reset()
            await theirs_client.reset()
            served, echo_served = await paired(lambda: mine.step({"text": "hello"}),
                                               lambda: theirs_client.step({"message": "hello"}), n)
        direct_ours = await timed(lambda: ours_env.step(action), n)
        row("OpenEnv out: GenericEnvClient on serve-openenv", served, "GenericEnvClient on OpenEnv's echo", echo_served)
        row("OpenEnv out: GenericEnvClient on serve-openenv", served, "EchoEnv.step (ours, direct)", direct_ours)
    finally:
        for proc in (theirs, ours_proc):
            proc.terminate()
            proc.wait(timeout=30)


async def verifiers_rows(n: int, tmp: Path) -> None:
    from slime_env.integrations.verifiers import VerifiersEnv, verifiers_tasks

    ours_env = EchoEnv()
    await ours_env.reset()
    action = Action(text="ABCD")
    direct = await timed(lambda: ours_env.step(action), n)

    # a taskset turn: a tool call (the toolset's tool runs in process, its result joins the trace), the stop checks
    from slime_env.types import ToolCall

    env = VerifiersEnv("vf_capitals")
    (task,) = verifiers_tasks(env)[:1]
    act = Action(text='<tool_call>{"name": "atlas_capital", "arguments": {"country": "France"}}</tool_call>',
                 tool_calls=(ToolCall("atlas_capital", {"country": "France"}, id="c"),))
    from slime_env import ToolEnv

    def capital(country: str) -> str:
        """The capital city of a country."""
        return {"france": "Paris"}.get(country.lower(), "unknown country")

    plain = ToolEnv([capital], system_prompt=None)
    plain_act = Action(text=act.text, tool_calls=(ToolCall("capital", {"country": "France"}, id="c"),))
    xs, ys = [], []
    for i in range(n):
        if i % 2 == 0:  # its @vf.stop ends an episode at 3 turns: two tool turns per episode
            await env.reset(options={"task": task})
            await plain.reset(options={"task": "What is the capital of France?"})
        t = time.perf_counter()
        await env.step(act)
        u = time.perf_counter()
        await plain.step(plain_act)
        xs.append(u - t)
        ys.append(time.perf_counter() - u)
    await env.close()
    row("verifiers in: VerifiersEnv.step (tool turn)", stats(xs), "ToolEnv.step (same tool turn)", stats(ys))

    env = VerifiersEnv("vf_codeword")
    task = verifiers_tasks(env)[2]  # three reveals: two steps continue the program's run()
    samples = []
    while len(samples) < n:
        await env.reset(options={"task": task})
        t = time.perf_counter()
        await env.step(Action(text="Q"))
        samples.append(time.perf_counter() - t)
    await env.close()
    row("verifiers in: VerifiersEnv.step (vf.Env.run turn)", stats(samples), "EchoEnv.step (plain Env)", direct)


async def verifiers_out_row(n_turns: int, tmp: Path) -> None:
    import verifiers.v1 as vf
    from verifiers.v1.cli.eval.runner import run_eval
    from verifiers.v1.configs.cli.eval import EvalConfig

    from slime_env import Gateway, ScriptedPolicy, get_renderer, make, run_episode
    from slime_env.integrations.verifiers_export import write_verifiers_package
    from slime_env.offline_tokenizers import smollm2

    tok = smollm2()
    guess = str(ROOT / "examples" / "guess_number_env.py") + ":GuessEnv"
    write_verifiers_package(guess, tmp, name="guess_bench")
    sys.path.insert(0, str(tmp))
    import re

    def player(context: str) -> str:
        lo, hi = 1, 100
        for g, hint in re.findall(r"<guess>(\d+)</guess><\|im_end\|>\n<\|im_start\|>user\n(\w+)", context):
            lo, hi = (int(g) + 1, hi) if hint == "higher" else (lo, int(g) - 1)
        return f"<guess>{(lo + hi) // 2}</guess>"

    episodes = max(4, n_turns // 6)
    gateway = Gateway(ScriptedPolicy(tok, player), get_renderer(tok), "hermes", strict=False)
    await gateway.start()
    session = gateway.open_session(Task("bench"))
    os.environ["SLIME_ENV_GATEWAY_KEY"] = session.key
    def config() -> EvalConfig:  # a run config holds its run's id: one per run
        return EvalConfig(env=vf.resolve_env_config({"taskset": {"id": "guess_bench", "num_tasks": episodes}}),
                          model="policy", client=vf.EvalClientConfig(base_url=gateway.session_url(session),
                                                                     api_key_var="SLIME_ENV_GATEWAY_KEY"),
                          push=False, rich=None, output_dir=tmp / "outputs", max_concurrent=1)

    await run_eval(config())  # warm-up (imports, first connections)
    t = time.perf_counter()
    await run_eval(config())
    elapsed = time.perf_counter() - t
    trajs = gateway.close_session(session.id)
    calls = sum(len(tr.metadata["calls"]) for tr in trajs) // 2  # two runs in the session; the second timed
    env = make(guess)
    import random

    tasks = [env.sample_task(random.Random(i)) for i in range(episodes)]

    # the same turns without verifiers: an OpenAI client per call (as the harness makes one) on our gateway, the env
    # stepped directly
    import httpx
    from openai import AsyncOpenAI

    from slime_env.integrations.verifiers_export import _tls_context

    session = gateway.open_session(Task("bench direct"))
    t0, direct_calls = time.perf_counter(), 0
    for task in tasks:
        messages = [m.to_dict() for m in (await env.reset(options={"task": task}))[0]]
        for _ in range(10):
            http = httpx.AsyncClient(verify=_tls_context())
            async with AsyncOpenAI(base_url=gateway.session_url(session), api_key=session.key, http_client=http) as c:
                reply = (await c.chat.completions.create(model="policy", messages=messages)).choices[0].message
            direct_calls += 1
            messages.append({"role": "assistant", "content": reply.content})
            obs, _, terminated, truncated, _ = await env.step(Action(text=reply.content))
            if terminated or truncated:
                break
            messages += [m.to_dict() for m in obs]
    gateway_direct = time.perf_counter() - t0
    gateway.close_session(session.id)
    await gateway.stop()
    renderer = get_renderer(tok)
    t0 = time.perf_counter()
    turns = 0
    for task in tasks:
        tr = await run_episode(env, ScriptedPolicy(tok, player), task, renderer=renderer, max_turns=10)
        turns += len(tr.turn_rewards)
    direct = time.perf_counter() - t0
    ours = (elapsed / calls * 1e6,) * 2
    base = (direct / turns * 1e6,) * 2
    row(f"verifiers out: vf run_eval turn ({calls} calls, mean)", ours, "OpenAI client on our gateway (mean)",
        (gateway_direct / direct_calls * 1e6,) * 2)
    row(f"verifiers out: vf run_eval turn ({calls} calls, mean)", ours, "run_episode turn (direct, mean)", base)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        await openenv_rows(args.steps, tmp / "openenv")
        await verifiers_rows(args.steps, tmp / "verifiers")
        await verifiers_out_row(min(args.steps, 300), tmp / "vf_out")


if __name__ == "__main__":
    asyncio.run(main())
