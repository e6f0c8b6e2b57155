"""The exactly-once tool journal in the embedded SQLite database (component ``journal``).

It lives in the same file as the checkpoints, so a crash loses neither or both. The intent is
an ``INSERT ... ON CONFLICT DO NOTHING`` in its own committed transaction: the tool runs only
after the claim is durable.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TypeVar

from keel.stores._dialect import SQLITE
from keel.stores._sql_journal import SQLToolJournal, journal_migrations
from keel.stores._sqlite import SQLiteDatabase

__all__ = ["JOURNAL_MIGRATIONS", "SQLiteToolJournal"]

JOURNAL_MIGRATIONS = journal_migrations(SQLITE)

_T = TypeVar("_T")


class SQLiteToolJournal(SQLToolJournal):
    """The tool journal in a [`SQLiteDatabase`][] (applies its migrations)."""

    dialect = SQLITE

    def __init__(self, db: SQLiteDatabase) -> None:
        self.db = db
        db.setup(JOURNAL_MIGRATIONS)

    async def _run_twin(self, call: Callable[[], _T]) -> _T:
        return await self.db.acall(call)

    def _write(self) -> AbstractContextManager[sqlite3.Connection]:
        return self.db.transaction()

    def _read(self) -> AbstractContextManager[sqlite3.Connection]:
        return self.db.translated()

    def _where(self) -> str:
        return f" in {self.db.path}"
