"""The exactly-once tool journal in the embedded SQLite database (component ``journal``).

It lives in the same file as the checkpoints, so a crash loses neither or both. The intent is
an ``INSERT ... ON CONFLICT DO NOTHING`` in its own committed transaction: the tool runs only
after the claim is durable.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from typing import Any, TypeVar

from keel.errors import StoreError
from keel.messages import Message
from keel.stores._migrations import Migration, MigrationSet
from keel.stores._sqlite import SQLiteDatabase, translate_sqlite_error
from keel.tools._journal import JournalClaim, JournalEntry, ToolJournal, entry_from_row

__all__ = ["JOURNAL_MIGRATIONS", "SQLiteToolJournal"]

JOURNAL_MIGRATIONS = MigrationSet(
    "journal",
    (
        Migration(
            "tool-call intents and results, and each step's decided tool calls",
            """
            CREATE TABLE IF NOT EXISTS keel_tool_journal (
                key TEXT PRIMARY KEY,
                session_id TEXT NOT NULL,
                step INTEGER NOT NULL,
                call_index INTEGER NOT NULL,
                tool TEXT NOT NULL,
                arguments TEXT NOT NULL,
                status TEXT NOT NULL CHECK (status IN ('started', 'succeeded', 'failed')),
                ok INTEGER,
                content TEXT,
                output TEXT,
                attempts INTEGER NOT NULL DEFAULT 1,
                started_at REAL NOT NULL,
                finished_at REAL
            );
            CREATE INDEX IF NOT EXISTS keel_tool_journal_session
                ON keel_tool_journal (session_id, step, call_index);
            CREATE TABLE IF NOT EXISTS keel_tool_decisions (
                session_id TEXT NOT NULL,
                step INTEGER NOT NULL,
                message TEXT NOT NULL,
                created_at REAL NOT NULL,
                PRIMARY KEY (session_id, step)
            );
            """,
        ),
    ),
)

_COLUMNS = (
    "key, session_id, step, call_index, tool, arguments, status, ok, content, output, "
    "attempts, started_at, finished_at"
)


_T = TypeVar("_T")


class SQLiteToolJournal(ToolJournal):
    """The tool journal in a :class:`~keel.stores.SQLiteDatabase` (applies its migrations)."""

    def __init__(self, db: SQLiteDatabase) -> None:
        self.db = db
        db.setup(JOURNAL_MIGRATIONS)

    async def _run_twin(self, call: Callable[[], _T]) -> _T:
        return await self.db.arun(call)

    def claim(
        self,
        *,
        key: str,
        session_id: str,
        step: int,
        call_index: int,
        tool: str,
        arguments: str,
    ) -> JournalClaim:
        try:
            with self.db.transaction() as conn:
                cursor = conn.execute(
                    "INSERT INTO keel_tool_journal (key, session_id, step, call_index, tool, "
                    "arguments, status, attempts, started_at) "
                    "VALUES (?, ?, ?, ?, ?, ?, 'started', 1, ?) ON CONFLICT(key) DO NOTHING",
                    (key, session_id, step, call_index, tool, arguments, time.time()),
                )
                created = cursor.rowcount == 1
                entry = self._select(conn, key)
        except sqlite3.Error as exc:
            raise translate_sqlite_error(exc, self.db.path) from exc
        assert entry is not None  # inserted or already there, inside one transaction
        return JournalClaim(created=created, entry=entry)

    def restart(self, key: str) -> JournalEntry:
        return self._update(
            key, "UPDATE keel_tool_journal SET attempts = attempts + 1 WHERE key = ?"
        )

    def finish(self, key: str, *, ok: bool, content: str, output: str) -> JournalEntry:
        return self._update(
            key,
            "UPDATE keel_tool_journal SET status = ?, ok = ?, content = ?, output = ?, "
            "finished_at = ? WHERE key = ?",
            ("succeeded" if ok else "failed", int(ok), content, output, time.time()),
        )

    def get(self, key: str) -> JournalEntry | None:
        with self.db.translated() as conn:
            return self._select(conn, key)

    def entries(
        self, session_id: str | None = None, *, in_doubt_only: bool = False
    ) -> list[JournalEntry]:
        clauses: list[str] = []
        params: list[Any] = []
        if session_id is not None:
            clauses.append("session_id = ?")
            params.append(session_id)
        if in_doubt_only:
            clauses.append("status = 'started'")
        where = f" WHERE {' AND '.join(clauses)}" if clauses else ""
        with self.db.translated() as conn:
            cursor = conn.execute(
                f"SELECT {_COLUMNS} FROM keel_tool_journal{where} "
                "ORDER BY started_at, step, call_index",
                params,
            )
            names = [column[0] for column in cursor.description]
            rows = cursor.fetchall()
        return [entry_from_row(dict(zip(names, row, strict=True))) for row in rows]

    def same_calls(self, session_id: str, tool: str, arguments: str) -> list[JournalEntry]:
        # keel_tool_journal_session narrows to the session; a session has few entries.
        with self.db.translated() as conn:
            cursor = conn.execute(
                f"SELECT {_COLUMNS} FROM keel_tool_journal "
                "WHERE session_id = ? AND tool = ? AND arguments = ? "
                "ORDER BY started_at, step, call_index",
                (session_id, tool, arguments),
            )
            names = [column[0] for column in cursor.description]
            rows = cursor.fetchall()
        return [entry_from_row(dict(zip(names, row, strict=True))) for row in rows]

    def record_decision(self, session_id: str, step: int, message: Message) -> Message:
        try:
            with self.db.transaction() as conn:
                conn.execute(
                    "INSERT INTO keel_tool_decisions (session_id, step, message, created_at) "
                    "VALUES (?, ?, ?, ?) ON CONFLICT(session_id, step) DO NOTHING",
                    (session_id, step, message.model_dump_json(), time.time()),
                )
                row = conn.execute(
                    "SELECT message FROM keel_tool_decisions WHERE session_id = ? AND step = ?",
                    (session_id, step),
                ).fetchone()
        except sqlite3.Error as exc:
            raise translate_sqlite_error(exc, self.db.path) from exc
        return Message.model_validate_json(row[0])

    def decision(self, session_id: str, step: int) -> Message | None:
        with self.db.translated() as conn:
            row = conn.execute(
                "SELECT message FROM keel_tool_decisions WHERE session_id = ? AND step = ?",
                (session_id, step),
            ).fetchone()
        return None if row is None else Message.model_validate_json(row[0])

    def _update(self, key: str, sql: str, params: tuple[Any, ...] = ()) -> JournalEntry:
        try:
            with self.db.transaction() as conn:
                conn.execute(sql, (*params, key))
                entry = self._select(conn, key)
        except sqlite3.Error as exc:
            raise translate_sqlite_error(exc, self.db.path) from exc
        if entry is None:
            raise StoreError(f"no journal entry {key!r} in {self.db.path}")
        return entry

    @staticmethod
    def _select(conn: sqlite3.Connection, key: str) -> JournalEntry | None:
        cursor = conn.execute(f"SELECT {_COLUMNS} FROM keel_tool_journal WHERE key = ?", (key,))
        row = cursor.fetchone()
        if row is None:
            return None
        names = [column[0] for column in cursor.description]
        return entry_from_row(dict(zip(names, row, strict=True)))
