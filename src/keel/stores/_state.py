"""Open a state backend from a URL (``sqlite:///``, ``postgresql://``, ``redis://``)."""

from __future__ import annotations

from keel._urls import parse_database_url
from keel.errors import ConfigError
from keel.state._backend import StateBackend

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

        assert parsed.path is not None
        return SQLiteStateBackend(parsed.path)
    if parsed.kind == "postgres":
        from keel.stores._postgres_state import PostgresStateBackend

        return PostgresStateBackend(parsed.url)
    from keel.stores._redis_state import RedisStateBackend

    return RedisStateBackend(parsed.url)
