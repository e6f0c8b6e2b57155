"""Opening the trace store that keel's settings name."""

from __future__ import annotations

from keel._urls import parse_database_url
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
    try:
        parsed = parse_database_url(settings.database_url, kinds=("sqlite", "postgres"))
    except ConfigError as exc:
        raise ConfigError(f"cannot keep traces there: {exc}") from None
    store: TraceStore
    if parsed.path is not None:
        # keel.stores implements tracing's interfaces: it cannot be imported at the top.
        from keel.stores import SQLiteDatabase, SQLiteTraceStore

        class _OwnSQLiteTraces(SQLiteTraceStore):
            def close(self) -> None:  # the database opened here is the store's own
                self.db.close()

        store = _OwnSQLiteTraces(
            SQLiteDatabase(parsed.path, busy_timeout_ms=settings.busy_timeout_ms)
        )
    else:
        # keel.stores implements tracing's interfaces: it cannot be imported at the top.
        from keel.stores import PostgresDatabase, PostgresTraceStore

        class _OwnPostgresTraces(PostgresTraceStore):
            def close(self) -> None:  # the database opened here is the store's own
                self.database.close()

        database = PostgresDatabase(parsed.url, max_size=4, timeout=10.0)
        try:
            store = _OwnPostgresTraces(database)
        except BaseException:
            database.close()
            raise
    if setup:
        try:
            store.setup()
        except BaseException:
            store.close()
            raise
    return store
