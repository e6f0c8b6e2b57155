"""PostgreSQL memory search reads ``memory_search_rows`` (the columns a search needs, one
narrow row a record, kept by triggers), not the wide records' heap: it must hold exactly what
the records hold after every kind of write, and rank exactly as the records would."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

import keel.stores._postgres_keywords as postgres_keywords
import keel.stores._postgres_memory as postgres_memory
from keel.errors import StoreError
from keel.memory import HashingEmbedder, Memory, MemoryFilter, Scope
from keel.stores import PostgresDatabase, PostgresMemoryStore
from keel.stores._migrations import Migration, MigrationSet
from keel.stores._postgres_memory import POSTGRES_MEMORY_MIGRATIONS
from keel.stores._sql_plan import Statement

pytestmark = pytest.mark.postgres

ALICE = Scope(tenant_id="acme", user_id="alice")
BOB = Scope(tenant_id="acme", user_id="bob")

OpenDatabase = Callable[..., PostgresDatabase]

_MIRRORED = (
    "seq, created_at, valid_to, expires_at, turn, id, tenant_id, user_id, kind, type, "
    "session_id, key, tsv::text"
)


@pytest.fixture
def open_database(postgres_url: str) -> Iterator[OpenDatabase]:
    with ExitStack() as databases:

        def open_one(**options: Any) -> PostgresDatabase:
            return databases.enter_context(PostgresDatabase(postgres_url, **options))

        yield open_one


def _rows(url: str, table: str) -> set[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return {tuple(row) for row in conn.execute(f"SELECT {_MIRRORED} FROM {table}").fetchall()}


def _mirrored(url: str) -> bool:
    records = _rows(url, "memory_records")
    return records == _rows(url, "memory_search_rows")


def test_the_search_rows_follow_every_write_and_delete(
    postgres_url: str, open_database: OpenDatabase
) -> None:
    store = PostgresMemoryStore(open_database())
    memory = Memory(store, embedder=None, masker=None)
    added = memory.add_many(
        [{"text": f"note {n}: the orchard by the granite wall"} for n in range(30)], scope=ALICE
    )
    memory.add("a heron by the orchard", scope=BOB, session_id="s1", turn=3)
    assert _mirrored(postgres_url) and len(_rows(postgres_url, "memory_search_rows")) == 31

    # A key's record replaced, a fact superseded, one forgotten, expiry set and purged.
    memory.add("the kettle is on", scope=ALICE, key="kitchen")
    memory.add("the kettle is cold", scope=ALICE, key="kitchen")
    memory.remember_fact(ALICE, "alice", "city", "Lisbon")
    memory.remember_fact(ALICE, "alice", "city", "Porto")
    assert memory.forget(ALICE, added[-1].id)
    now = datetime.now(UTC)
    store.set_expiry(ALICE, {record.id: now + timedelta(days=1) for record in added[5:8]})
    store.set_expiry(ALICE, {record.id: now - timedelta(seconds=1) for record in added[:5]})
    assert _mirrored(postgres_url)
    assert store.purge_expired(ALICE, now) == 5
    assert store.prune("acme", "episodic", before=None, keep=10) > 0
    assert _mirrored(postgres_url)
    store.erase_user("acme", "bob")
    assert _mirrored(postgres_url)
    assert not [row for row in _rows(postgres_url, "memory_search_rows") if "bob" in row]

    # Another client's SQL: an edit of a text and a type, then the table emptied.
    with psycopg.connect(postgres_url) as conn:
        conn.execute("UPDATE memory_records SET text = 'a swallow', type = 'tip'")
    assert _mirrored(postgres_url)
    # The outbox's embedding_model update copies nothing (no mirrored column changes).
    with psycopg.connect(postgres_url) as conn:
        conn.execute("UPDATE memory_records SET embedding_model = 'm'")
    assert _mirrored(postgres_url)
    with psycopg.connect(postgres_url) as conn:
        conn.execute("TRUNCATE memory_records CASCADE")
    assert _rows(postgres_url, "memory_search_rows") == set()
    memory.close()


def test_the_migration_copies_the_records_already_there(
    postgres_url: str, open_database: OpenDatabase
) -> None:
    before = MigrationSet("memory", POSTGRES_MEMORY_MIGRATIONS.migrations[:-1])
    open_database().migrate(before)
    with psycopg.connect(postgres_url) as conn:
        for n, (scope, text) in enumerate(
            [(ALICE, "the orchard gate"), (ALICE, "an orchard"), (BOB, "the granite wall")]
        ):
            conn.execute(
                "INSERT INTO memory_records (id, tenant_id, user_id, kind, type, text, "
                "provenance, created_at, content_hash, metadata) VALUES (%s, %s, %s, "
                "'episodic', 'note', %s, 'user_claim', %s, %s, %s)",
                (f"r{n}", scope.tenant_id, scope.user_id, text, time.time(), f"h{n}", "{}"),
            )
    store = PostgresMemoryStore(open_database())
    assert _mirrored(postgres_url) and len(_rows(postgres_url, "memory_search_rows")) == 3
    with psycopg.connect(postgres_url) as conn:
        indexes = {
            str(name)
            for (name,) in conn.execute(
                "SELECT indexname FROM pg_indexes WHERE tablename IN "
                "('memory_records', 'memory_search_rows')"
            )
        }
    # The full-text index moved: the records' one would only cost every write.
    assert "memory_search_rows_tsv" in indexes and "memory_records_tsv" not in indexes
    with psycopg.connect(postgres_url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stats WHERE tablename = 'memory_search_rows'"
        ).fetchone()
    # Analyzed as it was filled: the planner knows its columns (a scope's share, NULLs).
    assert row is not None and row[0] > 0
    hits = store.keyword_search(ALICE, ["orchard"], MemoryFilter(), 10)
    assert {hit.record_id for hit in hits} == {"r0", "r1"}


def _plans(store: PostgresMemoryStore, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every search statement the store runs from now on, run again under EXPLAIN."""
    plans: list[str] = []
    run = store.db.run

    def explained(plan: Callable[[], Any], **options: Any) -> Any:
        def again() -> Any:
            generator = plan()
            reply = None
            try:
                while True:
                    statement = generator.send(reply)
                    if "score" in statement.sql or "<=>" in statement.sql:
                        explain = Statement(
                            "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) " + statement.sql,
                            statement.params,
                        )
                        plans.append("\n".join(r[0] for r in (yield explain).rows))
                    reply = yield statement
            except StopIteration as stop:
                return stop.value

        return run(again, **options)

    monkeypatch.setattr(store.db, "run", explained)
    return plans


