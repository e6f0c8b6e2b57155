"""PostgresMemoryStore beyond the shared conformance suite: the HNSW path at scale."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import numpy as np
import psycopg
import pytest

from keel.errors import ConfigError, StoreError
from keel.memory import HashingEmbedder, Memory, MemoryFilter, Scope
from keel.stores import PostgresDatabase, PostgresMemoryStore
from keel.stores._sql_plan import Plan, Statement

pytestmark = pytest.mark.postgres

ALICE = Scope(tenant_id="acme", user_id="alice")
BOB = Scope(tenant_id="acme", user_id="bob")
EVE = Scope(tenant_id="evil-corp", user_id="alice")

OpenDatabase = Callable[..., PostgresDatabase]


@pytest.fixture
def open_database(postgres_url: str) -> Iterator[OpenDatabase]:
    """Opens a pool on the test's database (a process of its own), closed after the test."""
    with ExitStack() as databases:

        def open_one(**options: Any) -> PostgresDatabase:
            return databases.enter_context(PostgresDatabase(postgres_url, **options))

        yield open_one


def _scans(plan: list[tuple[str]]) -> str:
    """The plan's scan and filter lines (the rest repeats the long query vector)."""
    return "\n".join(r[0] for r in plan if "Scan" in r[0] or "Removed" in r[0])


def _explain(store: PostgresMemoryStore, scope: Scope, query: np.ndarray, f: MemoryFilter) -> str:
    sql, params = store._vector_search_sql(scope, query, "m", f, 100)
    explain = Statement("EXPLAIN (ANALYZE, COSTS OFF) " + sql, params)
    return _scans(store.db.run(lambda: store._searched(explain)))


def _unit(rng: np.random.Generator, centers: np.ndarray, n: int) -> np.ndarray:
    x = centers[rng.integers(0, len(centers), n)] + 0.7 * rng.normal(size=(n, centers.shape[1]))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.mark.slow
def test_hnsw_serves_a_large_scope_with_only_its_rows(
    postgres_url: str, open_database: OpenDatabase
) -> None:
    dim = 64
    store = PostgresMemoryStore(open_database())
    seed = Memory(store, embedder=HashingEmbedder(dim), masker=None)
    seed.add("the store creates the vector table and its HNSW index", scope=EVE)
    seed.flush()
    rng = np.random.default_rng(7)
    centers = rng.normal(size=(64, dim))
    # Alice and Bob share one index, 2,000 rows each: a plain (non-iterative) HNSW scan for
    # Alice would stop after ef_search index rows, about half of them Bob's.
    sizes = {ALICE: 2000, BOB: 2000, EVE: 800}
    data = {
        scope: ([uuid.uuid4().hex for _ in range(n)], _unit(rng, centers, n))
        for scope, n in sizes.items()
    }
    session_ids = set(data[ALICE][0][:30])
    # Bulk loaded in the store's schema (store.insert would take one round trip per row);
    # the vectors still go through the HNSW index one by one, as the store's own writes do.
    with psycopg.connect(postgres_url) as conn:
        with conn.cursor().copy(
            "COPY memory_records (id, tenant_id, user_id, kind, type, text, provenance, "
            "session_id, created_at, content_hash, embedding_model) FROM STDIN"
        ) as copy:
            for scope, (ids, _) in data.items():
                for record_id in ids:
                    session = "s1" if record_id in session_ids else None
                    copy.write_row(
                        (
                            record_id,
                            scope.tenant_id,
                            scope.user_id,
                            "episodic",
                            "note",
                            f"row {record_id}",
                            "user_claim",
                            session,
                            time.time(),
                            record_id,
                            "m",
                        )
                    )
        with conn.cursor().copy(
            f"COPY memory_vectors_{dim} (record_id, tenant_id, user_id, model, embedding) "
            "FROM STDIN"
        ) as copy:
            for scope, (ids, vectors) in data.items():
                for record_id, vector in zip(ids, vectors, strict=True):
                    text = "[" + ",".join(f"{x:.7g}" for x in vector) + "]"
                    copy.write_row((record_id, scope.tenant_id, scope.user_id, "m", text))
        conn.execute("ANALYZE")

    queries = _unit(rng, centers, 20)
    for scope in (ALICE, EVE):
        ids, vectors = data[scope]
        recall = []
        for query in queries:
            hits = store.vector_search(scope, query, "m", MemoryFilter(), 100)
            assert len(hits) == 100
            assert {h.record_id for h in hits} <= set(ids)
            exact = {ids[i] for i in np.argsort(-(vectors @ query))[:100]}
            recall.append(len(exact & {h.record_id for h in hits}) / 100)
        assert np.mean(recall) >= 0.95, (scope, np.mean(recall))

    plan = _explain(store, ALICE, queries[0], MemoryFilter())
    assert f"Index Scan using memory_vectors_{dim}_hnsw" in plan, plan
    removed = [line for line in plan.splitlines() if "Rows Removed by Filter" in line]
    assert removed and int(removed[0].split(":")[1]) > 0, plan
    # A scope small enough is ranked exactly from its scope index instead of the graph.
    plan = _explain(store, EVE, queries[0], MemoryFilter())
    assert "_hnsw" not in plan and f"memory_vectors_{dim}_scope" in plan, plan

    # A selective filter over a large scope still finds all its rows (the planner reads
    # them by the records' own indexes rather than walking the graph past them).
    session = MemoryFilter(session_id="s1")
    hits = store.vector_search(ALICE, queries[0], "m", session, 100)
    assert {h.record_id for h in hits} == session_ids
    assert store.vector_search(BOB, queries[0], "m", session, 100) == []
    store.close()


