"""The statements a turn runs on SQLite, counted through a real `Agent` (the ``keel bench turns``
workload: a question, one tool call, an answer): a ceiling, so that a statement added to every
turn shows here, where a timing on a shared machine would not.

A turn takes the session's lease and gives it back (one statement each, atomic on its own, no
BEGIN and COMMIT around it), reads the head, and writes three checkpoints (before each of the
two model calls, and the commit), each in one transaction with the trace written so far riding
in it (no savepoint around it: a trace that fails rolls the transaction back and the checkpoint
is written again alone). A turn keel has just opened under an id it made looks up no journalled
decision: no run before it can have recorded one.
"""

from __future__ import annotations

import contextlib
import json
import re
import sqlite3
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from keel._bridge import run_sync
from keel.messages import Message
from keel.runtime import Agent
from keel.settings import load_settings
from keel.stores import SQLiteDatabase
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import tool
from tests.runtime.test_turn_commits import _agent, _database

CEILING = 24
"""Statements of one turn of the workload (35 before the lease's BEGIN/COMMIT, the riders'
savepoints and the fresh turn's decision look-up went)."""


@contextlib.contextmanager
def _statements(db: SQLiteDatabase) -> Iterator[list[str]]:
    """Every statement ``db``'s connections run inside the block, as SQLite traces them."""
    seen: list[str] = []
    connection = db.connection
    traced: list[sqlite3.Connection] = []

    def tracing() -> sqlite3.Connection:
        conn = connection()
        if conn not in traced:
            conn.set_trace_callback(lambda sql: seen.append(" ".join(sql.split())))
            traced.append(conn)
        return conn

    db.connection = tracing  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        del db.connection
        for conn in traced:
            conn.set_trace_callback(None)


def _turn(agent: Agent, text: str) -> list[str]:
    with _statements(_database(agent)) as seen:
        reply = agent.handle_sync("s1", "u1", text)
    assert reply.status == "completed", reply
    return seen


def test_a_turn_runs_at_most_its_ceiling_of_statements(tmp_path: Path) -> None:
    agent = _agent(tmp_path)
    try:
        agent.handle_sync("s1", "u1", "warm up")
        seen = _turn(agent, "find the record")
        assert len(seen) <= CEILING, "\n".join(seen)
        # Three write transactions, the checkpoints'; the lease's writes are one statement.
        assert sum(sql == "BEGIN IMMEDIATE" for sql in seen) == 3, seen
        assert sum(sql == "COMMIT" for sql in seen) == 3, seen
        assert not [sql for sql in seen if sql.startswith(("SAVEPOINT", "RELEASE"))], seen
        leases = [sql for sql in seen if "keel_state_locks" in sql]
        # Given back in place (an UPDATE of its row): the next turn takes the same row back.
        assert [sql.split()[0] for sql in leases] == ["INSERT", "UPDATE"], seen
        assert not [sql for sql in seen if "keel_tool_decisions" in sql], seen
    finally:
        agent.close()


def test_a_resumed_turn_still_finds_the_decision_its_crashed_run_journalled(
    tmp_path: Path,
) -> None:
    """The look-up a fresh turn skips is the one a resumed turn needs: a process died while
    its booking ran; the next process finishes the turn from the decision journalled for that
    step (the booking, now in doubt), never from a new answer of the model."""
    effects: list[str] = []

    class _Crash(BaseException):
        pass

    @tool(side_effect=True, idempotent=False)
    def book(what: str) -> str:
        """Book it.

        Args:
            what: What to book.
        """
        effects.append(what)
        raise _Crash

    def books(call: ScriptedCall) -> Message | str:
        if call.messages[-1].role == "tool":
            return "Booked."
        return ScriptedModel.tool_call("book", json.dumps({"what": "CARD7"}))

    def opened(model: ScriptedModel) -> Agent:
        return Agent.open(
            None,
            settings=load_settings(data_dir=tmp_path, embedder="hashing:64"),
            model=model,
            system_prompt="You book things.",
            tools=[book],
            memory=False,
        )

    first = opened(ScriptedModel(books))
    try:
        with pytest.raises(_Crash):
            first.handle_sync("s1", "u1", "book CARD7")
    finally:
        first.close()
    # The next process's model would answer without booking, were it asked.
    fresh = ScriptedModel(lambda call: "Nothing to book.")
    second = opened(fresh)
    try:
        reply = run_sync(second.resume("s1", "u1"))
    finally:
        second.close()
    assert reply is not None
    assert reply.status == "tool_in_doubt", reply
    assert effects == ["CARD7"]
    assert fresh.calls == []


