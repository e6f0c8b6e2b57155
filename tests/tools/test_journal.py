"""The journal contract, run against every backend: in memory, SQLite, PostgreSQL."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from keel.errors import SchemaVersionError
from keel.messages import Message, ToolCall
from keel.stores import PostgresDatabase, SQLiteDatabase, SQLToolJournal
from keel.tools import InMemoryJournal, ToolJournal, idempotency_key


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def journal(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ToolJournal]:
    if request.param == "memory":
        yield InMemoryJournal()
    elif request.param == "sqlite":
        db = SQLiteDatabase(tmp_path / "keel.db")
        yield SQLToolJournal(db)
        db.close()
    else:
        url = request.getfixturevalue("postgres_url")
        with PostgresDatabase(url, max_size=4) as database:
            yield SQLToolJournal(database)


@pytest.fixture
async def ajournal(journal: ToolJournal) -> AsyncIterator[ToolJournal]:
    """``journal`` for an async test: PostgreSQL's async pool lives on the test's own event
    loop and is closed before that loop ends. Left open, the loop's teardown cancelled the
    pool's tasks, and once in a CI run that cancellation never finished (the run hung)."""
    yield journal
    database = getattr(journal, "db", None)
    if isinstance(database, PostgresDatabase):
        await database.aclose()


def _claim(journal: ToolJournal, step: int = 1, call_index: int = 0, tool: str = "book"):  # type: ignore[no-untyped-def]
    return journal.claim(
        key=idempotency_key("s1", step, call_index),
        session_id="s1",
        step=step,
        call_index=call_index,
        tool=tool,
        arguments='{"flight": "AF1"}',
    )


def test_keys_are_stable_and_distinct() -> None:
    assert idempotency_key("s", 1, 0) == idempotency_key("s", 1, 0)
    keys = {idempotency_key("s", 1, 0), idempotency_key("s", 1, 1), idempotency_key("s", 2, 0)}
    assert len(keys) == 3 and all(key.startswith("keel-") for key in keys)


def test_the_first_claim_wins(journal: ToolJournal) -> None:
    first = _claim(journal)
    second = _claim(journal)
    assert first.created and not second.created
    assert second.entry.key == first.entry.key and second.entry.in_doubt
    assert first.entry.tool == "book" and first.entry.arguments == '{"flight": "AF1"}'


def test_results_restarts_and_in_doubt_listing(journal: ToolJournal) -> None:
    done = _claim(journal, step=1).entry.key
    doubtful = _claim(journal, step=2).entry.key
    failed = _claim(journal, step=3).entry.key
    entry = journal.finish(done, ok=True, content="booked", output="booked, ref 7")
    assert entry.status == "succeeded" and entry.ok and entry.finished_at is not None
    assert journal.finish(failed, ok=False, content="no", output="no").status == "failed"
    assert journal.restart(doubtful).attempts == 2
    assert [e.key for e in journal.in_doubt()] == [doubtful]
    assert [e.key for e in journal.entries("s1")] == [done, doubtful, failed]
    assert journal.entries("other") == []
    got = journal.get(done)
    assert got is not None and got.output == "booked, ref 7" and got.content == "booked"
    assert journal.get("missing") is None
    resolved = journal.resolve(doubtful, ok=False, content="not booked (checked by hand)")
    assert resolved.status == "failed" and journal.in_doubt() == []


def test_same_calls_finds_identical_calls_of_one_session_at_any_step(
    journal: ToolJournal,
) -> None:
    first = _claim(journal, step=1).entry.key
    _claim(journal, step=2, tool="cancel")
    journal.claim(
        key=idempotency_key("s1", 3, 0),
        session_id="s1",
        step=3,
        call_index=0,
        tool="book",
        arguments='{"flight": "AF2"}',
    )
    journal.claim(
        key=idempotency_key("s2", 1, 0),
        session_id="s2",
        step=1,
        call_index=0,
        tool="book",
        arguments='{"flight": "AF1"}',
    )
    fourth = _claim(journal, step=4, call_index=1).entry.key
    journal.finish(fourth, ok=True, content="booked", output="booked")
    found = journal.same_calls("s1", "book", '{"flight": "AF1"}')
    assert [(e.key, e.status) for e in found] == [(first, "started"), (fourth, "succeeded")]
    assert journal.same_calls("s3", "book", '{"flight": "AF1"}') == []


