"""``SQLiteDatabase.arun``: store calls run inline on the event loop unless they would wait,
and a call never runs twice."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path

from keel.stores import SQLiteDatabase


def _database(tmp_path: Path) -> SQLiteDatabase:
    db = SQLiteDatabase(tmp_path / "inline.db", busy_timeout_ms=3000)
    with db.transaction() as conn:
        conn.execute("CREATE TABLE rows (name TEXT NOT NULL)")
    return db


def _names(db: SQLiteDatabase) -> list[str]:
    with db.translated() as conn:
        return [str(name) for (name,) in conn.execute("SELECT name FROM rows ORDER BY rowid")]


def _insert(db: SQLiteDatabase, name: str) -> str:
    with db.transaction() as conn:
        conn.execute("INSERT INTO rows (name) VALUES (?)", (name,))
    return name


def _holder(db: SQLiteDatabase) -> sqlite3.Connection:
    """Another connection (as another process would) holding the write lock."""
    conn = sqlite3.connect(db.path, isolation_level=None, check_same_thread=False)
    conn.execute("BEGIN IMMEDIATE")
    return conn


async def test_a_free_database_is_written_inline_on_the_loop_thread(tmp_path: Path) -> None:
    db = _database(tmp_path)
    threads: list[int] = []

    def write() -> str:
        threads.append(threading.get_ident())
        return _insert(db, "a")

    assert await db.acall(write) == "a"
    assert threads == [threading.get_ident()]
    assert _names(db) == ["a"]
    db.close()


async def test_a_write_that_would_wait_moves_off_the_loop(tmp_path: Path) -> None:
    db = _database(tmp_path)
    holder = _holder(db)
    ticks = 0
    released = asyncio.Event()

    async def tick() -> None:
        nonlocal ticks
        while not released.is_set():
            await asyncio.sleep(0.01)
            ticks += 1

    async def release_later() -> None:
        await asyncio.sleep(0.3)
        holder.execute("COMMIT")
        released.set()

    ticker = asyncio.create_task(tick())
    releaser = asyncio.create_task(release_later())
    # Inline, the busy wait would hold the loop: the release could never run.
    assert await db.acall(lambda: _insert(db, "b")) == "b"
    await releaser
    await ticker
    assert ticks >= 5, "the loop was blocked while the write waited for the lock"
    assert _names(db) == ["b"]
    holder.close()
    db.close()


async def test_a_call_that_already_wrote_is_never_run_again(tmp_path: Path) -> None:
    db = _database(tmp_path)
    runs = 0
    holder: sqlite3.Connection | None = None

    def two_transactions() -> None:
        nonlocal runs, holder
        runs += 1
        _insert(db, "first")
        if holder is None:
            # Another process takes the lock between this call's two transactions.
            holder = _holder(db)
            threading.Timer(0.2, holder.execute, args=("COMMIT",)).start()
        _insert(db, "second")

    await db.acall(two_transactions)
    assert runs == 1
    assert _names(db) == ["first", "second"]
    assert holder is not None
    holder.close()
    db.close()
