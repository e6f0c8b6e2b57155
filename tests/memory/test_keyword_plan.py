"""Keyword search ranks a bounded number of rows, and still finds rare words (both backends)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

import pytest

from keel.memory import Memory, MemoryFilter, MemoryRecord, MemoryStore, RetrievalConfig, Scope
from keel.stores import (
    PostgresDatabase,
    SQLiteDatabase,
    SQLiteMemoryStore,
    _keywords,
    _postgres_memory,
    _sqlite_memory,
)
from keel.stores._keywords import TermFrequencies
from keel.stores._postgres_memory import PostgresMemoryStore
from keel.stores._sql_plan import Plan

_T = TypeVar("_T")

SCOPE = Scope(tenant_id="t", user_id="u")
OTHER = Scope(tenant_id="t", user_id="someone-else")


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def make_store(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[], MemoryStore]]:
    # A 40-row ranking budget makes a few hundred rows a "large" table.
    monkeypatch.setattr(_sqlite_memory, "_SCORED_DOCUMENTS", 40)
    monkeypatch.setattr(_postgres_memory, "_SCORED_ROWS", 40)
    if request.param == "sqlite":
        yield lambda: SQLiteMemoryStore(SQLiteDatabase(tmp_path / "kw.db"))
        return
    url = request.getfixturevalue("postgres_url")
    with PostgresDatabase(url) as database:
        yield lambda: _postgres_memory.PostgresMemoryStore(database)


def _fill(store: MemoryStore, rows: int) -> None:
    memory = Memory(store, embedder=None)
    memory.add("the oldest note mentions a zebra and alpha", scope=SCOPE)
    for number in range(rows):
        memory.add(f"alpha note number {number}", scope=SCOPE)
        memory.add(f"alpha zebra for someone else {number}", scope=OTHER)


def _texts(store: MemoryStore, terms: list[str], limit: int = 10) -> list[str]:
    hits = store.keyword_search(SCOPE, terms, MemoryFilter(), limit)
    records = {r.id: r for r in store.fetch(SCOPE, [h.record_id for h in hits], MemoryFilter())}
    return [records[h.record_id].text for h in hits]


def test_a_rare_word_finds_its_row_however_old(make_store: Callable[[], MemoryStore]) -> None:
    store = make_store()
    _fill(store, 150)
    # "zebra" is common in another user's rows but rare in this scope's: it is planned per scope.
    texts = _texts(store, ["zebra", "alpha"])
    assert texts[0] == "the oldest note mentions a zebra and alpha"
    assert all("someone" not in text for text in texts)
    store.close()


def test_a_broad_query_ranks_only_the_newest_matches(
    make_store: Callable[[], MemoryStore],
) -> None:
    store = make_store()
    _fill(store, 150)
    texts = _texts(store, ["alpha"], limit=100)
    assert texts and all("someone" not in text for text in texts)
    numbers = [int(text.rsplit(" ", 1)[1]) for text in texts if text.startswith("alpha note")]
    assert len(texts) <= 41 and min(numbers) >= 150 - 41
    store.close()


def test_a_moderately_common_word_ranks_its_newest_matches(
    make_store: Callable[[], MemoryStore],
) -> None:
    # "beta" is in 50 of ~300 rows: over the budget, yet too rare for PostgreSQL to walk the
    # table newest first, so its matches come from the full-text index (the other strategy).
    store = make_store()
    memory = Memory(store, embedder=None)
    for number in range(150):
        memory.add(f"alpha note {'beta ' if number % 3 == 0 else ''}{number}", scope=SCOPE)
        memory.add(f"alpha for someone else {number}", scope=OTHER)
    texts = _texts(store, ["beta"], limit=100)
    numbers = sorted(int(text.rsplit(" ", 1)[1]) for text in texts)
    newest = [n for n in range(150) if n % 3 == 0][-len(numbers) :]
    assert 30 <= len(numbers) <= 41 and numbers == newest
    store.close()


def test_a_small_table_is_ranked_in_full(make_store: Callable[[], MemoryStore]) -> None:
    store = make_store()
    memory = Memory(store, embedder=None)
    for number in range(15):
        memory.add(f"alpha note number {number}", scope=SCOPE)
    assert len(_texts(store, ["alpha"], limit=100)) == 15
    store.close()


def test_an_older_database_gets_a_scoped_full_text_index(tmp_path: Path) -> None:
    from keel.stores._migrations import MigrationSet

    first = MigrationSet("memory", SQLiteMemoryStore.migrations.migrations[:1])
    db = SQLiteDatabase(tmp_path / "old.db")
    db.setup(first)
    with db.transaction() as conn:
        conn.execute(
            "INSERT INTO memory_records (id, tenant_id, user_id, kind, type, text, provenance, "
            "created_at, content_hash) VALUES ('r1', 't', 'u', 'episodic', 'note', "
            "'written before the upgrade: zebra crossing', 'user_claim', 0, 'h1')"
        )
    db.close()

    upgraded = SQLiteMemoryStore(SQLiteDatabase(tmp_path / "old.db"))
    assert _texts(upgraded, ["zebra"]) == ["written before the upgrade: zebra crossing"]
    other = upgraded.keyword_search(OTHER, ["zebra"], MemoryFilter(), 10)
    assert other == []
    upgraded.close()


def _counted(value: int) -> Plan[int]:
    """A count's plan that needs no statement (a test's counts are known)."""
    yield from ()
    return value


def _planned(plan: Plan[_T]) -> _T:
    """What a plan that runs no statement returns."""
    try:
        plan.send(None)  # type: ignore[arg-type]
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    raise AssertionError("the plan ran a statement")


def test_term_counts_are_reused_only_while_within_five_percent() -> None:
    counted: list[str] = []

    def count(term: str) -> Plan[int]:
        counted.append(term)
        return _counted({"common": 1000, "rare": 2, "": 0}[term])

    cache = TermFrequencies()
    scope = ("t", "u")
    for term in ("common", "rare", ""):
        _planned(cache.get(scope, term, 10_000, count))
    # 50 more rows in the table: the common count may be off by 5%, so it is reused; a
    # rare word's or an empty scope's could now be anything from 0 to 50, so they are not.
    for term in ("common", "rare", ""):
        _planned(cache.get(scope, term, 10_050, count))
    assert counted == ["common", "rare", "", "rare", ""]
    _planned(cache.get(scope, "common", 10_051, count))
    assert counted[-1] == "common"
    # Nothing changed: every count is reused, even a zero.
    before = len(counted)
    _planned(cache.get(scope, "", 10_051, count))
    assert len(counted) == before + 1  # "" was last counted at 10_050
    _planned(cache.get(scope, "", 10_051, count))
    assert len(counted) == before + 1


def test_a_word_counted_to_half_a_smaller_scope_is_counted_again_as_the_scope_grows(
    make_store: Callable[[], MemoryStore],
) -> None:
    # "note" is in every record, so it tells none of them apart and is left out of the query
    # (more than half of the scope). Its count stops at half the scope plus one; counted
    # when the scope was smaller, that bound says nothing about the larger scope's half.
    store = make_store()
    memory = Memory(store, embedder=None, config=RetrievalConfig(candidates=10))
    memory.add_many([{"text": f"note {number}"} for number in range(100)], scope=SCOPE)
    memory.add("note about a zebra", scope=SCOPE)

    def found() -> list[str]:
        return [hit.record.text for hit in memory.search("note zebra", scope=SCOPE, k=10)]

    assert found() == ["note about a zebra"]
    # Each count is reused while the table grew by less than 5% of it: "note"'s (51, its
    # bound) for 2 rows, the scope's (101) for 5. 4 rows later "note" is counted again (to
    # 51 still: the scope's count is kept), then 2 more and only the scope's is.
    memory.add_many([{"text": f"note {number}"} for number in range(100, 104)], scope=SCOPE)
    assert found() == ["note about a zebra"]
    memory.add_many([{"text": f"note {number}"} for number in range(104, 106)], scope=SCOPE)
    assert found() == ["note about a zebra"]
    store.close()


def _in_scope_again(store: MemoryStore, memory: Memory) -> list[str]:
    """The scope's texts for "alpha zebra" once it holds only two records, one per word."""
    memory.add("alpha beta", scope=SCOPE)
    memory.add("zebra gamma", scope=SCOPE)
    return sorted(hit.record.text for hit in memory.search("alpha zebra", scope=SCOPE, k=10))


