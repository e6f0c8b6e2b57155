"""The exactly-once tool journal in PostgreSQL (component ``journal``).

For stateless keel processes over one database: the intent is an ``INSERT ... ON CONFLICT DO
NOTHING`` committed before the tool runs, so of two processes racing on the same call exactly
one claims it. psycopg is imported only when a journal is built.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from keel.errors import StoreError
from keel.messages import Message
from keel.stores._migrations import Migration, MigrationSet
from keel.stores._postgres import PostgresDatabase, apply_migrations
from keel.tools._journal import JournalClaim, JournalEntry, ToolJournal, entry_from_row

if TYPE_CHECKING:
    import psycopg

__all__ = ["POSTGRES_JOURNAL_MIGRATIONS", "PostgresToolJournal"]

POSTGRES_JOURNAL_MIGRATIONS = MigrationSet(
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
                ok BOOLEAN,
                content TEXT,
                output TEXT,
                attempts INTEGER NOT NULL DEFAULT 1,
                started_at DOUBLE PRECISION NOT NULL,
                finished_at DOUBLE PRECISION
            );
            CREATE INDEX IF NOT EXISTS keel_tool_journal_session
                ON keel_tool_journal (session_id, step, call_index);
            CREATE TABLE IF NOT EXISTS keel_tool_decisions (
                session_id TEXT NOT NULL,
                step INTEGER NOT NULL,
                message TEXT NOT NULL,
                created_at DOUBLE PRECISION NOT NULL,
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


class PostgresToolJournal(ToolJournal):
    """The tool journal in PostgreSQL; applies its migrations on construction.

    Args:
        database: the :class:`~keel.stores.PostgresDatabase` to share (left open by
            :meth:`close`), or a ``postgresql://`` URL for a database of the journal's own.
        pool_size: with a URL, most connections its pool opens.
    """

    def __init__(self, database: PostgresDatabase | str, *, pool_size: int = 4) -> None:
        self._owns_database = isinstance(database, str)
        self.database = (
            PostgresDatabase(database, max_size=pool_size, timeout=10)
            if isinstance(database, str)
            else database
        )
        self.conninfo = self.database.url
        try:
            self._setup()
        except BaseException:
            if self._owns_database:
                self.database.close()
            raise

    @contextmanager
    def _transaction(self) -> Iterator[psycopg.Cursor[dict[str, Any]]]:
        """One transaction's cursor, rows as dicts (what ``entry_from_row`` reads)."""
        from psycopg.rows import dict_row

        with self.database.transaction() as conn, conn.cursor(row_factory=dict_row) as cur:
            yield cur

    def _setup(self) -> None:
        migrations = POSTGRES_JOURNAL_MIGRATIONS
        with self._transaction() as cur:
            apply_migrations(cur, migrations)

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
        with self._transaction() as cur:
            cur.execute(
                "INSERT INTO keel_tool_journal (key, session_id, step, call_index, tool, "
                "arguments, status, attempts, started_at) "
                "VALUES (%s, %s, %s, %s, %s, %s, 'started', 1, %s) ON CONFLICT (key) DO NOTHING",
                (key, session_id, step, call_index, tool, arguments, time.time()),
            )
            created = cur.rowcount == 1
            entry = self._select(cur, key)
        if entry is None:  # pragma: no cover - inserted or present in the same transaction
            raise StoreError(f"journal entry {key!r} vanished")
        return JournalClaim(created=created, entry=entry)

    def restart(self, key: str) -> JournalEntry:
        return self._update(
            key, "UPDATE keel_tool_journal SET attempts = attempts + 1 WHERE key = %s", ()
        )

    def finish(self, key: str, *, ok: bool, content: str, output: str) -> JournalEntry:
        return self._update(
            key,
            "UPDATE keel_tool_journal SET status = %s, ok = %s, content = %s, output = %s, "
            "finished_at = %s WHERE key = %s",
            ("succeeded" if ok else "failed", ok, content, output, time.time()),
        )

    def get(self, key: str) -> JournalEntry | None:
        with self._transaction() as cur:
            return self._select(cur, key)

    def entries(
        self, session_id: str | None = None, *, in_doubt_only: bool = False
    ) -> list[JournalEntry]:
        clauses: list[str] = []
        params: list[Any] = []
        if session_id is not None:
            clauses.append("session_id = %s")
            params.append(session_id)
        if in_doubt_only:
            clauses.append("status = 'started'")
        where = f" WHERE {' AND '.join(clauses)}" if clauses else ""
        with self._transaction() as cur:
            rows = cur.execute(
                f"SELECT {_COLUMNS} FROM keel_tool_journal{where} "
                "ORDER BY started_at, step, call_index",
                params,
            ).fetchall()
        return [entry_from_row(row) for row in rows]

    def same_calls(self, session_id: str, tool: str, arguments: str) -> list[JournalEntry]:
        # keel_tool_journal_session narrows to the session; a session has few entries.
        with self._transaction() as cur:
            rows = cur.execute(
                f"SELECT {_COLUMNS} FROM keel_tool_journal "
                "WHERE session_id = %s AND tool = %s AND arguments = %s "
                "ORDER BY started_at, step, call_index",
                (session_id, tool, arguments),
            ).fetchall()
        return [entry_from_row(row) for row in rows]

    def record_decision(self, session_id: str, step: int, message: Message) -> Message:
        with self._transaction() as cur:
            cur.execute(
                "INSERT INTO keel_tool_decisions (session_id, step, message, created_at) "
                "VALUES (%s, %s, %s, %s) ON CONFLICT (session_id, step) DO NOTHING",
                (session_id, step, message.model_dump_json(), time.time()),
            )
            row = cur.execute(
                "SELECT message FROM keel_tool_decisions WHERE session_id = %s AND step = %s",
                (session_id, step),
            ).fetchone()
        assert row is not None
        return Message.model_validate_json(row["message"])

    def decision(self, session_id: str, step: int) -> Message | None:
        with self._transaction() as cur:
            row = cur.execute(
                "SELECT message FROM keel_tool_decisions WHERE session_id = %s AND step = %s",
                (session_id, step),
            ).fetchone()
        return None if row is None else Message.model_validate_json(row["message"])

    def close(self) -> None:
        """Close the database, unless it was passed in."""
        if self._owns_database:
            self.database.close()

    def __enter__(self) -> PostgresToolJournal:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _update(self, key: str, sql: str, params: tuple[Any, ...]) -> JournalEntry:
        with self._transaction() as cur:
            cur.execute(sql, (*params, key))
            entry = self._select(cur, key)
        if entry is None:
            raise StoreError(f"no journal entry {key!r}")
        return entry

    @staticmethod
    def _select(cur: psycopg.Cursor[dict[str, Any]], key: str) -> JournalEntry | None:
        row = cur.execute(
            f"SELECT {_COLUMNS} FROM keel_tool_journal WHERE key = %s",
            (key,),
        ).fetchone()
        return None if row is None else entry_from_row(row)