def test_wide_embeddings_get_a_halfvec_hnsw_index(
    postgres_url: str, open_database: OpenDatabase
) -> None:
    # pgvector's HNSW takes at most 2,000 dimensions of `vector`: 3,072 (OpenAI
    # text-embedding-3-large) is indexed as halfvec, and queries use that expression.
    memory = Memory(
        PostgresMemoryStore(open_database()), embedder=HashingEmbedder(3072), masker=None
    )
    store = memory.store
    assert isinstance(store, PostgresMemoryStore)
    allergy = memory.add("Alice is allergic to peanuts", scope=ALICE)
    memory.add("Alice runs every morning", scope=ALICE)
    memory.add("Bob is allergic to peanuts", scope=BOB)
    memory.flush()
    assert memory.pending() == 0
    assert [h.record.id for h in memory.search("allergic peanuts", scope=ALICE, k=1)] == [
        allergy.id
    ]
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT indexdef FROM pg_indexes WHERE indexname = 'memory_vectors_3072_hnsw'"
        ).fetchone()
        assert row is not None and "halfvec(3072)" in row[0] and "halfvec_cosine_ops" in row[0]
    query = memory.embedder.embed_one("allergic peanuts")  # type: ignore[union-attr]
    sql, params = store._vector_search_sql(ALICE, query, memory.embedder.name, MemoryFilter(), 5)  # type: ignore[union-attr]

    def explain() -> Plan[list[Any]]:
        # Without sorts, the only way to ORDER BY distance is the HNSW index: the planner
        # can take it only if the query's expression is the index's.
        yield Statement("SET LOCAL enable_sort = off")
        return (yield from store._searched(Statement("EXPLAIN " + sql, params)))

    plan = _scans(store.db.run(explain))
    assert "Index Scan using memory_vectors_3072_hnsw" in plan, plan
    memory.close()


def test_a_vector_table_created_by_another_process_is_searched(open_database: OpenDatabase) -> None:
    reader = PostgresMemoryStore(open_database())
    reader.setup()  # before any vector table exists, as a web process started before the worker
    writer = Memory(PostgresMemoryStore(open_database()), embedder=HashingEmbedder(64), masker=None)
    record = writer.add("the spare key is under the blue flowerpot", scope=ALICE)
    writer.flush()
    query = writer.embedder.embed_one("blue flowerpot")  # type: ignore[union-attr]
    hits = reader.vector_search(ALICE, query, "keel-hashing-64", MemoryFilter(), 5)
    assert [h.record_id for h in hits] == [record.id]
    writer.close()
    reader.close()


def test_searches_run_with_iterative_hnsw_scans(open_database: OpenDatabase) -> None:
    store = PostgresMemoryStore(open_database(), hnsw=False, ef_search=64)
    store.setup()
    read = Statement(
        "SELECT current_setting('hnsw.iterative_scan'), current_setting('hnsw.ef_search')"
    )
    settings = store.db.run(lambda: store._searched(read))[0]
    assert tuple(settings) == ("relaxed_order", "64")
    # Set for the search's transaction only: another store's next use of the connection
    # runs with the server's defaults.
    with store.db.connection() as conn:
        settings = conn.execute("SELECT current_setting('hnsw.ef_search', true)").fetchone()
    assert settings != ("64",)
    store.close()
    with pytest.raises(ConfigError, match="ef_search"):
        PostgresMemoryStore(open_database(), ef_search=0)


