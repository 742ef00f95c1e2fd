"""Generation throughput of TransformersPolicy, in-process and through serve-engine + SGLangPolicy.

c concurrent "episodes" each generate `--tokens` tokens (ignore_eos, so every run does the same
work) for `--rounds` turns; tokens/s = generated tokens / wall time. The same model and settings
run in-process and over HTTP (the server is `slime-env serve-engine` in a subprocess on 127.0.0.1),
in the same run; the ratio is the HTTP overhead.

    python bench/engine.py [--concurrency 1 8 32] [--tokens 32] [--rounds 2] [--window-ms 20]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import threading
import time

from agents import SGLangPolicy, TransformersPolicy, load_default_model
from agents.default_model import default_model_path
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
                             str(max_batch), "--batch-window-ms", str(window_ms)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
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
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()