def test_an_erased_users_word_counts_go_with_the_rows(
    make_store: Callable[[], MemoryStore],
) -> None:
    # Counted in 100 rows ("alpha" in all of them, so left out of the query as telling none
    # apart), then the rows are erased: the counts said nothing of the two rows written after.
    store = make_store()
    memory = Memory(store, embedder=None, config=RetrievalConfig(candidates=10))
    memory.add_many([{"text": f"alpha note {number}"} for number in range(100)], scope=SCOPE)
    assert len(memory.search("alpha zebra", scope=SCOPE, k=10)) == 10
    store.erase_user(SCOPE.tenant_id, SCOPE.user_id)
    assert _in_scope_again(store, memory) == ["alpha beta", "zebra gamma"]
    store.erase_user(SCOPE.tenant_id, SCOPE.user_id)
    # Nor are the user's words kept in the store's counts.
    assert ("t", "u") not in store._term_frequencies._counts  # type: ignore[attr-defined]
    store.close()


_LONG_AGO = datetime(2000, 1, 1, tzinfo=UTC)


def _delete(store: MemoryStore, memory: Memory, how: str, records: list[MemoryRecord]) -> None:
    if how == "forget":
        for record in records:
            memory.forget(SCOPE, record.id)
        return
    if how == "prune":
        store.prune(SCOPE.tenant_id, records[0].kind, before=None, keep=0)
        return
    store.set_expiry(SCOPE, {record.id: _LONG_AGO for record in records})
    store.purge_expired(SCOPE if how == "purge_expired" else None, datetime.now(UTC))