def test_repeated_searches_keep_planning_with_the_query_vector(open_database: OpenDatabase) -> None:
    # psycopg would prepare a statement after five runs, and a generic plan cannot see the
    # query vector: it sorts the whole scope by distance instead of walking the HNSW graph.
    # The database's connections never prepare, so every search is planned with its vector.
    store = PostgresMemoryStore(open_database(max_size=1))
    memory = Memory(store, embedder=HashingEmbedder(64), masker=None)
    words = ["harbour", "lantern", "orchard", "granite", "meadow", "violin", "saffron"]
    for number in range(60):
        memory.add(f"note {number}: {words[number % 7]} {words[(number * 3) % 7]}", scope=ALICE)
    memory.flush()
    for number in range(12):
        assert memory.search(f"{words[number % 7]} {number}", scope=ALICE, k=5)
    with store.db.transaction() as conn:
        prepared = conn.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()
    assert prepared == (0,)
    memory.close()


def test_vectors_read_back_exactly(open_database: OpenDatabase) -> None:
    store = PostgresMemoryStore(open_database())
    memory = Memory(store, embedder=HashingEmbedder(384), masker=None)
    record = memory.add("binary wire format of a stored vector", scope=ALICE)
    memory.flush()
    expected = memory.embedder.embed_one(record.text)  # type: ignore[union-attr]
    stored = store.vectors(ALICE, [record.id], "keel-hashing-384")[record.id]
    assert stored.dtype == np.float32
    assert np.array_equal(stored, expected)
    assert store.vectors(BOB, [record.id], "keel-hashing-384") == {}
    memory.close()


def test_vector_search_joins_by_key_with_missing_or_stale_statistics(
    open_database: OpenDatabase,
) -> None:
    # Autovacuum first analyzes a table up to a minute after its first rows, and a scope that
    # appeared since the last ANALYZE looks empty. Either way the planner took the scope for
    # one row and joined each vector candidate to its record by scanning the whole scope
    # again: quadratic, about 1 s per search at 2,000 records. (The filters are checked on
    # memory_search_rows, whose pages are dense: one of a few pages scanned per candidate is
    # the cheaper plan, and no hazard; Bob's records make it the size where it would be.)
    store = PostgresMemoryStore(open_database())
    memory = Memory(store, embedder=HashingEmbedder(64), masker=None)
    memory.add("the first record, in another scope", scope=BOB)
    memory.flush()
    with store.db.transaction() as conn:
        never_analyzed = conn.execute(
            "SELECT relname FROM pg_class WHERE relname IN ('memory_records', "
            "'memory_outbox', 'memory_vectors_64', 'memory_search_rows') AND reltuples < 0"
        ).fetchall()
    assert never_analyzed == []
    memory.add_many([{"text": f"bob's note {n}"} for n in range(2000)], scope=BOB)
    memory.flush()
    store.wait_for_statistics()
    words = ["harbour", "lantern", "orchard", "granite", "meadow", "violin", "saffron"]
    for number in range(300):
        memory.add(f"note {number}: {words[number % 7]} {words[(number * 3) % 7]}", scope=ALICE)
    memory.flush()
    query = memory.embedder.embed_one("note 5: harbour meadow")  # type: ignore[union-attr]
    sql, params = store._vector_search_sql(ALICE, query, "keel-hashing-64", MemoryFilter(), 100)
    explain = Statement("EXPLAIN (ANALYZE) " + sql, params)
    plan = "\n".join(r[0] for r in store.db.run(lambda: store._searched(explain)))
    assert "Rows Removed by Join Filter" not in plan
    assert len(store.vector_search(ALICE, query, "keel-hashing-64", MemoryFilter(), 100)) == 100
    assert store.vector_search(EVE, query, "keel-hashing-64", MemoryFilter(), 100) == []
    memory.close()


def _reltuples(url: str, table: str) -> float:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT reltuples FROM pg_class WHERE relname = %s", (table,)).fetchone()
    assert row is not None
    return float(row[0])


