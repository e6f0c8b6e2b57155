"""Riders on SQLite (``keel.stores._sql_plan.Rider``) and writes of one statement: what a turn's
trace and its session's lease ride on, without a savepoint or BEGIN and COMMIT each time."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from keel.errors import UsageError
from keel.stores import SQLiteDatabase
from keel.stores._sql_plan import Plan, Rider, Statement, riding


def _database(tmp_path: Path) -> SQLiteDatabase:
    db = SQLiteDatabase(tmp_path / "riders.db", busy_timeout_ms=3000)
    with db.transaction() as conn:
        conn.execute("CREATE TABLE rows (name TEXT NOT NULL UNIQUE)")
    return db


def _names(db: SQLiteDatabase) -> list[str]:
    with db.translated() as conn:
        return [str(name) for (name,) in conn.execute("SELECT name FROM rows ORDER BY rowid")]


def _insert(*names: str) -> Plan[None]:
    for name in names:
        yield Statement("INSERT INTO rows (name) VALUES (?)", (name,))


def test_a_failing_rider_never_undoes_the_write_it_rode(tmp_path: Path) -> None:
    db = _database(tmp_path)
    good = Rider(db, lambda: _insert("trace"))
    # Its first row is written, its second one fails: neither may stay.
    bad = Rider(db, lambda: _insert("half", "write"))
    with riding(good), riding(bad):
        db.run(lambda: _insert("write"))
    assert _names(db) == ["write", "trace"]
    assert good.ran and good.error is None
    assert not bad.ran and isinstance(bad.error, sqlite3.IntegrityError)
    db.close()


def test_a_failing_rider_in_a_joined_transaction_leaves_the_rest_of_it(tmp_path: Path) -> None:
    db = _database(tmp_path)
    bad = Rider(db, lambda: _insert("half", "outer"))
    with db.transaction() as conn:
        conn.execute("INSERT INTO rows (name) VALUES ('outer')")
        with riding(bad):
            db.run(lambda: _insert("write"))
    assert _names(db) == ["outer", "write"]
    assert not bad.ran and isinstance(bad.error, sqlite3.IntegrityError)
    db.close()


def test_a_write_of_one_statement_refuses_a_second(tmp_path: Path) -> None:
    db = _database(tmp_path)
    with pytest.raises(UsageError):
        db.run(lambda: _insert("a", "b"), write="statement")
    # The first statement was its own transaction: it stays, as a write of one would.
    assert _names(db) == ["a"]
    db.close()


async def test_a_write_of_one_statement_that_would_wait_moves_off_the_loop_once(
    tmp_path: Path,
) -> None:
    db = _database(tmp_path)
    # Another connection (as another process would) holds the write lock.
    holder = sqlite3.connect(db.path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    loop_thread = threading.get_ident()
    built: list[bool] = []

    def plan() -> Plan[None]:
        on_loop = threading.get_ident() == loop_thread
        built.append(on_loop)
        if not on_loop:
            holder.execute("COMMIT")  # the lock is given up once the call waits in a thread
        return _insert("once")

    await db.arun(plan, write="statement")
    # Tried inline, met the lock without writing anything, then run once in a worker thread.
    assert built == [True, False]
    assert _names(db) == ["once"]
    holder.close()
    db.close()