@pytest.mark.parametrize("how", ["forget", "purge_expired", "purge_expired_everywhere", "prune"])
def test_a_scopes_word_counts_are_made_again_after_its_records_are_deleted(
    make_store: Callable[[], MemoryStore], how: str
) -> None:
    store = make_store()
    memory = Memory(store, embedder=None, config=RetrievalConfig(candidates=10))
    added = memory.add_many(
        [{"text": f"alpha note {number}"} for number in range(100)], scope=SCOPE
    )
    assert len(memory.search("alpha zebra", scope=SCOPE, k=10)) == 10
    _delete(store, memory, how, added)
    assert _in_scope_again(store, memory) == ["alpha beta", "zebra gamma"]
    store.close()


class _PausedAfterCounting(TermFrequencies):
    """Term counts whose count of ``word`` waits, once made, until the test lets it be kept
    (a search in one thread while another thread deletes the rows it counted)."""

    def __init__(self, word: str) -> None:
        super().__init__()
        self.word = word
        self.counted = threading.Event()
        self.resume = threading.Event()

    def get(
        self,
        scope: tuple[str, str],
        term: str,
        total_rows: int,
        count: Callable[[str], Plan[int]],
        limit: int | None = None,
    ) -> Plan[int]:
        def paused(counted_term: str) -> Plan[int]:
            value = yield from count(counted_term)
            if counted_term == self.word and not self.counted.is_set():
                self.counted.set()
                assert self.resume.wait(timeout=60)
            return value

        return super().get(scope, term, total_rows, paused, limit)


def test_a_count_made_while_the_user_is_erased_is_not_kept(
    make_store: Callable[[], MemoryStore],
) -> None:
    # A search counts "alpha" in the user's 100 rows; before it keeps that count, another
    # thread erases the user. Kept, the count would outlive the erasure (the user's words in
    # memory) and drop "alpha" from the returning user's queries as in every row.
    store = make_store()
    if isinstance(store, PostgresMemoryStore):
        # PostgreSQL reads every count from memory_terms, current in the search's own
        # snapshot, and keeps none across searches: nothing of the erased rows can be kept.
        memory = Memory(store, embedder=None, config=RetrievalConfig(candidates=10))
        memory.add_many([{"text": f"alpha note {n}"} for n in range(100)], scope=SCOPE)
        assert len(memory.search("alpha zebra", scope=SCOPE, k=10)) == 10
        store.erase_user(SCOPE.tenant_id, SCOPE.user_id)
        assert store._term_frequencies.known(("t", "u"), "alpha") is None
        assert _in_scope_again(store, memory) == ["alpha beta", "zebra gamma"]
        return
    paused = _PausedAfterCounting("alpha")
    store._term_frequencies = paused  # type: ignore[attr-defined]
    memory = Memory(store, embedder=None, config=RetrievalConfig(candidates=10))
    memory.add_many([{"text": f"alpha note {number}"} for number in range(100)], scope=SCOPE)
    # Another user's newer rows: the table's last row stays, so does its size as counted.
    memory.add_many([{"text": f"other note {number}"} for number in range(20)], scope=OTHER)
    searching = threading.Thread(
        target=memory.search, args=("alpha zebra",), kwargs={"scope": SCOPE}
    )
    searching.start()
    assert paused.counted.wait(timeout=60)
    store.erase_user(SCOPE.tenant_id, SCOPE.user_id)
    paused.resume.set()
    searching.join()
    # What is kept of "alpha" now counts none of the erased rows.
    assert paused.known(("t", "u"), "alpha") in (None, 0)
    assert _in_scope_again(store, memory) == ["alpha beta", "zebra gamma"]
    store.close()