def test_statistics_follow_a_bulk_load_that_autovacuum_has_not_seen(
    postgres_url: str, open_database: OpenDatabase
) -> None:
    # A scope planned as one row after thousands were written made every keyword search walk
    # the whole scope. Autovacuum is switched off here, so only the store can keep the
    # planner's row counts within 2x of the truth while it writes.
    store = PostgresMemoryStore(open_database())
    store.setup()
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        for table in ("memory_records", "memory_outbox"):
            conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
    memory = Memory(store, embedder=None, masker=None)
    written = 3000
    for number in range(written):
        memory.add(f"note {number}: the harbour lantern", scope=ALICE)
    store.wait_for_statistics()
    assert written / 2 <= _reltuples(postgres_url, "memory_records") <= written
    with psycopg.connect(postgres_url) as conn:
        plan = conn.execute(
            "EXPLAIN (FORMAT JSON) SELECT id FROM memory_records "
            "WHERE tenant_id = %s AND user_id = %s",
            (ALICE.tenant_id, ALICE.user_id),
        ).fetchone()
    assert plan is not None and plan[0][0]["Plan"]["Plan Rows"] >= written / 2
    memory.close()


def test_the_keyword_index_pending_list_stays_short(
    postgres_url: str, open_database: OpenDatabase
) -> None:
    # Every keyword search scans GIN's pending list in full until it is merged; at the 4 MB
    # default it held ~300 pages after 5,000 writes and keyword search right after a bulk
    # load took 2-3x its settled time.
    store = PostgresMemoryStore(open_database())
    memory = Memory(store, embedder=None, masker=None)
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("ALTER TABLE memory_records SET (autovacuum_enabled = false)")
        conn.execute("CREATE EXTENSION IF NOT EXISTS pgstattuple")
    # Twelve words a record: each is one pending entry, so 2,500 records fill ~100 pages.
    rng = np.random.default_rng(11)
    words = [f"{a}{b}" for a in ("har", "lan", "orc", "gra", "mea", "vio") for b in "aeiou"]
    for number in range(2500):
        chosen = rng.choice(len(words), size=12, replace=False)
        memory.add(f"note {number}: " + " ".join(words[i] for i in chosen), scope=ALICE)
    with psycopg.connect(postgres_url) as conn:
        row = conn.execute(
            "SELECT pending_pages FROM pgstatginindex('memory_search_rows_tsv')"
        ).fetchone()
    assert row is not None and int(row[0]) <= 256 // 8 + 1
    memory.close()


def test_add_many_writes_a_batch_in_one_transaction(
    postgres_url: str, open_database: OpenDatabase
) -> None:
    # Plain records of a batch go in one statement (their outbox entries with them), so a
    # batch is all or none, as add_many promises: one by one, each was its own commit.
    memory = Memory(PostgresMemoryStore(open_database()), embedder=HashingEmbedder(64), masker=None)
    kept = memory.add("the spare key is under the blue flowerpot", scope=ALICE)
    with pytest.raises(StoreError):
        # PostgreSQL's text takes no NUL: the batch's third record fails, after two good ones.
        memory.add_many(
            [
                {"text": "the boat is moored at pier 4"},
                {"text": "pier 4 has a red crane"},
                {"text": "a NUL \x00 in the middle"},
            ],
            scope=ALICE,
        )
    with psycopg.connect(postgres_url) as conn:
        texts = conn.execute("SELECT text FROM memory_records ORDER BY seq").fetchall()
    assert texts == [(kept.text,)]
    # A content already stored, or twice in the batch, is the record stored first; keyed
    # records and facts keep their own path, in order, in the same transaction.
    records = memory.add_many(
        [
            {"text": "the boat is moored at pier 4"},
            {"text": kept.text},
            {"text": "the boat is moored at pier 4"},
            {
                "text": "Alice lives in Lyon",
                "kind": "semantic",
                "subject": "Alice",
                "attribute": "city",
            },
            {"text": "the gate code is 4512", "key": "gate"},
            {"text": "the gate code is 9000", "key": "gate"},
            {
                "text": "Alice lives in Porto",
                "kind": "semantic",
                "subject": "Alice",
                "attribute": "city",
            },
        ],
        scope=ALICE,
    )
    assert records[1].id == kept.id and records[2].id == records[0].id != kept.id
    memory.flush()
    assert memory.pending() == 0
    with psycopg.connect(postgres_url) as conn:
        rows = conn.execute(
            "SELECT text, valid_to IS NULL FROM memory_records ORDER BY seq"
        ).fetchall()
    assert rows == [
        (kept.text, True),
        ("the boat is moored at pier 4", True),
        ("Alice lives in Lyon", False),
        ("the gate code is 9000", True),
        ("Alice lives in Porto", True),
    ]
    hits = memory.search("where is the boat moored", scope=ALICE, k=1)
    assert [h.record.id for h in hits] == [records[0].id]
    memory.close()


