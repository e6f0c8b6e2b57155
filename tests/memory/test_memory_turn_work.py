"""A memory-on turn's work does not grow with the records memory holds, counted as work done.

Timings on a loaded machine say little, so these tests count what the work is made of: the
SQLite virtual machine's instructions a retrieval runs (through the connection's progress
handler, on the caller's thread, where ``Memory.retrieve`` reads), the records built from rows,
the texts the embedder is given and the batches the outbox worker embeds.
"""

from __future__ import annotations

import json
import statistics
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from keel.errors import UsageError
from keel.memory import HashingEmbedder, Memory, Scope
from keel.messages import Message
from keel.runtime import Agent
from keel.state import AgentState, StateStore
from keel.stores import SQLiteDatabase, SQLiteMemoryStore, SQLStateBackend
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import tool

SCOPE = Scope(tenant_id="acme", user_id="u1")


class _RecordingEmbedder(HashingEmbedder):
    """Hashed vectors; every batch of texts it was asked to embed, in order."""

    def __init__(self) -> None:
        super().__init__(64)
        self.batches: list[list[str]] = []
        self._lock = threading.Lock()

    def embed(self, texts: Sequence[str]) -> Any:
        with self._lock:
            self.batches.append(list(texts))
        return super().embed(texts)


def _memory_with(database: SQLiteDatabase, records: int) -> Memory:
    """A memory holding ``records`` turns of one session, each about its own locker."""
    memory = Memory(SQLiteMemoryStore(database), embedder=HashingEmbedder(64), masker=None)
    for start in range(0, records, 100):
        memory.add_many(
            [
                {"text": f"User: the code of locker{i} is c{i}", "session_id": "s", "turn": i}
                for i in range(start, min(records, start + 100))
            ],
            scope=SCOPE,
        )
    memory.flush()
    return memory


def _instructions(database: SQLiteDatabase, read: Any) -> int:
    """SQLite VM instructions (in hundreds) ``read()`` runs on this thread's connection."""
    counted = [0]

    def tick() -> int:
        counted[0] += 1
        return 0  # go on

    connection = database.connection()
    connection.set_progress_handler(tick, 100)
    try:
        read()
    finally:
        connection.set_progress_handler(None, 0)
    return counted[0]


def _retrieval_work(tmp_path: Path, records: int) -> dict[str, int]:
    database = SQLiteDatabase(tmp_path / f"work-{records}.db")
    memory = _memory_with(database, records)
    try:
        for n in range(3):  # the first reads (the index's load, the keyword plan's counts)
            memory.retrieve(f"what is the code of locker{n * 7}?", scope=SCOPE, budget_tokens=300)

        def retrieve() -> None:
            for n in range(5):
                memory.retrieve(
                    f"which code opens locker{n * 11 + 3}?", scope=SCOPE, budget_tokens=300
                )

        def neighbours() -> None:
            # Read from the table, not from the turns the store keeps across reads.
            store = memory.store
            assert isinstance(store, SQLiteMemoryStore)
            store.trusted.forget()
            store.turns_around(SCOPE, [("s", n * 7, n * 7 + 2) for n in range(10)])

        return {
            "retrieve": _instructions(database, retrieve),
            "profile": _instructions(database, lambda: memory.profile(SCOPE)),
            "turns_around": _instructions(database, neighbours),
        }
    finally:
        memory.close()
        database.close()


def test_a_retrieval_does_the_same_sql_work_at_3000_records_as_at_300(tmp_path: Path) -> None:
    small = _retrieval_work(tmp_path, 300)
    large = _retrieval_work(tmp_path, 3000)
    # The profile's look-up reads the newest semantic records through an index by kind (it
    # walked every record of the scope past them), the neighbouring turns are one index range
    # each (the scope outside their ORs walked the whole scope): ten times the records, the
    # same work, give or take the B-trees' one more level.
    for part in ("retrieve", "profile", "turns_around"):
        assert large[part] <= small[part] * 1.3 + 2, (part, small, large)


