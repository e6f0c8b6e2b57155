"""What every PostgreSQL store shares: the ``keel_schema`` table and one migration routine.

All components (state, memory, journal, traces) record their schema version in the same table
and serialize their setups on the same transaction-level advisory lock, which is safe behind a
connection pooler (it is released at commit, never held by a pooled session).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from keel.errors import SchemaVersionError
from keel.stores._migrations import MigrationSet

__all__ = ["SCHEMA_LOCK_KEY", "apply_migrations"]

SCHEMA_LOCK_KEY = 0x6B65656C  # "keel"
"""The advisory lock every keel setup takes on PostgreSQL."""

_SCHEMA_TABLE = (
    "CREATE TABLE IF NOT EXISTS keel_schema (component TEXT PRIMARY KEY, "
    "version INTEGER NOT NULL, applied_at DOUBLE PRECISION NOT NULL)"
)


def apply_migrations(target: Any, migrations: MigrationSet) -> int:
    """Bring ``migrations.component`` up to date inside the caller's open transaction.

    ``target`` is a psycopg connection or cursor. Returns the version applied before.

    Raises:
        SchemaVersionError: the database holds a newer schema than this code knows.
    """
    target.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK_KEY,))
    target.execute(_SCHEMA_TABLE)
    row = target.execute(
        "SELECT version FROM keel_schema WHERE component = %s", (migrations.component,)
    ).fetchone()
    applied = 0 if row is None else int(row["version"] if isinstance(row, Mapping) else row[0])
    if applied > migrations.version:
        raise SchemaVersionError(
            f"PostgreSQL has {migrations.component} schema version {applied}, newer than this "
            f"keel knows ({migrations.version}); upgrade keel"
        )
    for migration in migrations.migrations[applied:]:
        if isinstance(migration.apply, str):
            # Bytes: no parameters, so a literal % in DDL is never taken for a placeholder.
            target.execute(migration.apply.encode())
        else:
            migration.apply(target)
    if applied < migrations.version:
        target.execute(
            "INSERT INTO keel_schema (component, version, applied_at) VALUES (%s, %s, %s) "
            "ON CONFLICT (component) DO UPDATE SET version = EXCLUDED.version, "
            "applied_at = EXCLUDED.applied_at",
            (migrations.component, migrations.version, time.time()),
        )
    return applied
