"""The composition root's stores: state, tool journal, traces and memory from one database URL.

``sqlite:///PATH``: one SQLite file (one :class:`~keel.stores.SQLiteDatabase`) holds all four.
``postgresql://...``: the four PostgreSQL stores on that database, sharing one
:class:`~keel.stores.PostgresDatabase` (one connection pool). Either way a Redis URL moves
state (checkpoints and session leases) to Redis, while the journal, traces and memory stay on
the SQL database: they are queried (``keel runs``, ``keel tools in-doubt``, retrieval), which
Redis is not built for.

:func:`open_backends` opens everything or nothing: a store that fails to open closes the ones
opened before it. :meth:`Backends.close` / :meth:`Backends.aclose` release them in reverse
order, memory first so that its outbox worker stops before its database goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from keel._urls import DatabaseURL, parse_database_url
from keel.errors import ConfigError
from keel.privacy import PIIMasker
from keel.state import AgentState, StateStore
from keel.tools import ToolJournal
from keel.tracing import TraceStore

if TYPE_CHECKING:
    from keel.memory import Memory
    from keel.settings import Settings
    from keel.stores import PostgresDatabase, SQLiteDatabase

__all__ = ["Backends", "open_backends"]

_Closer = tuple[Callable[[], None], Callable[[], Awaitable[None]] | None]
"""How to release one thing: sync, and natively async where the client is bound to a loop."""
_Own = Callable[[Callable[[], None], Callable[[], Awaitable[None]] | None], None]


_READINESS_PROBE = "keel-readiness-probe"
"""A state key no session has (theirs are ``tenant/session``): reading it checks that the
state store answers."""


@dataclass
class Backends:
    """What an agent stores into, opened from one database URL (and optionally Redis).

    Close it with :meth:`close` or :meth:`aclose` (an :class:`~keel.runtime.Agent` built by
    :meth:`~keel.runtime.Agent.open` does this in its own ``close``).
    """

    database: DatabaseURL
    """The SQL database: journal, traces and memory (and state without Redis)."""
    redis: DatabaseURL | None
    """The Redis that holds state, if any."""
    state: StateStore[AgentState]
    """Session checkpoints and leases."""
    journal: ToolJournal
    """The exactly-once journal of side-effecting tool calls."""
    traces: TraceStore
    """Run traces."""
    memory: Memory | None
    """Long-term memory (its outbox indexed in the background), or None when off."""
    sql: SQLiteDatabase | PostgresDatabase
    """The SQL database the journal, traces and memory live in (more tables may join them:
    ``keel serve``'s API keys)."""
    _closers: list[_Closer] = field(default_factory=list, repr=False)

    async def aready(self, connections: int = 1) -> None:
        """Wait until every store answers: the SQL database with ``connections`` pooled
        connections open (PostgreSQL), and the state store (one read).

        Raises:
            BackendUnavailableError: a server does not answer.
            StoreError: a database cannot be read.
        """
        await self.sql.aping(connections)
        if self.redis is not None:
            # The journal, traces and memory are on the SQL database; state is not.
            await self.state.apeek(_READINESS_PROBE)

    def close(self) -> None:
        """Stop memory's outbox worker and release every connection, newest first (idempotent)."""
        errors: list[BaseException] = []
        while self._closers:
            sync, _ = self._closers.pop()
            try:
                sync()
            except Exception as exc:  # close the rest, then report the first failure
                errors.append(exc)
        if errors:
            raise errors[0]

    async def aclose(self) -> None:
        """Async twin of :meth:`close`: async clients are closed on the running event loop."""
        errors: list[BaseException] = []
        while self._closers:
            sync, asynchronous = self._closers.pop()
            try:
                if asynchronous is not None:
                    await asynchronous()
                else:
                    await asyncio.to_thread(sync)
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]