def test_a_query_asked_again_is_not_embedded_again(tmp_path: Path) -> None:
    database = SQLiteDatabase(tmp_path / "query.db")
    embedder = _RecordingEmbedder()
    memory = Memory(SQLiteMemoryStore(database), embedder=embedder, masker=None)
    memory.add("the spare key is under the blue flowerpot", scope=SCOPE)
    memory.flush()
    embedder.batches.clear()
    first = memory.search("where is the spare key?", scope=SCOPE)
    second = memory.search("where is the spare key?", scope=SCOPE)
    memory.search("where is the bike?", scope=SCOPE)
    assert [hit.record.id for hit in first] == [hit.record.id for hit in second]
    assert embedder.batches == [["where is the spare key?"], ["where is the bike?"]]
    memory.close()
    database.close()


def test_the_worker_embeds_a_burst_of_adds_as_one_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No time limit on gathering: only a whole batch (or a flush) makes the worker embed.
    monkeypatch.setattr("keel.memory._outbox.BATCH_WAIT_S", 3600.0)
    database = SQLiteDatabase(tmp_path / "batch.db")
    embedder = _RecordingEmbedder()
    memory = Memory(SQLiteMemoryStore(database), embedder=embedder, batch_size=5, masker=None)
    memory.start()
    signal = memory.indexer._signal
    with signal:  # the first pass (over an empty outbox) is over: the worker sleeps
        assert signal.wait_for(lambda: memory.indexer._progress >= 1, timeout=20)
    for n in range(5):
        memory.add(f"note number {n} about the garden", scope=SCOPE)
    with signal:
        assert signal.wait_for(lambda: memory.store.count_pending() == 0, timeout=20)
    # One batch of five, not a pass of the worker (an outbox read, a transaction) per add.
    assert [len(batch) for batch in embedder.batches] == [5]
    memory.close()
    database.close()


def test_a_flush_does_not_wait_for_a_whole_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("keel.memory._outbox.BATCH_WAIT_S", 3600.0)
    database = SQLiteDatabase(tmp_path / "flush.db")
    memory = Memory(SQLiteMemoryStore(database), embedder=HashingEmbedder(64), masker=None)
    memory.start()
    signal = memory.indexer._signal
    with signal:  # the first pass (over an empty outbox) is over: the worker sleeps
        assert signal.wait_for(lambda: memory.indexer._progress >= 1, timeout=20)
    memory.add("the boiler code is inside the cupboard", scope=SCOPE)
    memory.flush(timeout=20)  # raises TimeoutError if the worker went on gathering
    assert memory.pending() == 0
    memory.close()
    database.close()


def test_add_many_stores_each_entry_as_add_would_and_nothing_when_one_is_refused(
    tmp_path: Path,
) -> None:
    database = SQLiteDatabase(tmp_path / "many.db")
    memory = Memory(SQLiteMemoryStore(database), embedder=HashingEmbedder(64), masker=None)
    kept = memory.add("I live in Lisbon", scope=SCOPE)
    stored = memory.add_many(
        [
            {"text": "I live in Lisbon"},  # stored already: the first record
            {"text": "I like sardines", "kind": "semantic", "provenance": "user_claim"},
        ],
        scope=SCOPE,
    )
    assert stored[0].id == kept.id and stored[1].text == "I like sardines"
    assert stored[1].kind == "semantic" and memory.pending() == 2
    with pytest.raises(UsageError):
        memory.add_many([{"text": "a fine note"}, {"text": "   "}], scope=SCOPE)
    assert memory.store.count(SCOPE) == 2
    memory.close()
    database.close()


@tool
def lookup(query: str) -> str:
    """Look records up.

    Args:
        query: What to look up.
    """
    return f"records for {query}: one entry with its details"


def _policy(call: ScriptedCall) -> Message | str:
    if call.messages[-1].role == "tool":
        return "Here is what I found."
    return ScriptedModel.tool_call("lookup", json.dumps({"query": call.last_user_text[-16:]}))


