"""The records and turns a SQLite memory store keeps across reads never outlive a change.

Two memories on one file, each through its own `SQLiteDatabase` (two processes, as far as
SQLite can tell): the first searches (keeping the records and neighbouring turns it read),
the second changes what it read (deletes, expiry, a superseded fact, a new turn next to a hit,
a text rewritten by a plain ``sqlite3`` connection, an erasure, a retention prune), and the
first searches again: its answer is a fresh memory's, never what it kept. Also: one user's
kept records never answer another's read; a read overtaken by another thread's catching up
keeps nothing; a reader the log's trimming left behind drops everything; and the filters
applied to kept rows agree with SQL's.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from keel.memory import (
    HashingEmbedder,
    Memory,
    MemoryFilter,
    MemoryRecord,
    RetentionPolicies,
    Scope,
    prune_memory,
)
from keel.memory._config import RetrievalConfig
from keel.memory._records import ShownSession
from keel.stores import SQLiteDatabase, SQLiteMemoryStore
from keel.stores._sql_memory import SQLMemoryStore

SCOPE = Scope(tenant_id="acme", user_id="u1")
NEIGHBOUR = Scope(tenant_id="acme", user_id="u2")
NOW = datetime(2026, 12, 8, tzinfo=UTC)
QUERY = "which code opens locker17?"


class _Uncached(SQLiteMemoryStore):
    """A store that reads everything from the table: the answer a search must give."""

    def fetch(
        self, scope: Scope, record_ids: Sequence[str], filters: MemoryFilter
    ) -> list[MemoryRecord]:
        return SQLMemoryStore.fetch(self, scope, record_ids, filters)

    def fetch_by_id(
        self, scope: Scope, record_ids: Sequence[str], filters: MemoryFilter
    ) -> dict[str, MemoryRecord]:
        return {r.id: r for r in self.fetch(scope, record_ids, filters)}

    def turns_around(
        self, scope: Scope, spans: Sequence[tuple[str, int, int]]
    ) -> list[MemoryRecord]:
        return SQLMemoryStore.turns_around(self, scope, spans)


def _open(path: Path, kind: type[SQLiteMemoryStore] = SQLiteMemoryStore) -> Memory:
    # No near-duplicates dropped: turns differing in their number are all hits.
    return Memory(
        kind(SQLiteDatabase(path)),
        embedder=HashingEmbedder(64),
        masker=None,
        config=RetrievalConfig(duplicate_similarity=1.01),
    )


def _store(memory: Memory) -> SQLiteMemoryStore:
    store = memory.store
    assert isinstance(store, SQLiteMemoryStore)
    return store


def _fill(path: Path) -> None:
    memory = _open(path)
    for scope, word in ((SCOPE, "code"), (NEIGHBOUR, "colour")):
        memory.add_many(
            [
                {
                    "text": f"User: the {word} of locker{i} is c{i}",
                    "session_id": "s",
                    "turn": i,
                    "event_time": NOW - timedelta(days=i),
                }
                for i in range(40)
            ],
            scope=scope,
        )
    # Hits of no session: blocks of their own, past the three the expansion reads.
    memory.add_many(
        [{"text": f"Note {i}: locker17 has a spare code in drawer {i}"} for i in range(8)],
        scope=SCOPE,
    )
    memory.remember_fact(SCOPE, "locker17", "owner", "dana")
    memory.flush()
    memory.close()


def _answer(memory: Memory, query: str = QUERY, scope: Scope = SCOPE) -> list[dict[str, Any]]:
    return [h.model_dump() for h in memory.search(query, scope=scope, k=8, now=NOW)]


def _warm(path: Path, query: str = QUERY) -> tuple[Memory, Memory]:
    """A memory that searched twice, the second time from what it kept; and its twin, which
    searched alike reading every record from the table (the vector index, the keyword
    plan's counts and every other memo of the two the same: ties among equal cosines are
    broken by where vectors sit in the index, a fresh one's after a deletion included)."""
    memory, twin = _open(path), _open(path, _Uncached)
    first = _answer(memory, query)
    assert _answer(twin, query) == first
    served = _store(memory).trusted.served
    assert _answer(memory, query) == first
    assert _answer(twin, query) == first
    assert _store(memory).trusted.served > served  # the records and turns it kept
    return memory, twin


def _both(memory: Memory, twin: Memory, query: str = QUERY) -> list[dict[str, Any]]:
    """The memory's answer, which must be its twin's; both closed."""
    answer = _answer(memory, query)
    assert answer == _answer(twin, query)
    memory.close()
    twin.close()
    return answer


def _kept_hit(memory: Memory) -> str:
    """The id of the best hit of the notes (their own blocks) that the search kept."""
    kept = _store(memory).trusted.records
    return next(
        h["record"]["id"]
        for h in _answer(memory)
        if h["record"]["id"] in kept and "spare" in h["record"]["text"]
    )


def _delete(other: Memory, path: Path, target: str) -> None:
    assert other.forget(SCOPE, target)


def _expire(other: Memory, path: Path, target: str) -> None:
    other.store.set_expiry(SCOPE, {target: NOW - timedelta(days=400)})


def _expiry_moved(other: Memory, path: Path, target: str) -> None:
    # Still alive, so still a candidate: the hit's record shows its new expiry.
    other.store.set_expiry(SCOPE, {target: NOW + timedelta(days=400)})


def _rewritten_by_hand(other: Memory, path: Path, target: str) -> None:
    # Still the same hit (as long, the same words of the question), another text: only the
    # change log tells.
    with sqlite3.connect(path) as plain:
        plain.execute(
            "UPDATE memory_records SET text = replace(text, 'spare', 'extra') WHERE id = ?",
            (target,),
        )


def _neighbour_added(other: Memory, path: Path, target: str) -> None:
    # Next to the hit about locker17, whose neighbouring turns were kept.
    other.add("User: locker17's spare key is under the mat", scope=SCOPE, session_id="s", turn=18)
    other.flush()


def _erased(other: Memory, path: Path, target: str) -> None:
    other.store.erase_user(SCOPE.tenant_id, SCOPE.user_id)


def _pruned(other: Memory, path: Path, target: str) -> None:
    policies = RetentionPolicies.parse({"acme": {"episodic": {"max_count": 3}}})
    assert prune_memory(other.store, policies).total > 0


CHANGES: dict[str, Callable[[Memory, Path, str], None]] = {
    "deleted": _delete,
    "expired": _expire,
    "its expiry moved": _expiry_moved,
    "its text rewritten by another connection": _rewritten_by_hand,
    "a turn added next to a hit": _neighbour_added,
    "the user erased": _erased,
    "pruned by retention": _pruned,
}


@pytest.mark.parametrize("change", CHANGES)
def test_a_change_by_another_connection_is_seen_by_the_next_search(
    tmp_path: Path, change: str
) -> None:
    path = tmp_path / "memory.db"
    _fill(path)
    memory, twin = _warm(path)
    target = _kept_hit(memory)
    before = _answer(memory)
    other = _open(path)
    try:
        CHANGES[change](other, path, target)
    finally:
        other.close()
    assert _both(memory, twin) != before  # the change mattered to this search


def test_a_superseded_fact_is_not_served_from_what_was_kept(tmp_path: Path) -> None:
    path = tmp_path / "memory.db"
    _fill(path)
    query = "who is the owner of locker17?"
    memory, twin = _warm(path, query)
    assert "dana" in str(_answer(memory, query))
    other = _open(path)
    other.remember_fact(SCOPE, "locker17", "owner", "eli")
    other.flush()
    other.close()
    after = _both(memory, twin, query)
    assert "dana" not in str(after)
    assert "eli" in str(after)


def test_this_process_own_changes_are_seen_too(tmp_path: Path) -> None:
    path = tmp_path / "memory.db"
    _fill(path)
    memory, twin = _warm(path)
    before = _answer(memory)
    _rewritten_by_hand(memory, path, _kept_hit(memory))
    _neighbour_added(memory, path, "")
    assert _both(memory, twin) != before


def test_one_user_s_kept_records_never_answer_another_s_read(tmp_path: Path) -> None:
    path = tmp_path / "memory.db"
    _fill(path)
    memory, twin = _warm(path)
    store = _store(memory)
    kept = list(store.trusted.records)
    assert kept
    assert store.fetch_by_id(NEIGHBOUR, kept, MemoryFilter()) == {}
    # The neighbour's session has the same id and turns: its own turns are read.
    turns = store.turns_around(NEIGHBOUR, [("s", 15, 19)])
    assert [r.text for r in turns] == [
        f"User: the colour of locker{i} is c{i}" for i in range(15, 20)
    ]
    question = "which colour has locker17?"
    assert _answer(memory, question, NEIGHBOUR) == _answer(twin, question, NEIGHBOUR)
    memory.close()
    twin.close()


def test_an_erasure_in_this_process_drops_what_was_kept_of_the_user_at_once(
    tmp_path: Path,
) -> None:
    path = tmp_path / "memory.db"
    _fill(path)
    memory, twin = _warm(path)
    twin.close()
    _answer(memory, "which colour has locker17?", NEIGHBOUR)
    store = _store(memory)
    store.erase_user(SCOPE.tenant_id, SCOPE.user_id)
    assert all(record.user_id != SCOPE.user_id for record, _ in store.trusted.records.values())
    assert all(key[1] != SCOPE.user_id for key in store.trusted.turns)
    assert store.trusted.records  # the neighbour's stay
    memory.close()


def test_a_reader_the_log_trimming_left_behind_drops_everything(tmp_path: Path) -> None:
    path = tmp_path / "memory.db"
    _fill(path)
    memory, twin = _warm(path)
    top = _kept_hit(memory)
    before = _answer(memory)
    with sqlite3.connect(path) as plain:
        plain.execute(
            "UPDATE memory_records SET text = replace(text, 'spare', 'extra') WHERE id = ?",
            (top,),
        )
        # More changes than the log keeps: the one above is trimmed away.
        for _ in range(140):
            plain.execute("UPDATE memory_records SET step = 1 WHERE user_id = 'u2'")
        (oldest,) = plain.execute("SELECT MIN(seq) FROM memory_changes").fetchone()
    seen = _store(memory).trusted.seen
    assert seen is not None
    assert oldest > seen + 1
    assert _both(memory, twin) != before


def test_records_read_before_another_thread_caught_up_are_not_kept(tmp_path: Path) -> None:
    path = tmp_path / "memory.db"
    _fill(path)
    memory, twin = _warm(path)
    twin.close()
    store = _store(memory)
    trusted = store.trusted
    top = _kept_hit(memory)
    columns = "id, tenant_id, user_id, kind, type, text, provenance, verified_by, session_id, "
    columns += "step, turn, created_at, event_time, subject, attribute, valid_from, valid_to, "
    columns += "content_hash, embedding_model, metadata, key, expires_at"
    # This thread catches up and reads the row; then the row changes and another thread
    # catches up (dropping what it kept of it) before this one keeps what it read.
    position = store.db.run(trusted.catch_up, write=False)
    with sqlite3.connect(path) as plain:
        (row,) = plain.execute(f"SELECT {columns} FROM memory_records WHERE id = ?", (top,))
        plain.execute("UPDATE memory_records SET text = 'User: gone' WHERE id = ?", (top,))
    done = threading.Event()

    def other_thread() -> None:
        store.db.run(trusted.catch_up, write=False)
        done.set()

    threading.Thread(target=other_thread).start()
    assert done.wait(10)
    trusted.keep(position, [tuple(row)], store.records.record)
    assert top not in trusted.records
    found = store.fetch_by_id(SCOPE, [top], MemoryFilter())
    assert found[top].text == "User: gone"
    memory.close()


# --- the filters on kept rows against SQL's -------------------------------------------------

_filters = st.builds(
    MemoryFilter,
    kinds=st.sampled_from([(), ("episodic",), ("semantic",)]),
    types=st.sampled_from([(), ("note",), ("fact", "turn")]),
    exclude_types=st.sampled_from([(), ("run",), ("note",)]),
    session_id=st.sampled_from([None, "a", "b"]),
    include_superseded=st.booleans(),
    since=st.sampled_from([None, NOW - timedelta(days=3), NOW]),
    until=st.sampled_from([None, NOW - timedelta(days=1), NOW + timedelta(seconds=1)]),
    keys=st.sampled_from([(), ("k1",), ("k1", "kx")]),
    key_prefix=st.sampled_from([None, "", "k", "kx", "q"]),
    shown=st.sampled_from(
        [
            None,
            ShownSession(session_id="a"),
            ShownSession(session_id="a", first_turn=3),
            ShownSession(session_id="b", first_turn=1, summary_key="k1"),
            ShownSession(session_id="a", summary_key="kx"),
        ]
    ),
    include_expired=st.booleans(),
    alive_at=st.sampled_from([None, NOW - timedelta(days=2), NOW + timedelta(days=2)]),
)


@pytest.fixture(scope="module")
def varied(tmp_path_factory: pytest.TempPathFactory) -> tuple[SQLiteMemoryStore, list[str]]:
    """A store of records that differ in every column a filter reads, all of them kept."""
    path = tmp_path_factory.mktemp("varied") / "memory.db"
    memory = _open(path)
    ids: list[str] = []
    for i in range(72):
        record = memory.add(
            f"note {i}",
            scope=SCOPE,
            kind="semantic" if i % 5 == 0 else "episodic",
            type=("note", "turn", "fact", "run")[(i // 2) % 4],
            session_id=(None, "a", "b")[i % 3],
            turn=None if i % 7 == 0 else (i // 3) % 6,
            # A key names one record: each is given once.
            key={1: "k1", 3: "kx1", 5: "q", 7: "kx", 9: "k"}.get(i, f"z{i}" if i % 2 else None),
            expires_at=(None, NOW - timedelta(days=1), NOW + timedelta(days=1))[(i // 4) % 3],
        )
        ids.append(record.id)
    memory.remember_fact(SCOPE, "door", "colour", "red")
    ids.append(memory.remember_fact(SCOPE, "door", "colour", "blue").id)
    ids.extend(r.id for r in memory.store.fact_history(SCOPE, "door", "colour"))
    store = _store(memory)
    everything = MemoryFilter(include_superseded=True, include_expired=True)
    assert len(store.fetch_by_id(SCOPE, ids, everything)) == len(set(ids))
    assert set(store.trusted.records) >= set(ids)
    return store, ids


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(filters=_filters)
# Each condition at its boundary alone (a random filter is mostly narrowed by several).
@example(filters=MemoryFilter(shown=ShownSession(session_id="a", first_turn=3)))
@example(filters=MemoryFilter(shown=ShownSession(session_id="a", summary_key="k1")))
@example(filters=MemoryFilter(key_prefix="kx"))
@example(filters=MemoryFilter(keys=("k1", "q")))
@example(filters=MemoryFilter(session_id="b", include_superseded=True))
@example(filters=MemoryFilter(alive_at=NOW + timedelta(days=2)))
@example(filters=MemoryFilter(include_expired=True, exclude_types=("run",)))
def test_the_filters_on_kept_rows_are_sql_s(
    varied: tuple[SQLiteMemoryStore, list[str]], filters: MemoryFilter
) -> None:
    store, ids = varied
    served = store.trusted.served
    by_sql = SQLMemoryStore.fetch(store, SCOPE, ids, filters)
    kept = store.fetch_by_id(SCOPE, ids, filters)
    assert set(kept) == {r.id for r in by_sql}
    assert store.trusted.served - served == len(by_sql)  # all of them from what was kept
    # ``fetch`` gives them in the statements' order, too.
    assert store.fetch(SCOPE, ids, filters) == by_sql


@given(picked=st.lists(st.integers(0, 10_000), max_size=40))
@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_kept_records_come_in_the_statements_order(
    varied: tuple[SQLiteMemoryStore, list[str]], picked: list[int]
) -> None:
    store, ids = varied
    asked = [ids[i % len(ids)] for i in picked]
    everything = MemoryFilter(include_superseded=True, include_expired=True)
    assert store.fetch(SCOPE, asked, everything) == SQLMemoryStore.fetch(
        store, SCOPE, asked, everything
    )


def test_a_read_in_a_snapshot_keeps_nothing_older_than_what_was_applied(tmp_path: Path) -> None:
    path = tmp_path / "memory.db"
    _fill(path)
    memory, twin = _warm(path)
    twin.close()
    store = _store(memory)
    target = _kept_hit(memory)
    database = store.db
    assert isinstance(database, SQLiteDatabase)
    with database.snapshot():
        store.count(SCOPE)  # the snapshot is taken by its first read
        with sqlite3.connect(path) as plain:
            plain.execute(
                "UPDATE memory_records SET text = replace(text, 'spare', 'extra') WHERE id = ?",
                (target,),
            )
        caught_up = threading.Event()

        def other_thread() -> None:  # applies the change (the target is dropped, not read)
            store.db.run(store.trusted.catch_up, write=False)
            caught_up.set()

        threading.Thread(target=other_thread).start()
        assert caught_up.wait(10)
        # In the snapshot, the text as it was then.
        assert "spare" in store.fetch_by_id(SCOPE, [target], MemoryFilter())[target].text
    assert "extra" in store.fetch_by_id(SCOPE, [target], MemoryFilter())[target].text
    memory.close()