def test_hnsw_indexes_build_after_a_bulk_load(open_database: OpenDatabase) -> None:
    # A bulk load writes vectors without the graph (hnsw=False), then builds it once.
    loader = Memory(
        PostgresMemoryStore(open_database(), hnsw=False), embedder=HashingEmbedder(64), masker=None
    )
    words = ["harbour", "lantern", "orchard", "granite", "meadow", "violin", "saffron"]
    loader.add_many(
        [{"text": f"note {n}: {words[n % 7]} {words[(n * 3) % 7]}"} for n in range(300)],
        scope=ALICE,
    )
    loader.flush()
    store = loader.store
    assert isinstance(store, PostgresMemoryStore)
    query = HashingEmbedder(64).embed_one("harbour meadow")

    def plan() -> str:
        sql, params = store._vector_search_sql(ALICE, query, "keel-hashing-64", MemoryFilter(), 5)

        def explain() -> Plan[list[Any]]:
            yield Statement("SET LOCAL enable_sort = off")
            return (yield from store._searched(Statement("EXPLAIN " + sql, params)))

        return _scans(store.db.run(explain))

    assert "_hnsw" not in plan()
    assert store.build_hnsw_indexes() == ["memory_vectors_64_hnsw"]
    assert "Index Scan using memory_vectors_64_hnsw" in plan()
    assert store.build_hnsw_indexes() == []
    loader.close()


def test_a_halfvec_index_serves_narrow_embeddings_too(
    postgres_url: str, open_database: OpenDatabase
) -> None:
    # halfvec=True: 384 dimensions (which `vector` could index) indexed as 16-bit halfvec,
    # searched through that index, ranked by the stored 32-bit vectors' similarity.
    store = PostgresMemoryStore(open_database(), halfvec=True)
    memory = Memory(store, embedder=HashingEmbedder(384), masker=None)
    allergy = memory.add("Alice is allergic to peanuts", scope=ALICE)
    memory.add("Alice runs every morning", scope=ALICE)
    memory.flush()
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT indexdef FROM pg_indexes WHERE indexname = 'memory_vectors_384_hnsw'"
        ).fetchone()
    assert row is not None and "halfvec(384)" in row[0] and "halfvec_cosine_ops" in row[0]
    query = HashingEmbedder(384).embed_one("allergic peanuts")
    hits = store.vector_search(ALICE, query, "keel-hashing-384", MemoryFilter(), 1)
    assert [h.record_id for h in hits] == [allergy.id]
    expected = float(query @ HashingEmbedder(384).embed_one(allergy.text))
    assert hits[0].score == pytest.approx(expected, abs=1e-6)
    sql, params = store._vector_search_sql(ALICE, query, "keel-hashing-384", MemoryFilter(), 5)

    def explain() -> Plan[list[Any]]:
        yield Statement("SET LOCAL enable_sort = off")
        return (yield from store._searched(Statement("EXPLAIN " + sql, params)))

    assert "Index Scan using memory_vectors_384_hnsw" in _scans(store.db.run(explain))
    memory.close()


