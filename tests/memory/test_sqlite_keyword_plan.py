"""The SQLite keyword search scores a bounded number of rows, and still finds rare words."""

from __future__ import annotations

from pathlib import Path

import pytest

from keel.memory import Memory, MemoryFilter, Scope
from keel.stores import SQLiteDatabase, SQLiteMemoryStore, _sqlite_memory

SCOPE = Scope(tenant_id="t", user_id="u")


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SQLiteMemoryStore:
    # A 40-row scoring budget makes 300 rows a "large" table.
    monkeypatch.setattr(_sqlite_memory, "_SCORED_DOCUMENTS", 40)
    store = SQLiteMemoryStore(SQLiteDatabase(tmp_path / "kw.db"))
    memory = Memory(store, embedder=None)
    memory.add("the oldest note mentions a zebra and alpha", scope=SCOPE)
    for number in range(300):
        memory.add(f"alpha note number {number}", scope=SCOPE)
    return store


def _texts(store: SQLiteMemoryStore, terms: list[str], limit: int = 10) -> list[str]:
    hits = store.keyword_search(SCOPE, terms, MemoryFilter(), limit)
    records = {r.id: r for r in store.fetch(SCOPE, [h.record_id for h in hits], MemoryFilter())}
    return [records[h.record_id].text for h in hits]


def test_a_rare_word_finds_its_row_however_old(store: SQLiteMemoryStore) -> None:
    assert _texts(store, ["zebra", "alpha"])[0] == "the oldest note mentions a zebra and alpha"


def test_a_broad_query_scores_only_the_newest_matches(store: SQLiteMemoryStore) -> None:
    numbers = [int(text.rsplit(" ", 1)[1]) for text in _texts(store, ["alpha"], limit=100)]
    assert numbers and len(numbers) <= 41
    assert min(numbers) >= 300 - 41


def test_a_small_table_is_scored_in_full(tmp_path: Path) -> None:
    store = SQLiteMemoryStore(SQLiteDatabase(tmp_path / "small.db"))
    memory = Memory(store, embedder=None)
    for number in range(30):
        memory.add(f"alpha note number {number}", scope=SCOPE)
    assert len(_texts(store, ["alpha"], limit=100)) == 30
