"""Open a state backend from a URL (``sqlite:///``, ``postgresql://``, ``redis://``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from keel._urls import parse_database_url
from keel.errors import ConfigError
from keel.state._backend import StateBackend
from keel.stores._postgres import PostgresDatabase
from keel.stores._sqlite import SQLiteDatabase

__all__ = ["open_state_backend"]


def open_state_backend(url: str) -> StateBackend:
    """The state backend a URL names.

    ``sqlite:///path/to/keel.db`` (a file: several connections share it), ``postgresql://...`` /
    ``postgres://...``, ``redis://...`` / ``rediss://...``.

    Raises:
        ConfigError: an unknown scheme.
        BackendUnavailableError: the server cannot be reached or its driver is not installed.
    """
    try:
        parsed = parse_database_url(url)
    except ConfigError as exc:
        raise ConfigError(f"unknown state backend URL: {exc}") from None
    if parsed.kind == "sqlite":
        from keel.stores._sqlite_state import SQLiteStateBackend

        class _OwnSQLiteState(SQLiteStateBackend):
            def close(self) -> None:  # the database opened here is the backend's own
                self.db.close()

            async def aclose(self) -> None:
                self.db.close()

        assert parsed.path is not None
        sqlite = SQLiteDatabase(parsed.path)
        return _opened(sqlite, lambda: _OwnSQLiteState(sqlite))
    if parsed.kind == "postgres":
        from keel.stores._postgres_state import PostgresStateBackend

        class _OwnPostgresState(PostgresStateBackend):
            def close(self) -> None:  # the database opened here is the backend's own
                self.database.close()

            async def aclose(self) -> None:
                await self.database.aclose()

        postgres = PostgresDatabase(parsed.url)
        return _opened(postgres, lambda: _OwnPostgresState(postgres))
    from keel.stores._redis_state import RedisStateBackend

    return RedisStateBackend(parsed.url)


def _opened(database: Any, backend: Callable[[], StateBackend]) -> StateBackend:
    """``backend()``, or ``database`` closed if it cannot be built (e.g. a failed migration)."""
    try:
        return backend()
    except BaseException:
        database.close()
        raise
