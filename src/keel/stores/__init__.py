"""Storage backends behind small interfaces.

The embedded default is one SQLite file (:class:`SQLiteDatabase`); the state, memory, trace and
journal stores extend it with their own migrations.
"""

from __future__ import annotations

from keel.errors import UsageError
from keel.settings import Settings
from keel.stores._migrations import Migration, MigrationSet
from keel.stores._postgres_memory import PostgresMemoryStore
from keel.stores._sqlite import CORE_MIGRATIONS, SQLiteDatabase, translate_sqlite_error
from keel.stores._sqlite_memory import MEMORY_MIGRATIONS, SQLiteMemoryStore

__all__ = [
    "CORE_MIGRATIONS",
    "MEMORY_MIGRATIONS",
    "Migration",
    "MigrationSet",
    "PostgresMemoryStore",
    "SQLiteDatabase",
    "SQLiteMemoryStore",
    "open_database",
    "translate_sqlite_error",
]


def open_database(settings: Settings) -> SQLiteDatabase:
    """The embedded database the settings name (no migrations applied yet).

    Raises:
        UsageError: the settings name a server database; open it with its own store.
    """
    path = settings.sqlite_path
    if path is None:
        raise UsageError(
            f"{settings.database_url.split('://')[0]} databases are opened by their store "
            "classes, not as the embedded SQLite database"
        )
    return SQLiteDatabase(path, busy_timeout_ms=settings.busy_timeout_ms)
