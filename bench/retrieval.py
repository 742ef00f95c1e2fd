"""BM25 retrieval throughput: our BM25Retriever (bm25s) beside rank-bm25, and the server's latency.

Synthetic corpora of 100k and 1M passages (60 words each, Zipf-distributed over a 50k-word vocabulary)
and 1,000 queries of 3-6 words from the same distribution. For each size: top-3 queries/s batched
(all queries in one `search` call) and one at a time (one `await search([q])` after another); the
server's p50/p99 latency at batch 1 (`slime-env serve-retriever` in a subprocess, sequential
`POST /retrieve` from this process); and rank-bm25's `BM25Okapi.get_top_n` (the common pure-Python
baseline) on a sample of the queries, in the same run. Usage: python bench/retrieval.py [--sizes 100000,1000000]
Target: >= 1,000 queries/s batched over 1M passages on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slime_env.envs.search.corpus import Passage  # noqa: E402
from slime_env.envs.search.retrievers import BM25Retriever  # noqa: E402

VOCAB = 50_000


def words(rng: np.random.Generator, n: int) -> np.ndarray:
    ranks = rng.zipf(1.2, size=n)
    return np.where(ranks < VOCAB, ranks, rng.integers(1, VOCAB, size=n))


def corpus(n: int, seed: int = 0) -> list[Passage]:
    rng = np.random.default_rng(seed)
    ids = words(rng, n * 60).reshape(n, 60)
    names = np.array([f"w{i}" for i in range(VOCAB + 1)])
    return [Passage(str(i), f"\"doc {i}\"\n" + " ".join(names[row])) for i, row in enumerate(ids)]


def queries(n: int, seed: int = 1) -> list[str]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        k = int(rng.integers(3, 7))
        out.append(" ".join(f"w{int(w)}" for w in words(rng, k) + 20))  # skip the very commonest words
    return out


def server_latency(index: str, qs: list[str]) -> tuple[float, float]:
    proc = subprocess.Popen([sys.executable, "-m", "slime_env", "serve-retriever", "--index", index, "--port", "0"],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        while line and not line.startswith("listening on "):
            line = proc.stdout.readline()
        url = line.split()[-1]
        lat = []
        for q in qs:
            body = json.dumps({"queries": [q], "topk": 3, "return_scores": True}).encode()
            req = urllib.request.Request(f"{url}/retrieve", data=body, headers={"Content-Type": "application/json"})
            t0 = time.perf_counter()
            with urllib.request.urlopen(req) as r:
                r.read()
            lat.append(time.perf_counter() - t0)
        lat = sorted(lat[5:])  # the first requests warm the server
        return 1000 * statistics.median(lat), 1000 * lat[int(0.99 * (len(lat) - 1))]
    finally:
        proc.terminate()
        proc.wait()


def rank_bm25(passages: list[Passage], qs: list[str]) -> tuple[float, float]:
    from rank_bm25 import BM25Okapi

    t0 = time.perf_counter()
    model = BM25Okapi([p.contents.lower().split() for p in passages])
    build = time.perf_counter() - t0
    t0 = time.perf_counter()
    for q in qs:
        model.get_top_n(q.lower().split(), passages, n=3)
    return len(qs) / (time.perf_counter() - t0), build


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="100000,1000000")
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--rank-bm25-queries", type=int, default=20, help="rank-bm25 is slow: a sample")
    args = ap.parse_args()
    qs = queries(args.queries)
    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        passages = corpus(size)
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            BM25Retriever.build(passages, tmp)
            build = time.perf_counter() - t0
            retriever = BM25Retriever(tmp)

            async def measure():
                await retriever.search(qs[:10], 3)  # warm-up: numba compiles the batched and the
                await retriever.search(qs[:1], 3)   # single-query paths once each
                t0 = time.perf_counter()
                await retriever.search(qs, 3)
                batched = len(qs) / (time.perf_counter() - t0)
                t0 = time.perf_counter()
                for q in qs[:200]:
                    await retriever.search([q], 3)
                single = 200 / (time.perf_counter() - t0)
                return batched, single

            batched, single = asyncio.run(measure())
            p50, p99 = server_latency(tmp, qs[:205])
        rb_qps, rb_build = rank_bm25(passages, qs[:args.rank_bm25_queries])
        rows.append((size, build, batched, single, p50, p99, rb_build, rb_qps))
        del passages
    print(f"\n{os.cpu_count()} cores, top-3, {args.queries} queries of 3-6 words\n")
    print(f"{'passages':>9s} {'build s':>8s} {'batched q/s':>12s} {'1-by-1 q/s':>11s} {'server p50 ms':>14s} "
          f"{'p99 ms':>7s} | {'rank-bm25 build s':>17s} {'q/s':>7s} {'batched vs rank-bm25':>21s}")
    for size, build, batched, single, p50, p99, rb_build, rb_qps in rows:
        print(f"{size:9d} {build:8.1f} {batched:12.0f} {single:11.0f} {p50:14.2f} {p99:7.2f} | {rb_build:17.1f} "
              f"{rb_qps:7.2f} {batched / rb_qps:20.0f}x")


if __name__ == "__main__":
    main()
