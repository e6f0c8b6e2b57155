"""PostgreSQL keyword search at scale: each scope's word counts kept in ``memory_terms`` by
triggers, and the ranking that looks for a broad query's newest matches among the newest
records first. Both must give what counting and ranking from the records themselves gives."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

import keel.stores._postgres_keywords as postgres_keywords
from keel.memory import Memory, MemoryFilter, Scope
from keel.stores import PostgresDatabase, PostgresMemoryStore
from keel.stores._migrations import MigrationSet
from keel.stores._postgres_memory import POSTGRES_MEMORY_MIGRATIONS
from keel.stores._postgres_terms import scope_terms
from tests.stores.test_postgres_memory import _Statements

pytestmark = pytest.mark.postgres

ALICE = Scope(tenant_id="acme", user_id="alice")
BOB = Scope(tenant_id="acme", user_id="bob")
EVE = Scope(tenant_id="evil-corp", user_id="alice")

OpenDatabase = Callable[..., PostgresDatabase]

_RECOUNTED = """
    SELECT tenant_id, user_id, term, COUNT(*) FROM (
        SELECT tenant_id, user_id, '' AS term FROM memory_records
        UNION ALL
        SELECT tenant_id, user_id, unnest(tsvector_to_array(tsv)) FROM memory_records
    ) words GROUP BY tenant_id, user_id, term
