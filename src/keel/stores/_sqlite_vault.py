"""The PII vault's store in the embedded SQLite database (component ``vault``).

Erased bytes must not linger in the file: every vault write runs with ``PRAGMA
secure_delete = ON`` (SQLite overwrites what it deletes, a forgotten key's and value's cells
and freed pages, with zeros), and ``forget`` and the end of a key rotation end with a
``TRUNCATE`` checkpoint, so the write-ahead log's older copies of those pages are gone from
disk too (unless a reader holds part of the log then: a warning says so).
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TypeVar

from keel.stores._dialect import SQLITE
from keel.stores._sql_vault import SQLVaultStore, vault_migrations
from keel.stores._sqlite import SQLiteDatabase

_T = TypeVar("_T")

__all__ = ["VAULT_MIGRATIONS", "SQLiteVaultStore"]

VAULT_MIGRATIONS = vault_migrations(SQLITE)

logger = logging.getLogger("keel.stores")


class SQLiteVaultStore(SQLVaultStore):
    """The vault store in a [`SQLiteDatabase`][] (applies its migrations)."""

    dialect = SQLITE

    def __init__(self, db: SQLiteDatabase) -> None:
        self.db = db
        db.setup(VAULT_MIGRATIONS)

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        with self.db.transaction() as conn:
            # Per connection, and the connection is this thread's for every store: it stays
            # on for them too (a few zeroed bytes per delete).
            conn.execute("PRAGMA secure_delete = ON")
            yield conn

    def _read(self) -> AbstractContextManager[sqlite3.Connection]:
        return self.db.translated()

    async def arun(self, call: Callable[[], _T]) -> _T:
        # Tens of microseconds on the local file, a reader never waits in WAL mode: inline,
        # unless the call would wait for the write lock (the database's own rule).
        return await self.db.acall(call)

    def drop_key_check(self, key_id: str) -> bool:
        dropped = super().drop_key_check(key_id)
        if dropped:
            # The last step of a rotation: the log's copies of keys wrapped by the old master
            # key go too (a leaked old key is why one rotates).
            self.purge_log()
        return dropped

    def forget(self, tenant_id: str, user_id: str) -> int:
        erased = super().forget(tenant_id, user_id)
        self.purge_log()
        return erased

    def purge_log(self) -> bool:
        """Copy the write-ahead log into the file and truncate it to nothing, so that no
        older copy of an erased page is left in it; False when a reader still holds part of
        the log (it stays until the next full checkpoint)."""
        with self.db.translated() as conn:
            busy, _, _ = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        if busy:
            logger.warning(
                "database %s: a reader held the write-ahead log; erased vault rows may stay in "
                "it until the next checkpoint",
                self.db.path,
            )
        return not busy
