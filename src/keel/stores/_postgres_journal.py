"""The exactly-once tool journal in PostgreSQL (component ``journal``).

For stateless keel processes over one database: the intent is an ``INSERT ... ON CONFLICT DO
NOTHING`` committed before the tool runs, so of two processes racing on the same call exactly
one claims it. psycopg is imported only when a journal is built.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any

from keel.stores._dialect import POSTGRES
from keel.stores._postgres import PostgresDatabase, apply_migrations
from keel.stores._sql_journal import AsyncSQLToolJournal, journal_migrations

__all__ = ["POSTGRES_JOURNAL_MIGRATIONS", "PostgresToolJournal"]

POSTGRES_JOURNAL_MIGRATIONS = journal_migrations(POSTGRES)


class PostgresToolJournal(AsyncSQLToolJournal):
    """The tool journal in PostgreSQL; applies its migrations on construction.

    Args:
        database: the [`PostgresDatabase`][] to share (the caller closes it).
    """

    dialect = POSTGRES

    def __init__(self, database: PostgresDatabase) -> None:
        self.database = database
        with self._write() as conn:
            apply_migrations(conn, POSTGRES_JOURNAL_MIGRATIONS)

    def _write(self) -> AbstractContextManager[Any]:
        return self.database.transaction()

    def _read(self) -> AbstractContextManager[Any]:
        # One statement, atomic in autocommit: no BEGIN and COMMIT round trips.
        return self.database.connection()

    def _awrite(self) -> AbstractAsyncContextManager[Any]:
        return self.database.atransaction()

    def _aread(self) -> AbstractAsyncContextManager[Any]:
        return self.database.aconnection()
