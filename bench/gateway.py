"""What the agent gateway adds per call: latency (p50 / p99) and calls/s with many concurrent sessions, beside
calling the same policy directly, in one run; and whether a call's cost grows with the turns before it.

The policy is `ScriptedPolicy` on Qwen3's real tokenizer (a fixed reply, no model time), so what is measured is the
framework: HTTP, JSON, the request's validation, matching the call to its branch, rendering the new messages (the
bridge, strict checks on or off), parsing the reply's tool call, the response. Each session is an agent doing
`--turns` calls, each continuing the last (its reply echoed back plus a tool result).

Usage: python bench/gateway.py [--sessions 1000] [--turns 8] [--strict]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REPLY = 'Checking.\n<tool_call>\n{"name": "lookup", "arguments": {"key": "alpha"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a key up.",
                                          "parameters": {"type": "object", "properties": {"key": {"type": "string"}}}}}]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=1000)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--strict", action="store_true", help="check every bridge against a full render")
    args = ap.parse_args()
    import aiohttp
    import aiohttp.web

    from slime_env import offline_tokenizers
    from slime_env.gateway import Gateway
    from slime_env.policy import ScriptedPolicy
    from slime_env.renderers import get_renderer

    tok = offline_tokenizers.qwen("3")
    renderer = get_renderer(tok, strict=args.strict)
    policy = ScriptedPolicy(tok, [REPLY], end_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    params = {"max_new_tokens": 64, "stop_token_ids": list(renderer.stop_token_ids)}

    # Baseline: the same policy called directly with already-rendered ids, same concurrency.
    prompt = renderer.encode(renderer.render_text([{"role": "user", "content": "Find alpha."}], tools=TOOLS))

    async def direct_session() -> list[float]:
        out = []
        for _ in range(args.turns):
            t0 = time.perf_counter()
            await policy.generate(prompt, params)
            out.append(time.perf_counter() - t0)
            await asyncio.sleep(0)
        return out

    t0 = time.perf_counter()
    direct = [x for s in await asyncio.gather(*(direct_session() for _ in range(args.sessions))) for x in s]
    direct_wall = time.perf_counter() - t0

    gw = Gateway(policy, renderer, "hermes", strict=args.strict, max_new_tokens=64)
    spent: list[float] = []
    spent_by_turn: list[list[float]] = [[] for _ in range(args.turns)]

    @aiohttp.web.middleware
    async def timed(request, handler):  # the gateway's own time per call: its route handler, the policy's included
        turn = (len((await request.json())["messages"]) - 1) // 2  # the body is cached: the handler reads it again
        t = time.perf_counter()
        out = await handler(request)
        spent.append(time.perf_counter() - t)
        spent_by_turn[turn].append(spent[-1])
        return out

    gw.app.middlewares.append(timed)
    await gw.start()
    conn = aiohttp.TCPConnector(limit=args.sessions)
    per_turn: list[list[float]] = [[] for _ in range(args.turns)]
    async with aiohttp.ClientSession(connector=conn) as http:
        async def agent_session() -> None:
            s = gw.open_session("Find alpha.")
            url, headers = gw.session_url(s) + "/chat/completions", {"Authorization": f"Bearer {s.key}"}
            msgs = [{"role": "user", "content": "Find alpha."}]
            for turn in range(args.turns):
                t = time.perf_counter()
                async with http.post(url, json={"model": "m", "messages": msgs, "tools": TOOLS}, headers=headers) as r:
                    body = await r.json()
                per_turn[turn].append(time.perf_counter() - t)
                message = body["choices"][0]["message"]
                msgs += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"],
                                   "content": f"value {turn}"}]
            trajs = gw.close_session(s.id)
            assert len(trajs) == 1 and trajs[0].num_turns == args.turns, [t.metadata["branch_reason"] for t in trajs]

        t0 = time.perf_counter()
        await asyncio.gather(*(agent_session() for _ in range(args.sessions)))
        gw_wall = time.perf_counter() - t0
    await gw.stop()
    calls = args.sessions * args.turns
    through = [x for turn in per_turn for x in turn]
    print(f"{args.sessions} concurrent sessions x {args.turns} turns ({calls} calls), strict={args.strict}, "
          f"Qwen3 tokenizer, ScriptedPolicy (no model time)")
    print(f"{'path':34s} {'p50 ms':>8s} {'p99 ms':>8s} {'calls/s':>9s}")
    print(f"{'policy.generate directly':34s} {pct(direct, .5) * 1e3:8.3f} {pct(direct, .99) * 1e3:8.3f} "
          f"{calls / direct_wall:9.0f}")
    print(f"{'through the gateway (HTTP)':34s} {pct(through, .5) * 1e3:8.3f} {pct(through, .99) * 1e3:8.3f} "
          f"{calls / gw_wall:9.0f}")
    # Latency under many concurrent sessions is mostly queueing on one event loop (client and server share it
    # here); what the gateway itself spends per call is its handler's time, the policy's included.
    added = [h - d for h, d in zip(sorted(spent), sorted(direct))]
    print(f"{'gateway handler (server side)':34s} {pct(spent, .5) * 1e3:8.3f} {pct(spent, .99) * 1e3:8.3f}")
    print(f"added by the gateway per call: p50 {pct(added, .5) * 1e3:.3f} ms, p99 {pct(added, .99) * 1e3:.3f} ms; "
          f"wall per call with client and server on one core: {gw_wall / calls * 1e3:.3f} ms")
    first, last = spent_by_turn[0], spent_by_turn[-1]
    print(f"gateway handler p50 at turn 1: {pct(first, .5) * 1e3:.3f} ms, at turn {args.turns}: "
          f"{pct(last, .5) * 1e3:.3f} ms (ratio {pct(last, .5) / pct(first, .5):.2f})")


if __name__ == "__main__":
    asyncio.run(main())
