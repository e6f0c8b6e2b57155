"""Storage backends behind small interfaces.

The embedded default is one SQLite file ([`SQLiteDatabase`][]); the state, memory, trace,
journal, PII vault and approvals stores extend it with their own migrations. On a server,
[`PostgresDatabase`][] is the same for PostgreSQL: one connection pool that every
PostgreSQL store can share. The store classes take such a database object;
[`Backends.open`][] is where they are opened from a URL.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from keel._urls import DatabaseURL, parse_database_url
from keel.stores._erasure import ErasureReport, UserErasure, aerase_user, erase_user
from keel.stores._migrations import Migration, MigrationSet
from keel.stores._open import (
    STORE_NAMES,
    Backends,
    MemoryOptions,
    StoreName,
    pii_key_from_settings,
)
from keel.stores._postgres import PostgresDatabase, translate_postgres_error
from keel.stores._redis_state import RedisStateBackend
from keel.stores._sql_approvals import SQLApprovalStore, approval_migrations
from keel.stores._sql_journal import SQLToolJournal, journal_migrations
from keel.stores._sql_state import STATE_MIGRATIONS, SQLStateBackend
from keel.stores._sql_traces import SQLTraceStore, trace_migrations
from keel.stores._sql_vault import SQLVaultStore, vault_migrations
from keel.stores._sqlite import CORE_MIGRATIONS, SQLiteDatabase, translate_sqlite_error
from keel.stores._sqlite_vault import SQLiteVaultStore

if TYPE_CHECKING:
    # The memory stores import numpy, the trace store psycopg, at module level: loaded on
    # first use, so that an agent with memory off never loads numpy (nor OpenBLAS's threads)
    # and keel.stores works without the postgres extra.
    from keel.stores._postgres_memory import PostgresMemoryStore
    from keel.stores._postgres_traces import PostgresTraceStore
    from keel.stores._sqlite_memory import SQLiteMemoryStore

__all__ = [
    "CORE_MIGRATIONS",
    "STATE_MIGRATIONS",
    "STORE_NAMES",
    "Backends",
    "DatabaseURL",
    "ErasureReport",
    "MemoryOptions",
    "Migration",
    "MigrationSet",
    "PostgresDatabase",
    "PostgresMemoryStore",
    "PostgresTraceStore",
    "RedisStateBackend",
    "SQLApprovalStore",
    "SQLStateBackend",
    "SQLToolJournal",
    "SQLTraceStore",
    "SQLVaultStore",
    "SQLiteDatabase",
    "SQLiteMemoryStore",
    "SQLiteVaultStore",
    "StoreName",
    "UserErasure",
    "aerase_user",
    "approval_migrations",
    "erase_user",
    "journal_migrations",
    "parse_database_url",
    "pii_key_from_settings",
    "trace_migrations",
    "translate_postgres_error",
    "translate_sqlite_error",
    "vault_migrations",
]


def __getattr__(name: str) -> Any:
    if name == "PostgresTraceStore":
        # Imports psycopg at module level: the postgres extra, loaded only when asked for.
        from keel.stores import _postgres_traces

        return getattr(_postgres_traces, name)
    if name == "SQLiteMemoryStore":
        # Imports numpy: loaded with the first memory, never for an agent with memory off.
        from keel.stores import _sqlite_memory

        return _sqlite_memory.SQLiteMemoryStore
    if name == "PostgresMemoryStore":
        # Imports numpy: loaded with the first memory, never for an agent with memory off.
        from keel.stores import _postgres_memory

        return _postgres_memory.PostgresMemoryStore
    raise AttributeError(f"module 'keel.stores' has no attribute {name!r}")
