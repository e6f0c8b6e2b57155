"""Storage backends behind small interfaces.

The embedded default is one SQLite file (:class:`SQLiteDatabase`); the state, memory, trace and
journal stores extend it with their own migrations.
"""

from __future__ import annotations

from keel.errors import UsageError
from keel.settings import Settings
from keel.stores._migrations import Migration, MigrationSet
from keel.stores._postgres_journal import POSTGRES_JOURNAL_MIGRATIONS, PostgresToolJournal
from keel.stores._postgres_memory import PostgresMemoryStore

__all__ = [
    "CORE_MIGRATIONS",
    "JOURNAL_MIGRATIONS",
    "MEMORY_MIGRATIONS",
    "POSTGRES_JOURNAL_MIGRATIONS",
    "STATE_MIGRATIONS",
    "Migration",
    "MigrationSet",
    "PostgresMemoryStore",
    "PostgresStateBackend",
    "PostgresToolJournal",
    "RedisStateBackend",
    "SQLiteDatabase",
    "SQLiteMemoryStore",
    "SQLiteStateBackend",
    "SQLiteToolJournal",
    "open_database",
    "open_state_backend",
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