class _Statements:
    """The SQL of every statement the stores run through ``PostgresDatabase.run``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import keel.stores._postgres as postgres

        self.seen: list[Statement] = []
        run_plan = postgres.run_plan

        def recording(cursor: Any, dialect: Any, plan: Plan[Any]) -> Any:
            def recorded() -> Plan[Any]:
                try:
                    statement = next(plan)
                    while True:
                        self.seen.append(statement)
                        statement = plan.send((yield statement))
                except StopIteration as done:
                    return done.value

            return run_plan(cursor, dialect, recorded())

        monkeypatch.setattr(postgres, "run_plan", recording)

    def matching(self, start: str) -> list[Statement]:
        return [statement for statement in self.seen if statement.sql.startswith(start)]


def test_the_outbox_writes_a_batch_of_vectors_in_one_statement(
    postgres_url: str, open_database: OpenDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One statement a vector, each parsed and planned on its own, cost the server twice
    # the CPU of the whole batch's one INSERT (keel bench memory --bulk).
    memory = Memory(
        PostgresMemoryStore(open_database(), hnsw=False),
        embedder=HashingEmbedder(64),
        masker=None,
        batch_size=64,
    )
    memory.add_many([{"text": f"note {n}: harbour lantern {n}"} for n in range(100)], scope=ALICE)
    statements = _Statements(monkeypatch)
    memory.flush()
    inserts = statements.matching("INSERT INTO memory_vectors_64")
    assert [(s.many, len(s.params)) for s in inserts] == [(False, 1 + 2 * 64), (False, 1 + 2 * 36)]
    query = HashingEmbedder(64).embed_one("note 7: harbour lantern 7")
    hits = memory.store.vector_search(ALICE, query, "keel-hashing-64", MemoryFilter(), 1)
    with psycopg.connect(postgres_url) as conn:
        row = conn.execute("SELECT id FROM memory_records WHERE text LIKE 'note 7:%'").fetchone()
    assert row is not None and [h.record_id for h in hits] == [row[0]]
    assert hits[0].score == pytest.approx(1.0, abs=1e-6)
    memory.close()


def test_a_batch_of_vectors_skips_deleted_records_and_repeats(
    postgres_url: str, open_database: OpenDatabase
) -> None:
    # The outbox's batch may name a record deleted since it was queued (no vector, no
    # error) or the same record twice (one vector); each vector takes its record's scope.
    store = PostgresMemoryStore(open_database())
    memory = Memory(store, embedder=None, masker=None)
    kept = memory.add("the lighthouse keeper feeds the gulls", scope=ALICE)
    gone = memory.add("the ferry leaves at noon", scope=ALICE)
    other = memory.add("the lighthouse is painted red", scope=BOB)
    entries = store.pending(10)
    assert {e.record_id for e in entries} == {kept.id, gone.id, other.id}
    assert store.delete(ALICE, gone.id)
    embedder = HashingEmbedder(32)
    batch = [*entries, entries[0]]
    store.complete(batch, [embedder.embed_one(e.text) for e in batch], embedder.name)
    with psycopg.connect(postgres_url) as conn:
        rows = conn.execute(
            "SELECT record_id, tenant_id, user_id, model FROM memory_vectors_32 ORDER BY user_id"
        ).fetchall()
    assert rows == [
        (kept.id, "acme", "alice", embedder.name),
        (other.id, "acme", "bob", embedder.name),
    ]
    assert store.pending(10) == []
    found = store.vectors(ALICE, [kept.id], embedder.name)
    assert np.allclose(found[kept.id], embedder.embed_one(kept.text))
    memory.close()


def test_setting_a_records_embedding_model_keeps_it_on_its_page(
    postgres_url: str, open_database: OpenDatabase
) -> None:
    # The outbox sets each record's embedding_model after its vector is written. Records'
    # pages are left half full so that UPDATE is a HOT one: the new row version on the same
    # page, no new entry in any of the table's indexes (on a full page, every index got one).
    memory = Memory(PostgresMemoryStore(open_database()), embedder=HashingEmbedder(32), masker=None)
    memory.add_many(
        [{"text": f"note {n}: the orchard by the granite wall"} for n in range(300)], scope=ALICE
    )

    def pages() -> dict[str, int]:
        with psycopg.connect(postgres_url) as conn:
            rows = conn.execute(
                "SELECT id, (ctid::text::point)[0]::int FROM memory_records"
            ).fetchall()
        return {str(record_id): int(page) for record_id, page in rows}

    before = pages()
    memory.flush()
    after = pages()
    with psycopg.connect(postgres_url) as conn:
        embedded = conn.execute(
            "SELECT COUNT(*) FROM memory_records WHERE embedding_model = %s", ("keel-hashing-32",)
        ).fetchone()
    assert embedded == (300,)
    stayed = sum(1 for record_id, page in before.items() if after[record_id] == page)
    assert stayed >= 0.9 * len(before), f"{stayed} of {len(before)} stayed on their page"
    memory.close()
