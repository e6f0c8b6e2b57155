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
from keel.stores._migrations import Migration, MigrationSet
from keel.stores._open import (
    Backends,
    open_database,
    open_state_backend,
    open_vault,
    pii_key_from_settings,
)
from keel.stores._postgres import PostgresDatabase, translate_postgres_error
from keel.stores._postgres_approvals import POSTGRES_APPROVAL_MIGRATIONS, PostgresApprovalStore
from keel.stores._postgres_journal import POSTGRES_JOURNAL_MIGRATIONS, PostgresToolJournal
from keel.stores._postgres_memory import POSTGRES_MEMORY_MIGRATIONS, PostgresMemoryStore
from keel.stores._postgres_vault import POSTGRES_VAULT_MIGRATIONS, PostgresVaultStore
from keel.stores._redis_state import RedisStateBackend
from keel.stores._sql_state import STATE_MIGRATIONS, SQLStateBackend
from keel.stores._sqlite import CORE_MIGRATIONS, SQLiteDatabase, translate_sqlite_error
from keel.stores._sqlite_approvals import APPROVAL_MIGRATIONS, SQLiteApprovalStore
from keel.stores._sqlite_journal import JOURNAL_MIGRATIONS, SQLiteToolJournal
from keel.stores._sqlite_memory import MEMORY_MIGRATIONS, SQLiteMemoryStore
from keel.stores._sqlite_traces import TRACE_MIGRATIONS, SQLiteTraceStore
from keel.stores._sqlite_vault import VAULT_MIGRATIONS, SQLiteVaultStore

if TYPE_CHECKING:
    # Imports psycopg at module level: loaded on first use so that keel.stores works
    # without the postgres extra.
    from keel.stores._postgres_traces import POSTGRES_TRACE_MIGRATIONS, PostgresTraceStore

__all__ = [
    "APPROVAL_MIGRATIONS",
    "CORE_MIGRATIONS",
    "JOURNAL_MIGRATIONS",
    "MEMORY_MIGRATIONS",
    "POSTGRES_APPROVAL_MIGRATIONS",
    "POSTGRES_JOURNAL_MIGRATIONS",
    "POSTGRES_MEMORY_MIGRATIONS",
    "POSTGRES_TRACE_MIGRATIONS",
    "POSTGRES_VAULT_MIGRATIONS",
    "STATE_MIGRATIONS",
    "TRACE_MIGRATIONS",
    "VAULT_MIGRATIONS",
    "Backends",
    "DatabaseURL",
    "Migration",
    "MigrationSet",
    "PostgresApprovalStore",
    "PostgresDatabase",
    "PostgresMemoryStore",
    "PostgresToolJournal",
    "PostgresTraceStore",
    "PostgresVaultStore",
    "RedisStateBackend",
    "SQLStateBackend",
    "SQLiteApprovalStore",
    "SQLiteDatabase",
    "SQLiteMemoryStore",
    "SQLiteToolJournal",
    "SQLiteTraceStore",
    "SQLiteVaultStore",
    "open_database",
    "open_state_backend",
    "open_vault",
    "parse_database_url",
    "pii_key_from_settings",
    "translate_postgres_error",
    "translate_sqlite_error",
]


def __getattr__(name: str) -> Any:
    if name in ("PostgresTraceStore", "POSTGRES_TRACE_MIGRATIONS"):
        # Imports psycopg at module level: the postgres extra, loaded only when asked for.
        from keel.stores import _postgres_traces

        return getattr(_postgres_traces, name)
    raise AttributeError(f"module 'keel.stores' has no attribute {name!r}")