async def test_a_memory_on_turn_builds_only_the_records_it_never_read(tmp_path: Path) -> None:
    database = SQLiteDatabase(tmp_path / "agent.db")
    memory = Memory(SQLiteMemoryStore(database), embedder=HashingEmbedder(64))
    agent = Agent(
        ScriptedModel(_policy),
        state=StateStore(SQLStateBackend(database), AgentState),
        system_prompt="You answer questions from the records.",
        tools=[lookup],
        memory=memory,
    )
    store = memory.store
    assert isinstance(store, SQLiteMemoryStore)
    built: list[int] = []
    for turn in range(24):
        before = store.records.built
        question = f"Question {turn}: what do the records say about item {turn % 7}?"
        reply = await agent.handle("s1", "ada", question)
        assert reply.status == "completed"
        built.append(store.records.built - before)
    # A turn recalls dozens of records (candidates, their neighbours); those read before come
    # back as they were built, so a turn builds the records written since (its own two, each
    # once more when its vector lands), not every record it reads.
    assert statistics.median(built[8:]) <= 6, built
    memory.close()
    database.close()


def test_the_worker_embeds_short_and_long_texts_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A transformer pads a pass's texts to the longest: a long summary gathered with short turns
    # would make each short one cost as much. An explicit process keeps one call per batch.
    monkeypatch.setattr("keel.memory._outbox.BATCH_WAIT_S", 3600.0)
    database = SQLiteDatabase(tmp_path / "lengths.db")
    embedder = _RecordingEmbedder()
    memory = Memory(SQLiteMemoryStore(database), embedder=embedder, batch_size=3, masker=None)
    long = "the running summary of the whole session so far " * 20
    memory.add("a short turn", scope=SCOPE)
    memory.process_outbox()
    memory.add("another short turn", scope=SCOPE)
    memory.add(long, scope=SCOPE)
    memory.add("a third short turn", scope=SCOPE)
    memory.start()
    with memory.indexer._signal:
        assert memory.indexer._signal.wait_for(lambda: memory.pending() == 0, timeout=20)
    assert embedder.batches == [
        ["a short turn"],
        ["another short turn", "a third short turn"],
        [long],
    ]
    memory.close()
    database.close()


async def _keyword_work_of_turns(
    tmp_path: Path, turns: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[int, int]:
    """The SQLite VM instructions (in tens) the keyword search of turn ``turns`` runs, and the
    records memory then holds. Every question's words are in every record but its own
    number, which no record holds yet: each turn's query is one word common to all rows."""
    database = SQLiteDatabase(tmp_path / f"common-{turns}.db")
    memory = Memory(SQLiteMemoryStore(database), embedder=HashingEmbedder(64))
    store = memory.store
    assert isinstance(store, SQLiteMemoryStore)
    agent = Agent(
        ScriptedModel(_policy, keep_calls=0),
        state=StateStore(SQLStateBackend(database), AgentState),
        system_prompt="You answer questions from the records.",
        tools=[lookup],
        memory=memory,
    )
    counted = [0]
    search = store.keyword_search

    def counting(*args: Any) -> Any:
        def tick() -> int:
            counted[0] += 1
            return 0

        connection = database.connection()
        connection.set_progress_handler(tick, 10)
        try:
            return search(*args)
        finally:
            connection.set_progress_handler(None, 0)

    monkeypatch.setattr(store, "keyword_search", counting)
    for turn in range(turns + 1):
        counted[0] = 0
        question = f"Question {turn}: what does record {turn % 7} say?"
        reply = await agent.handle("s1", "ada", question)
        assert reply.status == "completed"
    held = store.count(Scope(tenant_id="default", user_id="ada"))
    memory.close()
    database.close()
    return counted[0], held


async def test_a_late_turn_ranks_no_more_rows_of_a_word_every_record_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The bound is lowered so that a short session passes it (600 rows on its own).
    monkeypatch.setattr("keel.stores._sqlite_memory._COMMON_ONLY_ROWS", 30)
    early, early_records = await _keyword_work_of_turns(tmp_path, 45, monkeypatch)
    late, late_records = await _keyword_work_of_turns(tmp_path, 150, monkeypatch)
    assert late_records >= 3 * early_records, (early_records, late_records)
    # "question", "does", "record", "say" are in every record: the query keeps the rarest
    # and ranks its newest 30 rows, three times the records later as much as before.
    assert late <= early * 1.3 + 20, (early, late)