def test_decisions_first_write_wins(journal: ToolJournal) -> None:
    first = Message.assistant(
        "", tool_calls=[ToolCall(id="c1", name="book", arguments='{"flight": "AF1"}')]
    )
    second = Message.assistant("", tool_calls=[ToolCall(id="c9", name="book", arguments="{}")])
    assert journal.decision("s1", 4) is None
    assert journal.record_decision("s1", 4, first) == first
    assert journal.record_decision("s1", 4, second) == first
    assert journal.decision("s1", 4) == first
    assert journal.decision("s1", 5) is None


def test_concurrent_claims_have_one_winner(journal: ToolJournal) -> None:
    winners: list[bool] = []
    barrier = threading.Barrier(4)

    def claim() -> None:
        barrier.wait()
        winners.append(_claim(journal, step=9).created)

    threads = [threading.Thread(target=claim) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(winners) == [False, False, False, True]


async def test_concurrent_async_claims_have_one_winner(ajournal: ToolJournal) -> None:
    journal = ajournal
    claims = await asyncio.gather(
        *(
            journal.aclaim(
                key="k9", session_id="s1", step=9, call_index=0, tool="book", arguments="{}"
            )
            for _ in range(4)
        )
    )
    assert sorted(claim.created for claim in claims) == [False, False, False, True]
    assert {claim.entry.key for claim in claims} == {"k9"}


def test_sqlite_journal_is_a_versioned_component(tmp_path: Path) -> None:
    db = SQLiteDatabase(tmp_path / "keel.db")
    SQLToolJournal(db)
    assert db.schema_versions()["journal"] == 1
    SQLToolJournal(db)  # idempotent
    with db.transaction() as conn:
        conn.execute("UPDATE keel_schema SET version = 99 WHERE component = 'journal'")
    with pytest.raises(SchemaVersionError):
        SQLToolJournal(db)
    db.close()


def test_postgres_journal_refuses_a_newer_schema(postgres_url: str) -> None:
    with PostgresDatabase(postgres_url, max_size=4) as database:
        SQLToolJournal(database)
        with database.transaction() as conn:
            conn.execute("UPDATE keel_schema SET version = 99 WHERE component = 'journal'")
        with pytest.raises(SchemaVersionError):
            SQLToolJournal(database)


async def test_async_twins_do_what_the_sync_methods_do(ajournal: ToolJournal) -> None:
    journal = ajournal
    claimed = await journal.aclaim(
        key="k1", session_id="s1", step=1, call_index=0, tool="book", arguments="{}"
    )
    again = await journal.aclaim(
        key="k1", session_id="s1", step=1, call_index=0, tool="book", arguments="{}"
    )
    assert claimed.created and not again.created
    assert (await journal.arestart("k1")).attempts == 2
    assert [e.key for e in await journal.asame_calls("s1", "book", "{}")] == ["k1"]
    done = await journal.afinish("k1", ok=True, content="booked", output="booked, ref 7")
    assert done.status == "succeeded"
    got = await journal.aget("k1")
    assert got is not None and got.output == "booked, ref 7"
    assert await journal.aget("missing") is None
    message = Message.assistant("", tool_calls=[ToolCall(id="c1", name="book", arguments="{}")])
    assert await journal.adecision("s1", 1) is None
    assert await journal.arecord_decision("s1", 1, message) == message
    assert await journal.adecision("s1", 1) == message
    assert journal.decision("s1", 1) == message, "the twin and the sync method disagree"
