"""Database URLs, parsed by one set of rules everywhere keel opens a store.

``sqlite:///PATH`` (three slashes then the path: ``sqlite:///data/keel.db`` is relative,
``sqlite:////var/keel.db`` absolute), ``postgresql://...`` (also ``postgres://`` and
SQLAlchemy's ``postgresql+psycopg://``, handed to psycopg as ``postgresql://``), and
``redis://`` / ``rediss://`` / ``unix://`` for the Redis state backend
(``redis+cluster://HOST:PORT,HOST:PORT`` / ``rediss+cluster://`` for a Redis Cluster).

This module imports nothing from keel but its errors, so settings and stores can both use it.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from keel.errors import ConfigError

__all__ = ["DatabaseKind", "DatabaseURL", "parse_database_url"]

DatabaseKind = Literal["sqlite", "postgres", "redis"]
"""The engines a database URL can name."""

_SCHEMES: dict[str, DatabaseKind] = {
    "sqlite": "sqlite",
    "postgresql": "postgres",
    "postgres": "postgres",
    "postgresql+psycopg": "postgres",
    "redis": "redis",
    "rediss": "redis",
    "unix": "redis",
    "redis+cluster": "redis",
    "rediss+cluster": "redis",
}
_EXAMPLES: dict[DatabaseKind, str] = {
    "sqlite": "sqlite:///PATH",
    "postgres": "postgresql://...",
    "redis": "redis://HOST:PORT/DB",
}
# The user info ends at the authority's last "@" (as HTTP clients, redis-py and urllib read it):
# a password may hold an "@" of its own, not percent-encoded, and all of it is hidden.
_PASSWORD = re.compile(r"(://[^:/@]*):[^/?#]*@")


@dataclass(frozen=True)
class DatabaseURL:
    """A parsed database URL."""

    kind: DatabaseKind
    """Which engine: ``sqlite``, ``postgres`` or ``redis``."""
    url: str
    """The URL as the driver takes it (``postgresql://`` for every PostgreSQL spelling)."""
    path: Path | None = None
    """The SQLite file (``~`` expanded); None for a server."""

    @property
    def redacted(self) -> str:
        """The URL with any password replaced by ``***``, for messages and logs."""
        return redact_url(self.url)

    def __str__(self) -> str:
        return self.redacted


def redact_url(url: str) -> str:
    """``url`` with the password of its user info replaced by ``***``."""
    return _PASSWORD.sub(r"\1:***@", url)


def parse_database_url(
    url: str, *, kinds: Collection[str] = ("sqlite", "postgres", "redis")
) -> DatabaseURL:
    """Parse ``url`` into a [`DatabaseURL`][], accepting only the engines in ``kinds``.

    Raises:
        ConfigError: the URL is empty, has no or an unknown scheme, names an engine not in
            ``kinds``, or is ``sqlite:///`` without a path. The message never shows a password.
    """
    allowed = ", ".join(_EXAMPLES[kind] for kind in _EXAMPLES if kind in kinds)
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(f"empty database URL: use {allowed}")
    url = url.strip()
    scheme, separator, rest = url.partition("://")
    kind = _SCHEMES.get(scheme.lower()) if separator else None
    if kind is None:
        shown = f"{scheme}://" if separator else repr(redact_url(url))
        raise ConfigError(f"unsupported database URL {shown}: use {allowed}")
    if kind not in kinds:
        raise ConfigError(f"a {kind} URL ({scheme}://) cannot be used here: use {allowed}")
    if kind == "sqlite":
        if not rest.startswith("/"):
            raise ConfigError(
                f"sqlite URLs take three slashes and a path, e.g. sqlite:///data/keel.db "
                f"(got {url!r})"
            )
        path = rest[1:]
        if not path.strip():
            raise ConfigError("sqlite:/// needs a file path, e.g. sqlite:///data/keel.db")
        return DatabaseURL("sqlite", url, Path(path).expanduser())
    if kind == "postgres":
        # An empty rest is libpq's defaults (PGHOST, PGDATABASE, the local socket).
        return DatabaseURL("postgres", f"postgresql://{rest}")
    return DatabaseURL("redis", url)
