"""The exactly-once tool journal in PostgreSQL (component ``journal``).

For stateless keel processes over one database: the intent is an ``INSERT ... ON CONFLICT DO
NOTHING`` committed before the tool runs, so of two processes racing on the same call exactly
one claims it. psycopg is imported only when a journal is built.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any

from keel.stores._dialect import POSTGRES
from keel.stores._migrations import Migration, MigrationSet
from keel.stores._postgres import PostgresDatabase, apply_migrations
from keel.stores._sql_journal import AsyncSQLToolJournal

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


class PostgresToolJournal(AsyncSQLToolJournal):
    """The tool journal in PostgreSQL; applies its migrations on construction.

    Args:
        database: the :class:`~keel.stores.PostgresDatabase` to share (left open by
            :meth:`close`), or a ``postgresql://`` URL for a database of the journal's own.
        pool_size: with a URL, most connections its pool opens.
    """

    dialect = POSTGRES

    def __init__(self, database: PostgresDatabase | str, *, pool_size: int = 4) -> None:
        self._owns_database = isinstance(database, str)
        self.database = (
            PostgresDatabase(database, max_size=pool_size, timeout=10)
            if isinstance(database, str)
            else database
        )
        self.conninfo = self.database.url
        try:
            with self._write() as conn:
                apply_migrations(conn, POSTGRES_JOURNAL_MIGRATIONS)
        except BaseException:
            if self._owns_database:
                self.database.close()
            raise

    def _write(self) -> AbstractContextManager[Any]:
        return self.database.transaction()

    def _read(self) -> AbstractContextManager[Any]:
        # One statement, atomic in autocommit: no BEGIN and COMMIT round trips.
        return self.database.connection()

    def _awrite(self) -> AbstractAsyncContextManager[Any]:
        return self.database.atransaction()

    def _aread(self) -> AbstractAsyncContextManager[Any]:
        return self.database.aconnection()

    def close(self) -> None:
        """Close the database, unless it was passed in."""
        if self._owns_database:
            self.database.close()

    def __enter__(self) -> PostgresToolJournal:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