def test_a_user_erased_by_another_worker_finds_their_new_memories(
    make_store: Callable[[], MemoryStore],
) -> None:
    # Two workers of one service (two stores on one database): one counted "alpha" in the
    # user's 100 rows, the other erased the user. The table's last row is another user's, so
    # its size does not fall: only the count of deleting transactions tells the first worker.
    counting, erasing = make_store(), make_store()
    config = RetrievalConfig(candidates=10)
    memory = Memory(counting, embedder=None, config=config)
    memory.add_many([{"text": f"alpha note {number}"} for number in range(100)], scope=SCOPE)
    memory.add_many([{"text": f"other note {number}"} for number in range(20)], scope=OTHER)
    assert len(memory.search("alpha zebra", scope=SCOPE, k=10)) == 10
    erasing.erase_user(SCOPE.tenant_id, SCOPE.user_id)
    assert _in_scope_again(counting, memory) == ["alpha beta", "zebra gamma"]
    # The same after a record forgotten there.
    [gone] = Memory(erasing, embedder=None, config=config).search("beta", scope=SCOPE, k=1)
    assert erasing.delete(SCOPE, gone.record.id)
    assert [h.record.text for h in memory.search("alpha zebra", scope=SCOPE, k=10)] == [
        "zebra gamma"
    ]
    erasing.close()
    counting.close()


def test_a_count_made_when_the_table_was_larger_is_made_again() -> None:
    # Rows deleted by another process (a smaller MAX(rowid)): the count may be of rows gone.
    frequencies = TermFrequencies()
    counted: list[str] = []

    def count(term: str) -> Plan[int]:
        counted.append(term)
        return _counted(40)

    assert _planned(frequencies.get(("t", "u"), "alpha", 100, count)) == 40
    assert _planned(frequencies.get(("t", "u"), "alpha", 101, count)) == 40
    assert counted == ["alpha"]
    _planned(frequencies.get(("t", "u"), "alpha", 60, count))
    assert counted == ["alpha", "alpha"]


def test_a_word_in_most_rows_ranks_its_newest_matches_shortest_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Over the common-word cap (60 rows here), FTS5's bm25() would walk the word's whole
    # doclist before ranking a single row; its newest matches are ordered as BM25 orders the
    # rows of one word at term frequency 1: shortest first, and of equals the newest.
    monkeypatch.setattr(_sqlite_memory, "_SCORED_DOCUMENTS", 40)
    monkeypatch.setattr(_keywords, "common_term_cap", lambda total_rows, most=None: 60)
    store = SQLiteMemoryStore(SQLiteDatabase(tmp_path / "kw.db"))
    memory = Memory(store, embedder=None)
    texts = [f"alpha {'long ' * (number % 3)}note {number:03d}" for number in range(150)]
    for text in texts:
        memory.add(text, scope=SCOPE)
    memory.add("alpha for someone else", scope=OTHER)
    found = _texts(store, ["alpha"], limit=100)
    newest = texts[-40:]
    assert found == sorted(newest, key=lambda text: (len(text), -texts.index(text)))
    store.close()


def test_sqlite_drops_a_word_in_more_than_20k_rows_even_under_a_twentieth() -> None:
    rows = {"moderate": 30_000, "rare": 100}

    def plan(most: int | None) -> list[str]:
        return _planned(
            TermFrequencies().plan(
                ("t", "u"),
                list(rows),
                total_rows=1_000_000,
                scope_rows=1_000_000,
                listed=100,
                budget=1500,
                count=lambda term, limit: _counted(min(rows[term], limit)),
                most_common_rows=most,
            )
        ).terms

    # 30k of 1M rows is under 1/20: kept, unless a term may have at most 20k.
    assert plan(None) == ["rare", "moderate"]
    assert plan(_sqlite_memory._MOST_COMMON_ROWS) == ["rare"]


def test_a_term_in_more_than_half_the_scope_is_dropped_unless_it_is_all_there_is() -> None:
    informative = _keywords.informative_terms
    # 100 rows, 10 listed: a term in 60 has a negative BM25 IDF, one in exactly 50 an IDF of 0.
    assert informative({"caroline": 60, "lgbtq": 1}, 100, 10) == ["lgbtq"]
    assert informative({"half": 50, "lgbtq": 1}, 100, 10) == ["half", "lgbtq"]
    # Listing 80: all 60 rows are ranked anyway, and the shared word still orders them.
    assert informative({"caroline": 60, "lgbtq": 1}, 100, 80) == ["caroline", "lgbtq"]
    # Nothing informative the scope holds: the rarest common term still finds rows.
    assert informative({"caroline": 90, "said": 70, "zebra": 0}, 100, 10) == ["said"]
    assert informative({"zebra": 0}, 100, 10) == ["zebra"]
    # A one-row scope: its only row is found by its own words.
    assert informative({"oslo": 1}, 1, 0) == ["oslo"]
