"""Memory throughput and latency: ingest N synthetic records, then search.

Records are synthetic sentences over a deterministic pseudo-word vocabulary (Zipf-like word
frequencies, like real text), all in ONE scope (the worst case for a per-user index).
Ingestion is measured end to end: PII masking, the durable row + outbox commit, and embedding
in batches through the outbox, until every record is searchable by keyword and by vector
(``ingest_records_per_s``). Its two halves are reported too: ``write_records_per_s`` is the
agent's hot path (``Memory.add``: masked, durable, keyword-searchable at once) and
``embed_records_per_s`` the outbox worker's vector indexing, which runs off the hot path.
``raw_embed_per_s`` is the embedder alone on the same texts in the same batches (the same
thread): the most indexing could reach; ``index_vs_raw`` is indexing's share of it.
Search latency is [`keel.memory.Memory.search`][] with the query embedding included.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from keel.bench._stats import nearest_rank
from keel.memory import Embedder, Memory, MemoryFilter, MemoryStore, Scope
from keel.settings import Settings, load_settings
from keel.stores import Backends, MemoryOptions, PostgresMemoryStore
from keel.stores._sql_plan import Plan, Statement

__all__ = ["run_memory_bench", "synthetic_corpus"]

_SYLLABLES = [
    "ka",
    "to",
    "mi",
    "ra",
    "ne",
    "so",
    "lu",
    "pe",
    "di",
    "va",
    "ko",
    "re",
    "ti",
    "na",
    "mo",
    "shi",
    "ga",
    "be",
    "fu",
    "ro",
    "an",
    "el",
    "in",
    "or",
    "us",
    "ta",
    "lo",
    "mer",
    "vin",
]


def synthetic_corpus(records: int, *, seed: int = 7) -> tuple[list[str], list[str]]:
    """``records`` sentences and 200 queries made of words of existing sentences."""
    rng = random.Random(seed)
    vocabulary = sorted(
        {"".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))) for _ in range(8000)}
    )
    weights = [1.0 / (rank + 1) ** 1.05 for rank in range(len(vocabulary))]
    rng.shuffle(vocabulary)
    texts: list[str] = []
    for number in range(records):
        words = rng.choices(vocabulary, weights=weights, k=rng.randint(8, 16))
        texts.append(f"note {number}: " + " ".join(words))
    queries = []
    for _ in range(200):
        source = texts[rng.randrange(len(texts))].split(": ", 1)[1].split()
        queries.append(" ".join(rng.sample(source, k=min(4, len(source)))))
    return texts, queries


# Every record in one scope: the worst case for a per-user index.
_SCOPE = Scope(tenant_id="bench", user_id="user-1")


def _measure(
    memory: Memory,
    texts: list[str],
    queries: list[str],
    progress: Callable[[str, int, int], None] | None,
    batch: int,
    server_cpu: Callable[[], float | None] | None = None,
    *,
    bulk: bool = False,
    raw: bool = True,
) -> dict[str, Any]:
    scope = _SCOPE
    writing = embedding = 0.0
    indexing_cpu: float | None = 0.0
    for start in range(0, len(texts), batch):
        t0 = time.perf_counter()
        if bulk:
            memory.add_many(
                [
                    {"text": text, "kind": "episodic", "type": "note"}
                    for text in texts[start : start + batch]
                ],
                scope=scope,
            )
        else:
            for text in texts[start : start + batch]:
                memory.add(text, scope=scope, kind="episodic", type="note")
        t1 = time.perf_counter()
        before = None if server_cpu is None else server_cpu()
        memory.process_outbox()
        after = None if server_cpu is None else server_cpu()
        if before is None or after is None or indexing_cpu is None:
            indexing_cpu = None
        else:
            indexing_cpu += after - before
        writing += t1 - t0
        embedding += time.perf_counter() - t1
        if progress is not None:
            progress("ingest", min(start + batch, len(texts)), len(texts))
    ingest = writing + embedding
    raw_s = _raw_embedding_seconds(memory, texts) if raw else None
    server = {}
    if server_cpu is not None and indexing_cpu is not None:
        # The database server's own CPU while vectors were indexed (pgvector's HNSW
        # insertions): on one machine it shares the cores the embedder computes on.
        server = {
            "index_server_cpu_s": round(indexing_cpu, 1),
            "index_server_cpu_ms_per_record": round(1000 * indexing_cpu / len(texts), 3),
        }
    return {
        "records": len(texts),
        "ingest_seconds": round(ingest, 1),
        "ingest_records_per_s": round(len(texts) / ingest, 1),
        "write_records_per_s": round(len(texts) / writing, 1),
        "embed_records_per_s": round(len(texts) / embedding, 1),
        "write_per_s": round(len(texts) / writing, 1),
        "index_per_s": round(len(texts) / embedding, 1),
        "raw_embed_per_s": None if raw_s is None else round(len(texts) / raw_s, 1),
        "index_vs_raw": None if raw_s is None else round(raw_s / embedding, 3),
        **server,
    }


def postgres_server_cpu(url: str) -> Callable[[], float | None]:
    """The CPU seconds a local PostgreSQL server has used so far (its postmaster, every
    process it runs now, and those it has reaped), read from /proc; None where that cannot
    be read (not Linux, not this machine's server)."""
    import os

    import psycopg

    with psycopg.connect(url) as conn:
        row = conn.execute("SHOW data_directory").fetchone()
    pid_file = Path(str(row[0])) / "postmaster.pid" if row else None
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def fields(pid: int) -> list[str]:
        """/proc/PID/stat's fields after the command name (which may hold spaces)."""
        text = Path(f"/proc/{pid}/stat").read_text()
        return text[text.rindex(")") + 2 :].split()

    def read() -> float | None:
        if pid_file is None:
            return None
        try:
            postmaster = int(pid_file.read_text().split()[0])
            # utime, stime, then cutime and cstime: what its reaped backends had used.
            total = sum(int(value) for value in fields(postmaster)[11:15])
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit():
                    continue
                try:
                    child = fields(int(entry.name))
                except OSError:
                    continue  # exited meanwhile: in the postmaster's cutime once reaped
                if int(child[1]) == postmaster:
                    total += int(child[11]) + int(child[12])
        except (OSError, ValueError, IndexError):
            return None
        return total / ticks

    return read


def _raw_embedding_seconds(memory: Memory, texts: list[str]) -> float | None:
    """The embedder's own time for the same texts in the outbox's batches, on this thread:
    the most vector indexing could reach (None without an embedder)."""
    if memory.embedder is None:
        return None
    started = time.perf_counter()
    for start in range(0, len(texts), memory.batch_size):
        memory.embedder.embed(texts[start : start + memory.batch_size])
    return time.perf_counter() - started


def _search_latency(
    memory: Memory, queries: list[str], progress: Callable[[str, int, int], None] | None
) -> dict[str, Any]:
    scope = _SCOPE
    memory.search("warm up the index", scope=scope, k=10)
    latencies: list[float] = []
    for number, query in enumerate(queries):
        t0 = time.perf_counter()
        memory.search(query, scope=scope, k=10)
        latencies.append((time.perf_counter() - t0) * 1000)
        if progress is not None:
            progress("search", number + 1, len(queries))
    return {
        "search_ms_p50": round(nearest_rank(latencies, 0.5), 2),
        "search_ms_p95": round(nearest_rank(latencies, 0.95), 2),
        "search_ms_mean": round(statistics.fmean(latencies), 2),
        "queries": len(queries),
    }


def _sqlite_sizes(folder: Path, records: int) -> dict[str, Any]:
    """The SQLite database's bytes on disk (the file and its WAL), in all and per record."""
    total = sum(path.stat().st_size for path in folder.glob("memory.db*"))
    return {"disk_bytes": total, "bytes_per_record": round(total / records)}


def _postgres_sizes(store: MemoryStore, records: int) -> dict[str, Any]:
    """The memory tables' and indexes' bytes in PostgreSQL, in all and per record."""
    if not isinstance(store, PostgresMemoryStore):
        return {}

    def sizes() -> Plan[list[Any]]:
        found = yield Statement(
            "SELECT c.relname, c.relkind, pg_table_size(c.oid) FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = current_schema() AND c.relname LIKE 'memory%%' "
            "AND c.relkind IN ('r', 'i')"
        )
        return found.rows

    relations = {str(name): int(size) for name, _, size in store.db.run(sizes, write=False)}
    total = sum(relations.values())
    hnsw = sum(size for name, size in relations.items() if name.endswith("_hnsw"))
    return {
        "disk_bytes": total,
        "bytes_per_record": round(total / records),
        "hnsw_index_bytes": hnsw,
        "relation_bytes": dict(sorted(relations.items())),
    }


def _hnsw_recall(
    store: MemoryStore,
    vectors: list[Any],
    model: str,
    progress: Callable[[str, int, int], None] | None,
) -> dict[str, Any]:
    """recall@10 of the store's vector search (HNSW at its ``ef_search``) against exact search
    (over the 32-bit vectors, index scans off), over ``vectors``."""
    if not isinstance(store, PostgresMemoryStore):
        return {}
    recalls = []
    for number, vector in enumerate(vectors):
        query = np.asarray(vector, dtype=np.float32).reshape(-1)
        found = {
            hit.record_id for hit in store.vector_search(_SCOPE, query, model, MemoryFilter(), 10)
        }
        sql, params = store._vector_search_sql(_SCOPE, query, model, MemoryFilter(), 10, exact=True)
        truth = {str(row[0]) for row in store.db.run(partial(_exactly, Statement(sql, params)))}
        recalls.append(len(found & truth) / max(len(truth), 1))
        if progress is not None:
            progress("recall", number + 1, len(vectors))
    return {
        "hnsw_recall_at_10": round(statistics.fmean(recalls), 3),
        "recall_queries": len(recalls),
    }


def _exactly(search: Statement) -> Plan[list[Any]]:
    """``search``'s rows with index scans off: the vector search ranks every row exactly."""
    yield Statement("SET LOCAL enable_indexscan = off")
    return (yield search).rows


def memory_backends(
    url: str,
    embedder: Embedder,
    *,
    settings: Settings | None = None,
    hnsw: bool = True,
    halfvec: bool = False,
) -> Backends:
    """Memory alone on the database ``url``, opened as keel opens it ([`Backends.open`][]),
    for a bench: ``embedder``'s vectors, no vault, records embedded on ``flush`` only (the
    bench times the indexing), PostgreSQL's vector index as ``hnsw`` and ``halfvec`` say."""
    return Backends.open(
        url,
        settings=settings or load_settings(),
        only=("memory",),
        memory=MemoryOptions(embedder=embedder, hnsw=hnsw, halfvec=halfvec),
        vault=False,
        background=False,
        redis_url="",
    )


def _peak_rss_bytes() -> int | None:
    try:
        import resource
    except ImportError:  # not POSIX
        return None
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def run_memory_bench(
    records: int,
    *,
    embedder: Embedder,
    postgres_store: Callable[[bool], MemoryStore] | None = None,
    postgres_records: int | None = None,
    postgres_settle: Callable[[], None] | None = None,
    postgres_cpu: Callable[[], float | None] | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    batch: int = 512,
    sqlite: bool = True,
    bulk: bool = False,
    recall_queries: int = 0,
) -> dict[str, Any]:
    """Run the benchmark on the embedded backend (and PostgreSQL when a factory is given).

    ``postgres_store(hnsw)`` opens a store on the benchmark's PostgreSQL database.
    ``postgres_settle`` (VACUUM ANALYZE, say) runs after PostgreSQL's ingestion; search is
    then measured again through a new store (no term counts cached) as ``settled``: right
    after a bulk load, autovacuum catches up on the same CPUs the searches use.
    ``postgres_cpu`` (see `postgres_server_cpu`) reads the server's CPU seconds, so
    the report says how much of the indexing time was the server's own work.

    ``bulk`` writes through [`Memory.add_many`][keel.memory.Memory.add_many], ``batch`` records a
    transaction, instead of one ``add`` each, and skips the raw embedder pass; on PostgreSQL the
    vectors are stored without an HNSW index, which is built once after the load
    (``index_build_s``). ``recall_queries`` queries (PostgreSQL) compare the HNSW search with
    exact search (``hnsw_recall_at_10``). Each backend reports its bytes on disk.
    """
    texts, queries = synthetic_corpus(records)
    # Loaded (the default builds its ONNX graph, about 1.5 s) before anything is timed, so
    # neither the first backend's indexing nor its raw figure counts the load.
    embedder.embed(texts[:64])
    report: dict[str, Any] = {"embedding_model": embedder.name, "bulk": bulk}
    if sqlite:
        with (
            tempfile.TemporaryDirectory(prefix="keel-membench-") as tmp,
            memory_backends(f"sqlite:///{Path(tmp) / 'memory.db'}", embedder) as backends,
        ):
            memory = backends.memory
            assert memory is not None
            figures = _measure(memory, texts, queries, progress, batch, bulk=bulk, raw=not bulk)
            figures.update(_search_latency(memory, queries, progress))
            figures.update(_sqlite_sizes(Path(tmp), len(texts)))
            figures["peak_rss_bytes"] = _peak_rss_bytes()
            report["sqlite"] = figures
    if postgres_store is not None:
        count = postgres_records or records
        pg_texts, pg_queries = synthetic_corpus(count) if count != records else (texts, queries)
        memory = Memory(postgres_store(not bulk), embedder=embedder)
        figures = _measure(
            memory,
            pg_texts,
            pg_queries,
            progress,
            batch,
            server_cpu=postgres_cpu,
            bulk=bulk,
            raw=not bulk,
        )
        if bulk:
            store = memory.store
            started = time.perf_counter()
            if progress is not None:
                progress("index build", 0, 1)
            built: list[str] = getattr(store, "build_hnsw_indexes", list)()
            figures["index_build_s"] = round(time.perf_counter() - started, 1)
            figures["indexes_built"] = built
        else:
            figures.update(_search_latency(memory, pg_queries, progress))
        report["postgres"] = figures
        memory.close()
        if postgres_settle is not None:
            postgres_settle()
            memory = Memory(postgres_store(True), embedder=embedder)
            figures["settled"] = _search_latency(memory, pg_queries, progress)
            if bulk:
                figures.update(figures["settled"])
            figures.update(_postgres_sizes(memory.store, count))
            if recall_queries and memory.embedder is not None:
                vectors = memory.embedder.embed(pg_queries[:recall_queries])
                figures.update(
                    _hnsw_recall(memory.store, list(vectors), memory.embedder.name, progress)
                )
            memory.close()
    report.update(report.get("sqlite") or report.get("postgres") or {})
    return report
