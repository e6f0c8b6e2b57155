"""The stores an agent runs on: :class:`~keel.stores.Backends`, opened by
:meth:`Backends.open <keel.stores.Backends.open>` (the one composition root, in
:mod:`keel.stores._open`), re-exported here where the runtime has always offered it, and
:func:`edge_settings`, how the edges that open them (``Agent.open``, ``keel serve``'s
``build_service``) take a URL or settings."""

from __future__ import annotations

from keel.errors import ConfigError
from keel.settings import Settings, load_settings
from keel.stores import Backends

__all__ = ["Backends", "edge_settings"]


def edge_settings(
    database: str | Settings | None, settings: Settings | None
) -> tuple[str | Settings, Settings]:
    """What to open and the settings to open it with, from an edge's two arguments.

    ``database`` is a URL, the settings themselves, or None (``settings.database_url``). The
    settings are read here, once, only when the caller gave none: everything below gets them
    handed down.

    Raises:
        ConfigError: settings given twice, or ``database`` of another type; invalid settings.
    """
    if isinstance(database, Settings):
        if settings is not None:
            raise ConfigError("settings given twice: positionally and as settings=")
        return database, database
    if database is not None and not isinstance(database, str):
        raise ConfigError(f"a database URL or Settings is needed, not {type(database).__name__}")
    settings = settings or load_settings()
    return (settings if database is None else database), settings
