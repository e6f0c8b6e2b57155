"""Opening the trace store that keel's settings name."""

from __future__ import annotations

from keel.errors import ConfigError
from keel.settings import Settings, load_settings
from keel.tracing._store import TraceStore

__all__ = ["open_trace_store"]


def open_trace_store(settings: Settings | None = None, *, setup: bool = True) -> TraceStore:
    """The trace store of ``settings.database_url``: the embedded SQLite file (default) or
    PostgreSQL (``postgresql://...``). Tables are created or migrated unless ``setup=False``.

    Raises:
        ConfigError: the URL names a database keel cannot hold traces in.
        StoreError: the database cannot be opened or migrated.
    """
    settings = settings or load_settings()
    url = settings.database_url
    store: TraceStore
    if settings.sqlite_path is not None:
        from keel.stores._sqlite import SQLiteDatabase
        from keel.stores._sqlite_traces import SQLiteTraceStore

        database = SQLiteDatabase(settings.sqlite_path, busy_timeout_ms=settings.busy_timeout_ms)
        store = SQLiteTraceStore(database, close_database=True)
    elif url.startswith(("postgresql://", "postgres://", "postgresql+psycopg://")):
        from keel.stores._postgres_traces import PostgresTraceStore

        store = PostgresTraceStore(url.replace("postgresql+psycopg://", "postgresql://", 1))
    else:
        raise ConfigError(
            f"cannot keep traces in {url.split('://')[0]!r} databases; "
            "use sqlite:///PATH or postgresql://..."
        )
    if setup:
        try:
            store.setup()
        except BaseException:
            store.close()
            raise
    return store