def open_backends(
    database: str,
    *,
    redis_url: str | None = None,
    memory: bool = True,
    masker: PIIMasker | None,
    settings: Settings,
) -> Backends:
    """Open state, journal, traces and memory on ``database`` (state on ``redis_url`` if set).

    Args:
        database: ``sqlite:///PATH`` or ``postgresql://...``.
        redis_url: ``redis://...``: state on Redis, the rest on ``database``.
        memory: open long-term memory (embedder from ``settings.embedder``).
        masker: the privacy policy memory masks with (the agent's; None: off).
        settings: the SQLite busy timeout, the PostgreSQL pool size and the embedder.

    Raises:
        ConfigError: a URL keel cannot open (a Redis URL as the database, an unknown scheme).
        BackendUnavailableError: a server cannot be reached or its driver is not installed.
        StoreError: a database cannot be opened or migrated.
    """
    parsed = parse_database_url(database, kinds=("sqlite", "postgres"))
    try:
        redis = None if not redis_url else parse_database_url(redis_url, kinds=("redis",))
    except ConfigError as exc:
        raise ConfigError(f"the Redis URL: {exc}") from None
    closers: list[_Closer] = []

    def own(sync: Callable[[], None], asynchronous: Callable[[], Awaitable[None]] | None) -> None:
        closers.append((sync, asynchronous))

    try:
        if parsed.kind == "sqlite":
            backends = _open_sqlite(parsed, redis, memory, masker, settings, own)
        else:
            backends = _open_postgres(parsed, redis, memory, masker, settings, own)
    except BaseException:
        while closers:
            with contextlib.suppress(Exception):
                closers.pop()[0]()
        raise
    backends._closers = closers
    return backends


def _state_on_redis(redis: DatabaseURL, own: _Own) -> StateStore[AgentState]:
    from keel.stores import RedisStateBackend

    backend = RedisStateBackend(redis.url)
    own(backend.close, backend.aclose)
    return StateStore(backend, AgentState)


def _open_sqlite(
    parsed: DatabaseURL,
    redis: DatabaseURL | None,
    memory: bool,
    masker: PIIMasker | None,
    settings: Settings,
    own: _Own,
) -> Backends:
    from keel.stores import (
        SQLiteDatabase,
        SQLiteMemoryStore,
        SQLiteStateBackend,
        SQLiteToolJournal,
        SQLiteTraceStore,
    )

    assert parsed.path is not None
    database = SQLiteDatabase(parsed.path, busy_timeout_ms=settings.busy_timeout_ms)
    own(database.close, None)
    traces = SQLiteTraceStore(database)
    traces.setup()
    state = (
        _state_on_redis(redis, own)
        if redis is not None
        else StateStore(SQLiteStateBackend(database), AgentState)
    )
    journal = SQLiteToolJournal(database)
    long_term = _memory(SQLiteMemoryStore(database), masker, settings, own) if memory else None
    return Backends(parsed, redis, state, journal, traces, long_term, database)


def _open_postgres(
    parsed: DatabaseURL,
    redis: DatabaseURL | None,
    memory: bool,
    masker: PIIMasker | None,
    settings: Settings,
    own: _Own,
) -> Backends:
    from keel.stores import (
        PostgresDatabase,
        PostgresMemoryStore,
        PostgresStateBackend,
        PostgresToolJournal,
        PostgresTraceStore,
    )

    # One pool for the four stores; closed last (closers pop from the end), after memory's
    # outbox worker stopped writing to it.
    database = PostgresDatabase(parsed.url, max_size=settings.postgres_pool_size)
    own(database.close, database.aclose)
    traces = PostgresTraceStore(database)
    traces.setup()
    journal = PostgresToolJournal(database)
    state = (
        _state_on_redis(redis, own)
        if redis is not None
        else StateStore(PostgresStateBackend(database), AgentState)
    )
    long_term = _memory(PostgresMemoryStore(database), masker, settings, own) if memory else None
    return Backends(parsed, redis, state, journal, traces, long_term, database)


def _memory(store: object, masker: PIIMasker | None, settings: Settings, own: _Own) -> Memory:
    from keel.memory import Memory, MemoryStore, embedder_from_settings

    assert isinstance(store, MemoryStore)
    long_term = Memory(
        store, embedder=embedder_from_settings(settings), background=True, masker=masker
    )
    # Memory.close stops the outbox worker and closes the store; it runs first (closers pop
    # from the end), before the database it writes to is closed.
    own(long_term.close, None)
    return long_term
