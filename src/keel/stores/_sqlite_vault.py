"""What the PII vault's store does on SQLite beyond the shared SQL: erasing for good.

Erased bytes must not linger in the file: every vault write runs with ``PRAGMA
secure_delete = ON`` (SQLite overwrites what it deletes, a forgotten key's and value's cells
and freed pages, with zeros), and ``forget`` and the end of a key rotation end with a
``TRUNCATE`` checkpoint, so the write-ahead log's older copies of those pages are gone from
disk too (unless a reader holds part of the log then: a warning says so). PostgreSQL has
neither: its deleted tuples go at the next vacuum, which no statement of a store can force.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from keel.stores._sql_plan import Plan, Statement
from keel.stores._sql_vault import SQLVaultStore
from keel.stores._sqlite import SQLiteDatabase

__all__ = ["SQLiteVaultStore"]

_T = TypeVar("_T")

logger = logging.getLogger("keel.stores")


class SQLiteVaultStore(SQLVaultStore):
    """The vault store in a [`SQLiteDatabase`][keel.stores.SQLiteDatabase]: a
    [`SQLVaultStore`][keel.stores.SQLVaultStore] that zeroes what it deletes and purges the
    write-ahead log after an erasure (applies its migrations)."""

    def __init__(self, db: SQLiteDatabase) -> None:
        super().__init__(db)
        self._path = db.path

    def _run_write(self, plan: Callable[[], Plan[_T]]) -> _T:
        return self.db.run(lambda: _securely(plan()))

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

    def erase_user(self, tenant_id: str, user_id: str) -> dict[str, int]:
        erased = super().erase_user(tenant_id, user_id)
        self.purge_log()
        return erased

    def purge_log(self) -> bool:
        """Copy the write-ahead log into the file and truncate it to nothing, so that no
        older copy of an erased page is left in it; False when a reader still holds part of
        the log (it stays until the next full checkpoint)."""
        # Outside a transaction (a checkpoint cannot run inside one): a read, to the database.
        busy = self.db.run(_checkpoint, write=False)
        if busy:
            logger.warning(
                "database %s: a reader held the write-ahead log; erased vault rows may stay in "
                "it until the next checkpoint",
                self._path,
            )
        return not busy


def _securely(plan: Plan[_T]) -> Plan[_T]:
    """``plan``, after turning secure delete on. The setting is the connection's, and the
    connection is this thread's for every store: it stays on for them too (a few zeroed bytes
    per delete)."""
    yield Statement("PRAGMA secure_delete = ON")
    return (yield from plan)


def _checkpoint() -> Plan[bool]:
    """Checkpoint the log and truncate it; True when a reader kept part of it."""
    busy, _, _ = (yield Statement("PRAGMA wal_checkpoint(TRUNCATE)")).rows[0]
    return bool(busy)