def _buffers(plan: str) -> int:
    """The pages a statement read, hit or not (its plan's first Buffers line)."""
    line = next(line for line in plan.splitlines() if "Buffers:" in line)
    return sum(int(part.split("=")[1]) for part in line.split() if "=" in part)


def test_searches_read_the_narrow_rows_and_rank_as_the_records_would(
    postgres_url: str, open_database: OpenDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = PostgresMemoryStore(open_database())
    memory = Memory(store, embedder=HashingEmbedder(64), masker=None)
    words = ["harbour", "lantern", "orchard", "granite", "meadow", "violin", "saffron"]
    memory.add_many(
        [
            {"text": f"note {n}: {words[n % 7]} {words[(n * 3) % 7]} {'x' * (n % 50)}"}
            for n in range(3000)
        ],
        scope=ALICE,
    )
    memory.add_many([{"text": f"bob's {words[n % 7]} {n}"} for n in range(500)], scope=BOB)
    memory.flush()
    store.wait_for_statistics()
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")
    queries = ["harbour lantern", "orchard", "granite violin note 7", "meadow saffron x"]
    narrow = [[hit.record.id for hit in memory.search(q, scope=ALICE, k=10)] for q in queries]
    plans = _plans(store, monkeypatch)
    for query in queries:
        memory.search(query, scope=ALICE, k=10)
    vector = [plan for plan in plans if "memory_vectors_64" in plan]
    assert vector and len(plans) > len(vector), plans
    for plan in vector:
        # Each candidate's filters looked up by its key, not the whole table read.
        assert "Index Scan using memory_search_rows_id_key" in plan, plan
    for plan in plans:
        assert "memory_search_rows" in plan and "on memory_records" not in plan, plan
    # Read from the records' heap instead (the code before this table), the same ranking.
    monkeypatch.setattr(postgres_keywords, "SEARCH_ROWS", "memory_records")
    monkeypatch.setattr(postgres_memory, "SEARCH_ROWS", "memory_records")
    old = [[hit.record.id for hit in memory.search(q, scope=ALICE, k=10)] for q in queries]
    assert narrow == old and all(narrow)
    memory.close()


def test_a_keyword_ranking_reads_fewer_pages_than_from_the_records(
    postgres_url: str, open_database: OpenDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = PostgresMemoryStore(open_database())
    memory = Memory(store, embedder=None, masker=None)
    # Meta data makes a record wide, as real ones are (text, provenance, hashes, JSON).
    memory.add_many(
        [{"text": f"entry {n} of the ledger", "metadata": {"pad": "m" * 300}} for n in range(4000)],
        scope=ALICE,
    )
    store.wait_for_statistics()
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")

    def buffers(table: str) -> tuple[int, list[str]]:
        monkeypatch.setattr(postgres_keywords, "SEARCH_ROWS", table)
        plans = _plans(store, monkeypatch)
        found = store.keyword_search(ALICE, ["ledger"], MemoryFilter(), 1500)
        monkeypatch.undo()
        return _buffers(plans[0]), [h.record_id for h in found]

    narrow, narrow_ids = buffers("memory_search_rows")
    wide, wide_ids = buffers("memory_records")
    assert narrow_ids == wide_ids and len(narrow_ids) == 1500
    assert narrow * 3 < wide, (narrow, wide)
    memory.close()


def test_a_small_scope_is_ranked_from_its_own_rows_not_the_whole_table(
    postgres_url: str, open_database: OpenDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = PostgresMemoryStore(open_database())
    memory = Memory(store, embedder=None, masker=None)
    memory.add_many([{"text": f"the orchard gate {n}"} for n in range(5)], scope=ALICE)
    # Another tenant's 20,000 records with the same word (a bulk load, by SQL for speed): the
    # narrow rows had no scope index, so ranking alice's five read every row of the table.
    with psycopg.connect(postgres_url) as conn:
        conn.execute(
            "INSERT INTO memory_records (id, tenant_id, user_id, kind, type, text, provenance, "
            "created_at, content_hash) SELECT 'big' || g, 'globex', 'u' || (g % 50), "
            "'episodic', 'note', 'the orchard row ' || g, 'user_claim', g, 'h' || g "
            "FROM generate_series(1, 20000) g"
        )
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")
    plans = _plans(store, monkeypatch)
    hits = memory.search("orchard", scope=ALICE, k=10)
    assert len(hits) == 5 and all(hit.record.user_id == "alice" for hit in hits)
    assert plans
    for plan in plans:
        assert "Seq Scan on memory_search_rows" not in plan, plan
        # A few pages for five rows (the whole table is about 400).
        assert _buffers(plan) < 40, plan
    memory.close()


def test_the_search_rows_follow_copy_merge_upserts_and_rollbacks(
    postgres_url: str, open_database: OpenDatabase
) -> None:
    memory = Memory(PostgresMemoryStore(open_database()), embedder=None, masker=None)
    memory.add_many([{"text": f"note {n} of the orchard"} for n in range(5)], scope=ALICE)
    columns = "id, tenant_id, user_id, kind, type, text, provenance, created_at, content_hash"
    with psycopg.connect(postgres_url) as conn:
        # A bulk load by COPY, then another client's upserts (each ON CONFLICT target).
        with conn.cursor().copy(f"COPY memory_records ({columns}) FROM STDIN") as copy:
            for n in range(4):
                row = (f"c{n}", "acme", "carol", "episodic", "note", f"lark {n}", "user_claim")
                copy.write_row((*row, time.time(), f"hash{n}"))
        conn.execute(
            f"INSERT INTO memory_records ({columns}) VALUES ('c0', 'acme', 'carol', "
            "'episodic', 'note', 'a swan', 'user_claim', 1, 'x') ON CONFLICT (id) DO UPDATE "
            "SET text = EXCLUDED.text, expires_at = 5"
        )
        conn.execute(
            f"INSERT INTO memory_records ({columns}) VALUES ('c9', 'acme', 'carol', "
            "'episodic', 'note', 'ignored', 'user_claim', 1, 'hash1') ON CONFLICT "
            "(tenant_id, user_id, content_hash) DO UPDATE SET session_id = 's9', turn = 4"
        )
        conn.execute(
            "MERGE INTO memory_records r USING (VALUES ('c2', 'a heron'), ('m1', 'a wren')) "
            "v (id, text) ON r.id = v.id WHEN MATCHED THEN UPDATE SET text = v.text "
            f"WHEN NOT MATCHED THEN INSERT ({columns}) VALUES (v.id, 'acme', 'erin', "
            "'episodic', 'note', v.text, 'user_claim', 1, 'merged')"
        )
    assert _mirrored(postgres_url) and len(_rows(postgres_url, "memory_search_rows")) == 10
    with psycopg.connect(postgres_url) as conn:
        # Writes rolled back, whole or to a savepoint, leave the rows as they were.
        with conn.transaction():
            conn.execute("DELETE FROM memory_records WHERE id = 'c3'")
            with conn.transaction():
                conn.execute("UPDATE memory_records SET type = 'tip' WHERE id = 'c1'")
                conn.execute("DELETE FROM memory_records WHERE id = 'm1'")
                raise psycopg.Rollback()
        conn.execute("UPDATE memory_records SET text = 'gone' WHERE id = 'c0'")
        conn.rollback()
    assert _mirrored(postgres_url) and len(_rows(postgres_url, "memory_search_rows")) == 9
    memory.close()


def test_a_migration_that_fails_halfway_leaves_version_7_and_runs_again(
    postgres_url: str, open_database: OpenDatabase
) -> None:
    migrations = POSTGRES_MEMORY_MIGRATIONS.migrations
    open_database().migrate(MigrationSet("memory", migrations[:-1]))
    with psycopg.connect(postgres_url) as conn:
        conn.execute(
            "INSERT INTO memory_records (id, tenant_id, user_id, kind, type, text, provenance, "
            "created_at, content_hash, key, expires_at) VALUES ('r1', 'acme', 'alice', "
            "'episodic', 'note', 'the orchard', 'user_claim', 1, 'h1', 'k', 99)"
        )
    last = migrations[-1]
    assert isinstance(last.apply, str)
    failing = Migration(last.description, last.apply + "\nSELECT 1 / 0;")
    with pytest.raises(StoreError, match="division by zero"):
        open_database().migrate(MigrationSet("memory", (*migrations[:-1], failing)))
    with psycopg.connect(postgres_url) as conn:
        found = conn.execute(
            "SELECT to_regclass('memory_search_rows'), to_regclass('memory_records_tsv'), "
            "(SELECT version FROM keel_schema WHERE component = 'memory')"
        ).fetchone()
    assert found == (None, "memory_records_tsv", 7)
    store = PostgresMemoryStore(open_database())
    open_database().migrate(POSTGRES_MEMORY_MIGRATIONS)  # again: nothing to do
    assert _mirrored(postgres_url) and len(_rows(postgres_url, "memory_search_rows")) == 1
    hits = store.keyword_search(ALICE, ["orchard"], MemoryFilter(include_expired=True), 10)
    assert [hit.record_id for hit in hits] == ["r1"]