"""


@pytest.fixture
def open_database(postgres_url: str) -> Iterator[OpenDatabase]:
    with ExitStack() as databases:

        def open_one(**options: Any) -> PostgresDatabase:
            return databases.enter_context(PostgresDatabase(postgres_url, **options))

        yield open_one


def _kept(url: str) -> set[tuple[str, str, str, int]]:
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT tenant_id, user_id, term, rows FROM memory_terms").fetchall()
    return {(str(t), str(u), str(w), int(n)) for t, u, w, n in rows}


def _recounted(url: str) -> set[tuple[str, str, str, int]]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(_RECOUNTED).fetchall()
    return {(str(t), str(u), str(w), int(n)) for t, u, w, n in rows}


def _words(url: str, scope: Scope) -> dict[str, int]:
    return {w: n for t, u, w, n in _kept(url) if (t, u) == (scope.tenant_id, scope.user_id)}


def test_the_counts_follow_every_write_and_delete(
    postgres_url: str, open_database: OpenDatabase
) -> None:
    store = PostgresMemoryStore(open_database())
    memory = Memory(store, embedder=None, masker=None)
    alice = memory.add_many(
        [{"text": f"note {n}: the orchard by the granite wall"} for n in range(30)]
        + [{"text": "a pear tree in the orchard"}],
        scope=ALICE,
    )
    memory.add_many([{"text": "the orchard gate is green"}], scope=BOB)
    memory.add("a heron by the orchard", scope=EVE)
    assert _kept(postgres_url) == _recounted(postgres_url)
    assert _words(postgres_url, ALICE)["orchard"] == 31
    assert _words(postgres_url, ALICE)[""] == 31
    assert _words(postgres_url, BOB) == {"": 1, "orchard": 1, "gate": 1, "green": 1}

    # A key's record replaced (a delete and an insert in one transaction), one forgotten.
    memory.add("the kettle is on", scope=ALICE, key="kitchen")
    memory.add("the kettle is cold", scope=ALICE, key="kitchen")
    assert memory.forget(ALICE, alice[-1].id)
    assert _kept(postgres_url) == _recounted(postgres_url)
    assert "pear" not in _words(postgres_url, ALICE)
    assert _words(postgres_url, ALICE)["kettl"] == 1

    # Expiry, retention, then a user's erasure.
    now = datetime.now(UTC)
    store.set_expiry(ALICE, {record.id: now - timedelta(seconds=1) for record in alice[:5]})
    assert store.purge_expired(ALICE, now) == 5
    assert _words(postgres_url, ALICE)["orchard"] == 25
    assert store.prune("acme", "episodic", before=None, keep=10) > 0
    assert _kept(postgres_url) == _recounted(postgres_url)
    assert _words(postgres_url, ALICE)[""] == 10
    store.erase_user("acme", "bob")
    assert _words(postgres_url, BOB) == {}
    assert _kept(postgres_url) == _recounted(postgres_url)

    # Another client's SQL is counted too: an edit of a text, then the table emptied.
    with psycopg.connect(postgres_url) as conn:
        conn.execute("UPDATE memory_records SET text = 'a swallow' WHERE tenant_id = 'evil-corp'")
    assert _words(postgres_url, EVE) == {"": 1, "swallow": 1}
    assert _kept(postgres_url) == _recounted(postgres_url)
    with psycopg.connect(postgres_url) as conn:
        conn.execute("TRUNCATE memory_records CASCADE")
    assert _kept(postgres_url) == set()
    memory.close()


def test_a_search_reads_only_its_own_scopes_counts(open_database: OpenDatabase) -> None:
    store = PostgresMemoryStore(open_database())
    memory = Memory(store, embedder=None, masker=None)
    memory.add_many([{"text": f"orchard walk {n}"} for n in range(40)], scope=ALICE)
    memory.add_many([{"text": f"orchard walk {n}"} for n in range(3)], scope=EVE)
    memory.add_many([{"text": "the orchard"}, {"text": "a walk"}], scope=BOB)
    counted = store.db.run(lambda: scope_terms(BOB, ["orchard", "walks", "the", "e-mail"]))
    assert counted.scope_rows == 2
    assert counted.rows("orchard") == 1
    assert counted.rows("walks") == 1  # looked up as its lexeme, "walk"
    assert counted.rows("the") == 0  # a stop word: no lexeme, no match
    assert counted.rows("e-mail") is None  # several lexemes: counted from the records
    hits = memory.search("orchard", scope=BOB, k=10)
    assert [hit.record.text for hit in hits] == ["the orchard"]
    memory.close()


def test_the_migration_counts_the_records_already_there(
    postgres_url: str, open_database: OpenDatabase
) -> None:
    before = MigrationSet("memory", POSTGRES_MEMORY_MIGRATIONS.migrations[:-1])
    open_database().migrate(before)
    with psycopg.connect(postgres_url) as conn:
        for n, (scope, text) in enumerate(
            [(ALICE, "the orchard gate"), (ALICE, "an orchard"), (EVE, "the granite wall")]
        ):
            conn.execute(
                "INSERT INTO memory_records (id, tenant_id, user_id, kind, type, text, "
                "provenance, created_at, content_hash) VALUES (%s, %s, %s, 'episodic', "
                "'note', %s, 'user_claim', %s, %s)",
                (f"r{n}", scope.tenant_id, scope.user_id, text, time.time(), f"h{n}"),
            )
    PostgresMemoryStore(open_database())
    assert _kept(postgres_url) == _recounted(postgres_url)
    assert _words(postgres_url, ALICE) == {"": 2, "orchard": 2, "gate": 1}


def test_a_search_counts_records_only_for_a_word_of_several_lexemes(
    postgres_url: str, open_database: OpenDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = PostgresMemoryStore(open_database())
    memory = Memory(store, embedder=None, masker=None)
    memory.add_many(
        [{"text": f"note {n}: the orchard by the granite wall"} for n in range(40)], scope=ALICE
    )
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        # The table's size is read as its largest seq: a table of a million records...
        conn.execute("SELECT setval('memory_records_seq_seq', 1000000)")
    gate = memory.add("the orchard gate is green, e-mail me", scope=ALICE)
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        # ... all of them Alice's.
        conn.execute("UPDATE memory_terms SET rows = 1000000 WHERE term = ''")
    statements = _Statements(monkeypatch)
    hits = memory.search("orchard gate", scope=ALICE, k=3)
    assert hits and hits[0].record.text.startswith("the orchard gate")
    assert statements.matching("SELECT COUNT(*) FROM (SELECT 1") == []
    # A word the table does not hold as one lexeme (Memory splits a query into runs of
    # letters and digits; another caller may not) is counted from the records, with the
    # bound: a term in more than 20,000 rows is dropped as common, however large the table.
    found = store.keyword_search(ALICE, ["e-mail"], MemoryFilter(), 3)
    assert found and found[0].record_id == gate.id
    counts = statements.matching("SELECT COUNT(*) FROM (SELECT 1")
    limits = [s.params[-1] for s in counts if isinstance(s.params, tuple)]
    assert limits and max(limits) <= 20_001, limits
    memory.close()


def _broad_table(memory: Memory, old_only: bool, every: int) -> None:
    """4,000 records of Alice's: "apple" and "pear" each in one of ``every`` of them, from
    the first and from the middle of each run of ``every`` (or, ``old_only``, twice as often
    in the oldest half, so the newest records hold none); and 50 of Bob's with both."""
    entries = []
    for n in range(4000):
        words = f"record {n} of the ledger"
        if old_only:
            half = every // 2
            words += (" apple" if n % half == 0 else " pear" if n % half == half // 2 else "") * (
                n < 2000
            )
        else:
            words += " apple" if n % every == 0 else " pear" if n % every == every // 2 else ""
        entries.append({"text": words})
    memory.add_many(entries, scope=ALICE)
    memory.add_many([{"text": f"apple pear {n}"} for n in range(50)], scope=BOB)


