"""The PII vault's store in PostgreSQL (component ``vault``).

For stateless keel processes over one database: ``add_value`` locks the user's key row
(``FOR UPDATE``), so two processes adding values for one user count numbers one after the
other and a ``forget`` waits for a write in flight (or that write sees the key gone).
psycopg is imported only when a store is built.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from keel.stores._dialect import POSTGRES
from keel.stores._postgres import PostgresDatabase, apply_migrations
from keel.stores._sql_vault import SQLVaultStore, vault_migrations

__all__ = ["POSTGRES_VAULT_MIGRATIONS", "PostgresVaultStore"]

POSTGRES_VAULT_MIGRATIONS = vault_migrations(POSTGRES)


class PostgresVaultStore(SQLVaultStore):
    """The vault store in PostgreSQL; applies its migrations on construction.

    Args:
        database: the [`PostgresDatabase`][] to share (the caller closes it).
    """

    dialect = POSTGRES

    def __init__(self, database: PostgresDatabase) -> None:
        self.database = database
        with self._write() as conn:
            apply_migrations(conn, POSTGRES_VAULT_MIGRATIONS)

    def _write(self) -> AbstractContextManager[Any]:
        return self.database.transaction()

    def _read(self) -> AbstractContextManager[Any]:
        # One statement, atomic in autocommit.
        return self.database.connection()
