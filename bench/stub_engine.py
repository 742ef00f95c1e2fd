"""A STUB engine for load tests: SGLang's `/generate` shape, fixed latency, canned token streams.

Not a model: every request sleeps `latency_s` and answers the same `tokens` ids (ending with the
end-of-turn id) with fixed log-probs. It measures the framework, never generation.

    python bench/stub_engine.py --port 0 --latency-ms 20
"""

from __future__ import annotations

import argparse
import asyncio

from aiohttp import web


def make_app(latency_s: float, tokens: list[int]) -> web.Application:
    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        await asyncio.sleep(latency_s)
        limit = body.get("sampling_params", {}).get("max_new_tokens", len(tokens))
        out = tokens[:limit]
        return web.json_response({"text": "", "meta_info": {
            "output_token_logprobs": [[-0.5, t, None] for t in out],
            "finish_reason": {"type": "stop" if len(out) == len(tokens) else "length"},
            "prompt_tokens": len(body.get("input_ids", [])), "completion_tokens": len(out), "cached_tokens": 0,
            "weight_version": "stub"}})

    app = web.Application()
    app.router.add_post("/generate", generate)
    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--tokens", type=int, nargs="+", default=[28120, 905, 30, 2])  # "hello world." + <|im_end|>
    args = ap.parse_args()

    async def run() -> None:
        runner = web.AppRunner(make_app(args.latency_ms / 1000, args.tokens), access_log=None, backlog=16384)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", args.port, backlog=16384)
        await site.start()
        print(f"listening on http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(run())


if __name__ == "__main__":
    main()
