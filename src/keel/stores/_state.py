"""Open a state backend from a URL (``sqlite:///``, ``postgresql://``, ``redis://``)."""

from __future__ import annotations

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
    scheme = url.split("://", 1)[0].lower()
    if scheme == "sqlite":
        from keel.stores._sqlite_state import SQLiteStateBackend

        return SQLiteStateBackend(url.removeprefix("sqlite:///"))
    if scheme in ("postgresql", "postgres"):
        from keel.stores._postgres_state import PostgresStateBackend

        return PostgresStateBackend(url)
    if scheme in ("redis", "rediss", "unix"):
        from keel.stores._redis_state import RedisStateBackend

        return RedisStateBackend(url)
    raise ConfigError(
        f"unknown state backend URL scheme {scheme!r}: use sqlite:///, postgresql:// or redis://"
    )
