"""`slime-env serve-retriever`: Search-R1's retrieval server API over our retrievers.

`POST /retrieve {"queries": [...], "topk": 3, "return_scores": true}` answers
`{"result": [[{"document": {"id", "contents"}, "score"}, ...], ...]}` (bare document dicts without
scores) — exactly what Search-R1, verl and slime clients send and read. Concurrent requests are
searched together (the retriever batches them). `GET /health`. A malformed request gets 400 naming
the field.
"""

from __future__ import annotations

import json

from aiohttp import web
from slime_env.envs.search.retrievers import Retriever, load_retriever

MAX_TOPK = 100


def make_app(retriever: Retriever, *, default_topk: int = 3, max_queries: int = 1024) -> web.Application:
    state = {"requests": 0, "queries": 0}

    async def retrieve(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return _bad("request body is not valid JSON")
        if not isinstance(body, dict):
            return _bad("request body must be a JSON object")
        queries = body.get("queries")
        if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
            return _bad("field 'queries' must be a list of strings")
        if len(queries) > max_queries:
            return _bad(f"field 'queries': at most {max_queries} per request")
        topk = body.get("topk")
        topk = default_topk if topk is None else topk  # Search-R1 clients may send null
        if not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk <= MAX_TOPK:
            return _bad(f"field 'topk' must be an integer in [1, {MAX_TOPK}]")
        scores = body.get("return_scores", False)
        if not isinstance(scores, bool):
            return _bad("field 'return_scores' must be true or false")
        hits = await retriever.search(queries, topk)
        state["requests"] += 1
        state["queries"] += len(queries)
        result = [[{"document": p.to_document(), "score": s} if scores else p.to_document() for p, s in row]
                  for row in hits]
        return web.json_response({"result": result})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "retriever": type(retriever).__name__,
                                  "batches": getattr(retriever, "batches", None), **state})

    app = web.Application(client_max_size=64 << 20)
    app.add_routes([web.post("/retrieve", retrieve), web.get("/health", health)])
    return app


def _bad(message: str) -> web.Response:
    return web.Response(status=400, content_type="application/json", text=json.dumps({"error": message}))


def serve(index: str, *, host: str = "127.0.0.1", port: int = 8000, default_topk: int = 3) -> None:
    """Serve until interrupted; prints `listening on http://HOST:PORT` once bound."""
    from slime_env.http import serve_forever

    retriever = load_retriever(index)
    print(f"retriever: {type(retriever).__name__} over {index}", flush=True)
    serve_forever(lambda: make_app(retriever, default_topk=default_topk), host=host, port=port,
                  on_exit=retriever.close)
