"""The stores an agent runs on: [`Backends`][], opened by
[`Backends.open`][] (the one composition root, in
`keel.stores._open`) and re-exported here where the runtime has always offered it, and
`open_at_edge`, the one way the edges that take a URL or settings (``Agent.open``,
``keel serve``'s ``build_service``) open them."""

from __future__ import annotations

from keel.errors import ConfigError
from keel.privacy import PIIMasker
from keel.settings import Settings, load_settings
from keel.stores import Backends

__all__ = ["Backends", "open_at_edge"]


def open_at_edge(
    database: str | Settings | None,
    settings: Settings | None,
    *,
    redis_url: str | None,
    memory: bool,
    privacy: PIIMasker | None,
) -> tuple[Backends, Settings]:
    """The stores an edge's arguments name, and the settings they were opened with.

    ``database`` is a URL, the settings themselves, or None (``settings.database_url``). The
    settings are read here, once, only when the caller gave none; everything below gets them
    handed down. The other arguments are [`Backends.open`][]'s.

    Raises:
        ConfigError: settings given twice, ``database`` of another type, invalid settings, or
            a URL keel cannot open.
        BackendUnavailableError: a server cannot be reached or its driver is not installed.
        StoreError: a database cannot be opened or migrated.
    """
    if isinstance(database, Settings):
        if settings is not None:
            raise ConfigError("settings given twice: positionally and as settings=")
        settings = database
    elif database is not None and not isinstance(database, str):
        raise ConfigError(f"a database URL or Settings is needed, not {type(database).__name__}")
    settings = settings or load_settings()
    backends = Backends.open(
        settings if database is None else database,
        settings=settings,
        redis_url=redis_url,
        memory=memory,
        privacy=privacy,
    )
    return backends, settings
