"""``keel bench ann``: keel's embedded vector index against well-kept ANN libraries.

The same vectors (synthetic notes from ``keel bench memory``, embedded by the given embedder)
go into three indexes: keel's own (``SQLiteMemoryStore``'s per-scope mirror: exact up to
20,000 vectors, then a sign-bit shortlist re-ranked exactly), ``hnswlib`` and ``usearch``
(HNSW graphs, cosine, float32). Each is measured the same way: build time, the memory the
index holds (the process's resident size before and after the build, so C++ allocations
count), and single-query latency p50/p95 and recall@10 against exact search, over queries
that are words of stored notes. Libraries that are not installed are reported as such.
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from keel.bench._stats import nearest_rank
from keel.bench.memory import synthetic_corpus
from keel.memory import Embedder
from keel.stores._sqlite_memory import _ScopeIndex, _sign_bits

__all__ = ["run_ann_bench"]

FloatArray = npt.NDArray[np.float32]
_K = 10


def _saved_bytes(save: Callable[[str], Any]) -> int:
    """The size of the file an index saves itself to."""
    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "index.bin")
        save(path)
        return Path(path).stat().st_size


def _measure(
    build: Callable[[], Any],
    search: Callable[[Any, FloatArray], npt.NDArray[np.int64]],
    size: Callable[[Any], int],
    queries: FloatArray,
    exact: list[set[int]],
) -> dict[str, Any]:
    gc.collect()
    started = time.perf_counter()
    index = build()
    build_s = time.perf_counter() - started
    held = size(index)
    latencies: list[float] = []
    recalls: list[float] = []
    for query, truth in zip(queries, exact, strict=True):
        started = time.perf_counter()
        found = search(index, query)
        latencies.append((time.perf_counter() - started) * 1000)
        recalls.append(len(truth & {int(i) for i in found[:_K]}) / _K)
    return {
        "build_s": round(build_s, 2),
        "memory_mb": round(held / 2**20, 1),
        "search_ms_p50": round(statistics.median(latencies), 3),
        "search_ms_p95": round(nearest_rank(latencies, 0.95), 3),
        "recall_at_10": round(statistics.fmean(recalls), 4),
    }


def _keel_index(vectors: FloatArray) -> dict[str, Any]:
    def build() -> _ScopeIndex:
        # What the store holds once it has mirrored the rows: the matrix and its sign bits.
        index = _ScopeIndex(dimension=vectors.shape[1])
        index.matrix = vectors.copy()
        index.bits = np.ascontiguousarray(_sign_bits(vectors).T)
        index.size = len(vectors)
        index.ids = [str(i) for i in range(len(vectors))]
        return index

    def search(index: _ScopeIndex, query: FloatArray) -> npt.NDArray[np.int64]:
        return index.nearest(query, _K)[0]

    def size(index: _ScopeIndex) -> int:
        return int(index.matrix.nbytes + index.bits.nbytes)

    return {"build": build, "search": search, "size": size}


def _hnswlib_index(vectors: FloatArray, threads: int) -> dict[str, Any] | None:
    try:
        import hnswlib  # type: ignore[import-not-found, import-untyped, unused-ignore]
    except ImportError:
        return None

    def build() -> Any:
        index = hnswlib.Index(space="cosine", dim=vectors.shape[1])
        index.init_index(max_elements=len(vectors), M=16, ef_construction=100)
        index.set_num_threads(threads)
        index.add_items(vectors, np.arange(len(vectors)))
        index.set_ef(64)
        index.set_num_threads(1)
        return index

    def search(index: Any, query: FloatArray) -> npt.NDArray[np.int64]:
        labels, _ = index.knn_query(query.reshape(1, -1), k=_K)
        return np.asarray(labels[0], dtype=np.int64)

    return {
        "build": build,
        "search": search,
        "size": lambda index: _saved_bytes(index.save_index),
        "settings": "M=16 ef_construction=100 ef=64",
    }


def _usearch_index(vectors: FloatArray, threads: int) -> dict[str, Any] | None:
    try:
        from usearch.index import Index  # type: ignore[import-not-found, import-untyped, unused-ignore]
    except ImportError:
        return None

    def build() -> Any:
        index = Index(
            ndim=vectors.shape[1],
            metric="cos",
            dtype="f32",
            connectivity=16,
            expansion_add=100,
            expansion_search=64,
        )
        index.add(np.arange(len(vectors)), vectors, threads=threads)
        return index

    def search(index: Any, query: FloatArray) -> npt.NDArray[np.int64]:
        return np.asarray(index.search(query, _K, threads=1).keys, dtype=np.int64)

    return {
        "build": build,
        "search": search,
        "size": lambda index: _saved_bytes(index.save),
        "settings": "connectivity=16 expansion_add=100 expansion_search=64",
    }


def run_ann_bench(
    sizes: list[int],
    *,
    embedder: Embedder,
    threads: int,
    libraries: bool = True,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Build and query each index at each size; the figures per size and library (keel's
    alone when ``libraries`` is false)."""
    largest = max(sizes)
    texts, query_texts = synthetic_corpus(largest)
    if progress:
        progress(f"embedding {largest:,} notes with {embedder.name}")
    started = time.perf_counter()
    corpus = np.asarray(embedder.embed(texts), dtype=np.float32)
    embed_s = time.perf_counter() - started
    queries = np.asarray(embedder.embed(query_texts), dtype=np.float32)
    report: dict[str, Any] = {
        "embedding_model": embedder.name,
        "dimension": int(corpus.shape[1]),
        "embed_seconds": round(embed_s, 1),
        "queries": len(queries),
        "k": _K,
        "build_threads": threads,
        "sizes": {},
    }
    for size in sorted(sizes):
        vectors = corpus[:size]
        # Exact cosine neighbours (unit vectors): the truth every index is scored against.
        truth = [set(np.argpartition(-(vectors @ query), _K)[:_K].tolist()) for query in queries]
        figures: dict[str, Any] = {}
        candidates: dict[str, dict[str, Any] | None] = {"keel": _keel_index(vectors)}
        if libraries:
            candidates["hnswlib"] = _hnswlib_index(vectors, threads)
            candidates["usearch"] = _usearch_index(vectors, threads)
        for name, index in candidates.items():
            if index is None:
                figures[name] = {"installed": False}
                continue
            if progress:
                progress(f"{name} at {size:,} vectors")
            measured = _measure(index["build"], index["search"], index["size"], queries, truth)
            if "settings" in index:
                measured["settings"] = index["settings"]
            figures[name] = measured
        report["sizes"][str(size)] = figures
    return report
