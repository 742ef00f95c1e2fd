"""Generation throughput of TransformersPolicy, in-process and through serve-engine + SGLangPolicy.

c concurrent "episodes" each generate `--tokens` tokens (ignore_eos, so every run does the same
work) for `--rounds` turns; tokens/s = generated tokens / wall time. The same model and settings
run in-process and over HTTP (the server is `slime-env serve-engine` in a subprocess on 127.0.0.1),
in the same run; the ratio is the HTTP overhead.

Then continuous batching + the per-session prefix cache beside the static batching loop and beside the
continuous engine's two-pass path (a prefill pass per admission wave: what models outside the packed families
run; same model, same run): 3-turn episodes at 32 concurrent (turn lengths vary, 8-48 tokens: a static batch
waits for its longest request; each turn extends the episode's prefix), and the time to the first token of
turn 3 on a ~1,900-token history.

`--compare-rev REV` also runs those episodes on revision REV's static loop (a git worktree, same run).

    python bench/engine.py [--concurrency 1 8 32] [--tokens 32] [--rounds 2] [--window-ms 20] [--skip-http]
                           [--compare-rev REV]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import threading
import time

from slime_env.agents import SGLangPolicy, TransformersPolicy, load_default_model
from slime_env.agents.default_model import default_model_path

from slime_env import Message, get_renderer

QUESTIONS = ["What is the capital of France?", "Explain gravity in one sentence.", "Write a haiku about rain.",
             "List three prime numbers.", "What is 12 times 7?", "Name a famous painter."]


async def run(policy, prompts, concurrency: int, tokens: int, rounds: int) -> tuple[float, int]:
    params = {"temperature": 0.7, "max_new_tokens": tokens, "ignore_eos": True}

    async def episode(i: int) -> int:
        ids, n = list(prompts[i % len(prompts)]), 0
        for _ in range(rounds):
            gen = await policy.generate(ids, params)
            ids += list(gen.token_ids)
            n += len(gen.token_ids)
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(episode(i) for i in range(concurrency)))
    return time.perf_counter() - t0, sum(counts)


def start_server(max_batch: int, window_ms: float) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "slime_env", "serve-engine", "--port", "0", "--max-batch-size",
                             str(max_batch), "--batch-window-ms", str(window_ms)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    for line in proc.stdout:
        if line.startswith("listening on "):
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # never let its pipe fill up
            return proc, line.split()[-1]
    raise RuntimeError("serve-engine did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--window-ms", type=float, default=20.0, help="batch window, the same in both set-ups")
    ap.add_argument("--skip-http", action="store_true", help="only the continuous vs static comparison")
    ap.add_argument("--compare-rev", default=None, help="also run the static loop with this git revision's code")
    args = ap.parse_args()
    if args.skip_http:
        model, tok = load_default_model()
        compare_batching(model, tok, get_renderer(tok), args.window_ms / 1000, args.compare_rev)
        return
    max_batch = max(args.concurrency)
    default_model_path()
    model, tok = load_default_model()
    renderer = get_renderer(tok)
    prompts = [renderer.render_prompt([Message("user", q)]) for q in QUESTIONS]
    local = TransformersPolicy(model, tok, max_batch_size=max_batch, batch_window_s=args.window_ms / 1000)
    proc, url = start_server(max_batch, args.window_ms)
    print(f"bench/engine.py  SmolLM2-135M-Instruct fp32, {os.cpu_count()} CPU cores, {args.tokens} tokens x "
          f"{args.rounds} turns per episode, max batch {max_batch}, batch window {args.window_ms:g} ms")
    print(f"{'episodes':>8} {'in-process tok/s':>17} {'HTTP tok/s':>11} {'HTTP/in-process':>16}")
    try:
        for c in args.concurrency:
            async def both():
                await run(local, prompts, 1, 2, 1)  # warm-up
                t_local, n_local = await run(local, prompts, c, args.tokens, args.rounds)
                remote = SGLangPolicy(url, max_connections=c)
                try:
                    await run(remote, prompts, 1, 2, 1)
                    t_http, n_http = await run(remote, prompts, c, args.tokens, args.rounds)
                finally:
                    await remote.close()
                return n_local / t_local, n_http / t_http

            tps_local, tps_http = asyncio.run(both())
            print(f"{c:>8} {tps_local:>17.1f} {tps_http:>11.1f} {tps_http / tps_local:>15.2f}x")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        local.close()
    compare_batching(model, tok, renderer, args.window_ms / 1000, args.compare_rev)


async def episodes(policy, renderer, n: int = 32, turns: int = 3) -> tuple[float, int]:
    """n concurrent `turns`-turn episodes, each turn 8-48 tokens (drawn per episode: the same work whatever the
    engine), each turn extending the episode's prefix; (wall seconds, generated tokens)."""
    import random

    from slime_env import Message as M

    async def one(i: int) -> int:
        rng = random.Random(i)
        session = policy.for_episode(f"e{i}")
        ids, made = renderer.render_prompt([M("user", QUESTIONS[i % len(QUESTIONS)])]), 0
        for _ in range(turns):
            gen = await session.generate(ids, {"temperature": 0.7, "max_new_tokens": rng.randint(8, 48),
                                               "ignore_eos": True, "sampling_seed": i})
            made += len(gen.token_ids)
            ids = ids + list(gen.token_ids) + renderer.bridge(gen.token_ids, [M("user", "Go on.")])
        return made

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(n)))
    return time.perf_counter() - t0, sum(counts)