def _ranked_by_every_way(
    postgres_url: str,
    open_database: OpenDatabase,
    monkeypatch: pytest.MonkeyPatch,
    old_only: bool,
    every: int,
) -> tuple[list[int], list[str], list[Any], list[Any]]:
    """Alice's broad "apple pear" ranked by the way the store chooses, then by reading every
    match: the windows `_recent_window` chose, the SQL the chosen way ran, and both rankings
    (100 rows scored: the words' 500 to 1,000 rows are over that budget)."""
    store = PostgresMemoryStore(open_database())
    memory = Memory(store, embedder=None, masker=None)
    _broad_table(memory, old_only, every)
    store.wait_for_statistics()
    monkeypatch.setattr("keel.stores._postgres_memory._SCORED_ROWS", 100)
    windows: list[int] = []
    recent_window = postgres_keywords._recent_window

    def noted(*args: Any) -> int:
        windows.append(recent_window(*args))
        return windows[-1]

    monkeypatch.setattr(postgres_keywords, "_recent_window", noted)
    seen = _Statements(monkeypatch)
    chosen = store.keyword_search(ALICE, ["apple", "pear"], MemoryFilter(), 100)
    ran = [statement.sql for statement in seen.seen if "ORDER BY score DESC" in statement.sql]
    monkeypatch.setattr(postgres_keywords, "_recent_window", lambda *args: 0)
    monkeypatch.setattr(postgres_keywords, "_walk_cheaper", lambda *args: False)
    everything = store.keyword_search(ALICE, ["apple", "pear"], MemoryFilter(), 100)
    assert len(everything) == 100
    with psycopg.connect(postgres_url) as conn:
        bobs = {r[0] for r in conn.execute("SELECT id FROM memory_records WHERE user_id = 'bob'")}
    assert bobs and not bobs & {hit.record_id for hit in chosen}
    memory.close()
    return windows, ran, chosen, everything


@pytest.mark.parametrize("old_only", [False, True])
def test_a_broad_query_ranks_the_same_rows_with_or_without_the_window(
    postgres_url: str, open_database: OpenDatabase, monkeypatch: pytest.MonkeyPatch, old_only: bool
) -> None:
    # Each word in 250 of 4,000 records: the newest 100 matches lie in the newest 800 records
    # (or, old_only, in none of the newest 2,000), a window cheaper than reading all 500
    # matches or walking back through 800 records.
    windows, _, windowed, everything = _ranked_by_every_way(
        postgres_url, open_database, monkeypatch, old_only, every=16
    )
    assert windows and windows[-1] > 0, "the window was not used"
    assert windowed == everything


@pytest.mark.parametrize("old_only", [False, True])
def test_a_broad_query_of_common_words_walks_back_to_the_same_rows(
    postgres_url: str, open_database: OpenDatabase, monkeypatch: pytest.MonkeyPatch, old_only: bool
) -> None:
    # Each word in 1,000 of 4,000 records: the newest 100 of their matches lie in the newest
    # 200 records, fewer to walk back through than the window's bitmaps or every match cost
    # (at 1M records, a word in 40% of them: 49 ms for its postings, 3 ms for the walk).
    windows, ran, walked, everything = _ranked_by_every_way(
        postgres_url, open_database, monkeypatch, old_only, every=4
    )
    assert windows == [0], "the window was used"
    # The walk orders by seq itself (its index); the window and reading every match by
    # "seq + 0", which hides the index.
    assert len(ran) == 1 and "seq + 0" not in ran[0], ran
    assert walked == everything