_LITERALS = re.compile(r"'(?:[^']|'')*'|\b\d+(?:\.\d+)?(?:e[+-]?\d+)?\b")


def _shapes(statements: list[str]) -> list[str]:
    """The statements with their values left out (SQLite traces them with values bound)."""
    return [_LITERALS.sub("?", sql) for sql in statements]


def test_a_turn_runs_the_same_statements_however_long_the_session(tmp_path: Path) -> None:
    """A turn's statements are the same on the session's 2nd turn and its 25th (seventy
    checkpoints on): none is added, or run once more, per message or turn the session holds."""
    agent = _agent(tmp_path)
    try:
        agent.handle_sync("s1", "u1", "warm up")
        early = _shapes(_turn(agent, "find the record 1"))
        for number in range(2, 24):
            agent.handle_sync("s1", "u1", f"find the record {number}")
        late = _shapes(_turn(agent, "find the record 24"))
        assert late == early
    finally:
        agent.close()


def _wal_pages(database: Path) -> list[str]:
    """The b-tree (table or index) of each page the write-ahead log holds, one per frame."""
    wal = (database.parent / (database.name + "-wal")).read_bytes()
    page_size = struct.unpack(">I", wal[8:12])[0]
    pages = [
        struct.unpack(">I", wal[offset : offset + 4])[0]
        for offset in range(32, len(wal) - page_size - 23, 24 + page_size)
    ]
    reader = sqlite3.connect(database)
    try:
        owner = dict(reader.execute("SELECT pageno, name FROM dbstat"))
    except sqlite3.OperationalError:
        pytest.skip("this SQLite has no dbstat table")
    finally:
        reader.close()
    return [str(owner.get(page, "?")) for page in pages]


def test_a_turn_gives_its_lease_back_in_place_writing_one_page_each_way(
    tmp_path: Path,
) -> None:
    """The lease is given back by expiring its row, not deleting it: the next turn takes the
    same row back, so neither writes the key's index (two log pages a turn less)."""
    agent = _agent(tmp_path)
    try:
        agent.handle_sync("s1", "u1", "warm up")
        database = Path(_database(agent).path)
        checkpointer = sqlite3.connect(database)
        checkpointer.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        checkpointer.close()
        for number in range(3):
            agent.handle_sync("s1", "u1", f"find the record {number}")
        pages = _wal_pages(database)
        assert pages.count("keel_state_locks") == 6, pages  # its row, taken and given back
        assert "sqlite_autoindex_keel_state_locks_1" not in pages, pages
        reader = sqlite3.connect(database)
        rows = reader.execute("SELECT owner, expires_at FROM keel_state_locks").fetchall()
        reader.close()
        assert len(rows) == 1 and rows[0][1] == 0, rows  # given back: held by no one
    finally:
        agent.close()


def test_a_turn_writes_the_trace_counter_indexes_once_and_one_index_of_steps(
    tmp_path: Path,
) -> None:
    """A running run's totals move with each batch of its steps without touching the counter
    indexes (they hold the runs that have ended: the turn's last write enters its run there,
    one page each a turn); a run's steps go in one index, their key's."""
    agent = _agent(tmp_path)
    try:
        agent.handle_sync("s1", "u1", "warm up")
        database = Path(_database(agent).path)
        reader = sqlite3.connect(database)
        reader.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        indexes = reader.execute(
            "SELECT name, tbl_name, sql FROM sqlite_master WHERE type = 'index'"
        ).fetchall()
        reader.close()
        counters = [
            name
            for name, table, sql in indexes
            if table == "trace_runs" and sql and ("step_count" in sql or "model_calls" in sql)
        ]
        of_steps = [name for name, table, _ in indexes if table == "trace_steps"]
        for number in range(3):
            agent.handle_sync("s1", "u1", f"find the record {number}")
        pages = _wal_pages(database)
        assert len(counters) == 2, indexes
        assert [pages.count(name) for name in counters] == [3, 3], pages
        assert of_steps == ["sqlite_autoindex_trace_steps_1"], indexes
    finally:
        agent.close()