def static_at_revision(rev: str, window_s: float) -> float:
    """tokens/s of the 32 x 3-turn episodes on git revision REV's static batching loop (a worktree, in a
    subprocess, same machine, same run): the engine as it was."""
    from revision import run_at_revision

    return run_at_revision(rev, "import asyncio, inspect, json\nimport engine\n"
                                "from agents import TransformersPolicy, load_default_model\n"
                                "from slime_env import get_renderer\nmodel, tok = load_default_model()\n"
                                "kw = {'batching': 'static'} if 'batching' in "
                                "inspect.signature(TransformersPolicy).parameters else {}\n"
                                f"policy = TransformersPolicy(model, tok, max_batch_size=32, batch_window_s={window_s},"
                                " **kw)\nrenderer = get_renderer(tok)\n"
                                "asyncio.run(engine.episodes(policy, renderer, 2, 1))\n"
                                "wall, made = asyncio.run(engine.episodes(policy, renderer))\n"
                                "print(json.dumps(made / wall))")


def compare_batching(model, tok, renderer, window_s: float, compare_rev: str | None = None) -> None:
    from slime_env import Message as M

    def policies():
        two_pass = TransformersPolicy(model, tok, max_batch_size=32, batch_window_s=window_s)
        two_pass._engine.packed = False  # the engine before the packed step: a prefill pass per admission wave
        return {"static": TransformersPolicy(model, tok, max_batch_size=32, batch_window_s=window_s, batching="static"),
                "two-pass": two_pass,
                "continuous": TransformersPolicy(model, tok, max_batch_size=32, batch_window_s=window_s)}

    async def ttft(policy) -> float:
        session = policy.for_episode("long")
        history = "Here is a long document to read carefully. " + " ".join(f"fact {i} is true." for i in range(240))
        ids = renderer.render_prompt([M("user", history)])
        for _ in range(2):
            gen = await session.generate(ids, {"temperature": 0.0, "max_new_tokens": 16})
            ids = ids + list(gen.token_ids) + renderer.bridge(gen.token_ids, [M("user", "And then?")])
        t0 = time.perf_counter()
        await session.generate(ids, {"temperature": 0.0, "max_new_tokens": 1})
        return time.perf_counter() - t0, len(ids)

    rows = {}
    for name, policy in policies().items():
        try:
            asyncio.run(episodes(policy, renderer, n=2, turns=1))  # warm-up
            wall, made = asyncio.run(episodes(policy, renderer))
            first, history = asyncio.run(ttft(policy))
            rows[name] = (made / wall, first, history)
        finally:
            policy.close()
    (s_tps, s_ttft, n), (t_tps, t_ttft, _), (c_tps, c_ttft, _) = rows["static"], rows["two-pass"], rows["continuous"]
    print("\ncontinuous batching + prefix cache vs static batching (same run; two-pass: continuous without the "
          "packed step)")
    print(f"{'':44s} {'static':>10s} {'two-pass':>9s} {'continuous':>11s} {'ratio':>7s}")
    print(f"{'3-turn episodes, 32 concurrent: tokens/s':44s} {s_tps:10.1f} {t_tps:9.1f} {c_tps:11.1f} "
          f"{c_tps / s_tps:6.2f}x")
    print(f"{f'time to first token, turn 3 ({n} tokens): s':44s} {s_ttft:10.3f} {t_ttft:9.3f} {c_ttft:11.3f} "
          f"{s_ttft / c_ttft:6.1f}x lower")
    if compare_rev:
        old = static_at_revision(compare_rev, window_s)
        print(f"{f'static batching, code of {compare_rev[:10]}: tokens/s':44s} {old:10.1f} {'':9s} {c_tps:11.1f} "
              f"{c_tps / old:6.2f}x")


if __name__ == "__main__":
    main()
