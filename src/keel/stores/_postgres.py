"""What every PostgreSQL store shares: one [`PostgresDatabase`][] (its connection pool and
error translation), the ``keel_schema`` table and one migration routine.

All components (state, memory, journal, traces) record their schema version in the same table
and serialize their setups on the same transaction-level advisory lock, which is safe behind a
connection pooler (it is released at commit, never held by a pooled session).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass
from functools import cache
from typing import Any, TypeVar

from keel._bridge import run_blocking
from keel.errors import (
    BackendUnavailableError,
    ConfigError,
    DatabaseReadOnlyError,
    SchemaVersionError,
    StorageFullError,
    StoreError,
)
from keel.stores._availability import Availability
from keel.stores._dialect import POSTGRES
from keel.stores._migrations import MigrationSet
from keel.stores._sql_plan import Plan, Write, arun_plan, run_plan

__all__ = [
    "SCHEMA_LOCK_KEY",
    "BinaryVector",
    "PostgresDatabase",
    "apply_migrations",
    "translate_postgres_error",
]

_T = TypeVar("_T")

SCHEMA_LOCK_KEY = 0x6B65656C  # "keel"
"""The advisory lock every keel setup takes on PostgreSQL."""


@dataclass(frozen=True, slots=True)
class BinaryVector:
    """A vector parameter psycopg sends in pgvector's binary wire format (``%b::vector``: the
    cast tells the server the parameter's type): a third of the text format's bytes, and
    0.01 ms to build instead of 0.16 ms for 384 dimensions."""

    values: Any


def vector_to_binary(vector: Any) -> bytes:
    """A vector in pgvector's binary wire format: int16 dimension, int16 unused, then
    big-endian float4s."""
    # Imported here: only memory sends vectors, and an agent with memory off never loads numpy.
    import numpy as np

    values = np.asarray(vector, dtype=">f4").reshape(-1)
    return int(values.shape[0]).to_bytes(2, "big") + b"\0\0" + values.tobytes()


@cache
def _register_wire_types() -> None:
    """Teach psycopg (once, for this process) to send a [`BinaryVector`][] in binary. A
    connection copies psycopg's adapters when it opens, so this runs before any pool of
    keel's opens one: registered later (by the first memory store), the connections a pool
    already held could not send a vector, and a fresh process's first embeddings failed."""
    import psycopg
    from psycopg.adapt import Dumper
    from psycopg.pq import Format

    class VectorDumper(Dumper):
        format = Format.BINARY

        def dump(self, obj: Any) -> bytes:
            return vector_to_binary(obj.values)

    psycopg.adapters.register_dumper(BinaryVector, VectorDumper)


_DISK_FULL = "53100"
_READ_ONLY_TRANSACTION = "25006"
# Autocommit: a store opens a transaction only where it needs one. No server-side prepared
# statements: they do not survive a transaction-mode pooler, and a prepared statement's
# generic plan cannot see a query vector (it sorted a whole memory scope by distance instead
# of walking the HNSW graph).
_CONNECTION_OPTIONS: dict[str, Any] = {"autocommit": True, "prepare_threshold": None}

DEFAULT_CONNECT_TIMEOUT_S = 5
"""Seconds one connection attempt may take when the URL sets none (``?connect_timeout=N``, as
libpq reads it): libpq's own default waits for ever on a host that does not answer."""

_SCHEMA_TABLE = (
    "CREATE TABLE IF NOT EXISTS keel_schema (component TEXT PRIMARY KEY, "
    "version INTEGER NOT NULL, applied_at DOUBLE PRECISION NOT NULL)"
)


def apply_migrations(target: Any, migrations: MigrationSet) -> int:
    """Bring ``migrations.component`` up to date inside the caller's open transaction.

    ``target`` is a psycopg connection or cursor. Returns the version applied before.

    Raises:
        SchemaVersionError: the database holds a newer schema than this code knows.
    """
    target.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK_KEY,))
    target.execute(_SCHEMA_TABLE)
    row = target.execute(
        "SELECT version FROM keel_schema WHERE component = %s", (migrations.component,)
    ).fetchone()
    applied = 0 if row is None else int(row["version"] if isinstance(row, Mapping) else row[0])
    if applied > migrations.version:
        raise SchemaVersionError(
            f"PostgreSQL has {migrations.component} schema version {applied}, newer than this "
            f"keel knows ({migrations.version}); upgrade keel"
        )
    for migration in migrations.migrations[applied:]:
        if isinstance(migration.apply, str):
            # Bytes: no parameters, so a literal % in DDL is never taken for a placeholder.
            target.execute(migration.apply.encode())
        else:
            migration.apply(target)
    if applied < migrations.version:
        target.execute(
            "INSERT INTO keel_schema (component, version, applied_at) VALUES (%s, %s, %s) "
            "ON CONFLICT (component) DO UPDATE SET version = EXCLUDED.version, "
            "applied_at = EXCLUDED.applied_at",
            (migrations.component, migrations.version, time.time()),
        )
    return applied


_QUOTED = re.compile(r'"([^"]*)"')
"""A quoted part of libpq's reason."""
_SEPARATORS = frozenset("=[]@:/?&,")


def _unquoted(reason: str) -> str:
    """libpq's ``reason`` with what it quotes left out, but a separator (``"="``)."""
    return _QUOTED.sub(lambda quoted: quoted[0] if quoted[1] in _SEPARATORS else '"..."', reason)


def _connection_options(url: str) -> dict[str, Any]:
    """The options every connection is made with: keel's, and a connection timeout unless the
    URL sets its own."""
    import psycopg
    from psycopg.conninfo import conninfo_to_dict

    try:
        given = conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        # A URL libpq cannot read is the caller's to fix, not a server that is down. libpq's
        # reason quotes the whole URI, password and all: only what it found wrong is kept.
        reason = " ".join(str(exc).split()).partition(" in URI:")[0]
        # It quotes the part it could not read, too: a password with a percent sign of its own
        # ("pa%ss") or a NUL is quoted whole. Only a quoted separator ("=") is kept.
        reason = _unquoted(reason)
        raise ConfigError(f"not a PostgreSQL URL libpq can read ({reason})") from None
    for port in str(given.get("port", "")).split(","):
        if port and not (port.isdigit() and 0 < int(port) < 65536):
            raise ConfigError(f"PostgreSQL URL {_location(url)}: port {port!r} is not 1-65535")
    if "connect_timeout" in given:
        return dict(_CONNECTION_OPTIONS)
    return {**_CONNECTION_OPTIONS, "connect_timeout": DEFAULT_CONNECT_TIMEOUT_S}


def translate_postgres_error(exc: Exception, url: str) -> StoreError:
    """The keel error for a psycopg error (raise it ``from exc``); the SQLSTATE decides.

    psycopg files connection failures, pool timeouts, serialization failures, deadlocks and
    lock timeouts (SQLSTATE classes 08, 40, 55, 57) under ``OperationalError``: all of them
    read as the server being unavailable, the caller's cue to retry.
    """
    import psycopg

    where = _location(url)
    sqlstate = getattr(exc, "sqlstate", None)
    if sqlstate == _DISK_FULL:
        return StorageFullError(f"PostgreSQL at {where} is out of space: {exc}")
    if sqlstate == _READ_ONLY_TRANSACTION:
        return DatabaseReadOnlyError(
            f"PostgreSQL at {where} is read-only (a standby, or default_transaction_read_only "
            f"is on): {exc}"
        )
    if isinstance(exc, psycopg.OperationalError):
        return BackendUnavailableError(f"PostgreSQL at {where} is unavailable: {exc}", store=_STORE)
    return StoreError(f"PostgreSQL at {where}: {exc}")


_STORE = "postgresql"


def _went_away(exc: Exception) -> bool:
    """Whether ``exc`` says the server went away (refused, cut, shut down, restarting, or no
    connection within the pool's timeout), rather than that one statement failed."""
    import psycopg
    from psycopg_pool import PoolClosed, PoolTimeout

    if isinstance(exc, PoolTimeout):
        return True
    if isinstance(exc, PoolClosed):  # a pool replaced after an outage: the server is back
        return False
    if not isinstance(exc, psycopg.OperationalError):
        return False
    sqlstate = getattr(exc, "sqlstate", None)
    return sqlstate is None or sqlstate.startswith(("08", "57P"))


def _location(url: str) -> str:
    """Host, port and database of ``url``: no user, password or query parameters. A libpq
    ``key=value`` string (which psycopg takes too) is named by those keys alone."""
    if "://" in url:
        return url.rpartition("@")[2].partition("?")[0]
    from psycopg.conninfo import conninfo_to_dict

    try:
        given = conninfo_to_dict(url)
    except Exception:  # unreadable: nothing of it is safe to quote
        return "(a connection string libpq cannot read)"
    return f"{given.get('host', '')}:{given.get('port', '')}/{given.get('dbname', '')}"


def _on(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop`` is the running loop of this thread."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


class PostgresDatabase:
    """A PostgreSQL database shared by keel's server stores: one pool, one error translation.
    Stores run their SQL through it: [`run`][] / [`arun`][] a plan, [`migrate`][] their schema.

    Every connection runs in autocommit with server-side prepared statements off, so the pool
    is safe behind a transaction-mode pooler (PgBouncer) and no store's statements leave
    state on a connection another store picks up next. A store that needs several statements
    atomic takes [`transaction`][]; a row factory is chosen per cursor; a session setting
    one store needs is set with ``SET LOCAL`` inside its transaction. Native async calls get
    an ``AsyncConnectionPool`` bound to their event loop (one at a time: a call from another
    loop replaces it).

    The pool opens on first use (or [`open`][]), after one connection made directly: a
    server that refuses it, a wrong password or a database that does not exist fail at once
    with the server's reason, and a host that does not answer within the connection timeout
    (``?connect_timeout=N`` in the URL, default `DEFAULT_CONNECT_TIMEOUT_S`) fails then,
    instead of the pool retrying in the background until ``timeout``. psycopg and psycopg-pool
    are imported only when a database is built.

    Args:
        url: a ``postgresql://`` connection URL (libpq's parameters, ``connect_timeout`` among
            them, in its query string).
        min_size: connections each pool keeps open.
        max_size: most connections each pool opens.
        timeout: seconds to wait for a free connection (and for the pool's first ones, once
            the server has answered).

    Raises:
        BackendUnavailableError: psycopg or psycopg-pool is not installed.
    """

    dialect = POSTGRES

    def __init__(
        self, url: str, *, min_size: int = 1, max_size: int = 10, timeout: float = 30.0
    ) -> None:
        try:
            from psycopg_pool import ConnectionPool
        except ImportError as exc:  # pragma: no cover - the extra is installed in tests
            raise BackendUnavailableError(
                "psycopg and psycopg-pool are not installed (the 'postgres' extra)"
            ) from exc
        _register_wire_types()
        self.url = url
        self.min_size = min_size
        self.max_size = max_size
        self.timeout = timeout
        self._options = _connection_options(url)
        self._pool: ConnectionPool[Any] = ConnectionPool(
            url,
            min_size=min_size,
            max_size=max_size,
            timeout=timeout,
            kwargs=self._options,
            open=False,
        )
        self._open_lock = threading.Lock()
        self._opened = False
        self._closed = False
        self._apool: Any = None
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._aopening: asyncio.Future[None] | None = None
        self.availability = Availability(_STORE, _location(url))
        """Whether the server answered lately: while it is down, calls fail at once."""
        self._stale: set[str] = set()

    def open(self) -> None:
        """Open the pool and wait for its first connection (idempotent).

        Raises:
            BackendUnavailableError: no connection within ``timeout``, or the database was
                closed.
        """
        with self._open_lock:
            if self._opened:
                return
            if self._closed:
                raise BackendUnavailableError(f"PostgreSQL at {_location(self.url)} was closed")
            try:
                self._first_connection()
                self._pool.open(wait=True, timeout=self.timeout)
            except BackendUnavailableError:
                self._pool.close()
                raise
            except Exception as exc:  # psycopg errors, or the pool's own PoolTimeout
                self._pool.close()
                raise BackendUnavailableError(
                    f"cannot connect to PostgreSQL at {_location(self.url)}: {exc}"
                ) from exc
            self._opened = True

    def _first_connection(self) -> None:
        """One connection made and closed: the server's reason, in one line, when it fails."""
        import psycopg

        try:
            psycopg.connect(self.url, **self._options).close()
        except psycopg.Error as exc:
            raise self._unreachable(exc) from exc

    async def _afirst_connection(self) -> None:
        import psycopg

        try:
            await (await psycopg.AsyncConnection.connect(self.url, **self._options)).close()
        except psycopg.Error as exc:
            raise self._unreachable(exc) from exc

    def _unreachable(self, exc: Exception) -> BackendUnavailableError:
        # libpq's message spans lines (a hint on a tab-indented second line): one line here.
        reason = " ".join(str(exc).split())
        return BackendUnavailableError(
            f"cannot connect to PostgreSQL at {_location(self.url)}: {reason}", store=_STORE
        )

    def _failure(self, exc: Exception) -> StoreError:
        """The keel error for a psycopg error; one that says the server went away marks it
        down, so that the next calls fail at once instead of waiting for the pool."""
        error = translate_postgres_error(exc, self.url)
        error.store = _STORE
        if _went_away(exc):
            self.availability.failed(" ".join(str(exc).split()))
            # Both pools may hold connections that died with the server: each checks its
            # own once the server answers again.
            self._stale = {"sync", "async"}
        return error

    def _check_pool(self) -> None:
        """After an outage, the sync pool's connections checked once (the dead ones dropped)."""
        if "sync" in self._stale and self._opened:
            self._stale.discard("sync")
            with suppress(Exception):  # the pool replaces on its own what fails later
                self._pool.check()

    async def _acheck_pool(self) -> None:
        """Async twin of [`_check_pool`][], for the running loop's pool."""
        opening = self._aopening
        ours = self._apool is not None and self._aloop is asyncio.get_running_loop()
        if "async" in self._stale and ours and opening is not None and opening.done():
            self._stale.discard("async")
            with suppress(Exception):  # as in _check_pool
                await self._apool.check()

    def _recover(self) -> None:
        """While the server is down: try it with one new connection (not the pool's, which
        would wait for its timeout); when it answers, calls go to the pools again."""
        try:
            self._first_connection()
        except BackendUnavailableError as exc:
            self.availability.failed(str(exc), tried=True)
            raise
        if self.availability.answered():
            self._new_pool()

    async def _arecover(self) -> None:
        """Async twin of [`_recover`][], for the running loop's pool."""
        try:
            await self._afirst_connection()
        except BackendUnavailableError as exc:
            self.availability.failed(str(exc), tried=True)
            raise
        if self.availability.answered() and self._aloop is asyncio.get_running_loop():
            await self._anew_pool()

    # After an outage in which the server refused new connections, a pool waits out its own
    # reconnection back-off (doubling from 1 s) before it grows again, and holds every caller
    # meanwhile: a fresh pool serves at once instead.

    def _sync_pool(self) -> Any:
        """A sync pool of this database's sizes and options, not opened yet (as ``__init__``
        makes the first one)."""
        from psycopg_pool import ConnectionPool

        return ConnectionPool(
            self.url,
            min_size=self.min_size,
            max_size=self.max_size,
            timeout=self.timeout,
            kwargs=self._options,
            open=False,
        )

    def _new_pool(self) -> None:
        """The sync pool replaced by a fresh one, opened at the next call."""
        with self._open_lock:
            old, self._opened = self._pool, False
            self._pool = self._sync_pool()
        self._stale.discard("sync")
        with suppress(Exception):  # its callers get PoolClosed: 503, and send again
            old.close(timeout=0)

    async def _anew_pool(self) -> None:
        """The running loop's pool replaced by a fresh one, opened at the next call."""
        old, self._apool = self._apool, None
        self._stale.discard("async")
        if old is not None:
            with suppress(Exception):  # as in _new_pool
                await old.close(timeout=0)

    @contextmanager
    def connection(self) -> Iterator[Any]:
        """A pooled connection in autocommit: each statement is its own transaction."""
        import psycopg

        if self.availability.must_try():  # raises while down, but once an interval
            self._recover()
        if self._stale:
            self._check_pool()
        self.open()
        try:
            with self._pool.connection() as conn:
                yield conn
        except psycopg.Error as exc:
            raise self._failure(exc) from exc

    @contextmanager
    def transaction(self) -> Iterator[Any]:
        """A pooled connection inside one transaction: committed at the end, rolled back on
        an exception."""
        with self.connection() as conn, conn.transaction():
            yield conn

    async def _async_pool(self) -> Any:
        loop = asyncio.get_running_loop()
        if self._apool is None or self._aloop is not loop:
            if self._closed:
                raise BackendUnavailableError(f"PostgreSQL at {_location(self.url)} was closed")
            from psycopg_pool import AsyncConnectionPool

            pool = AsyncConnectionPool(
                self.url,
                min_size=self.min_size,
                max_size=self.max_size,
                timeout=self.timeout,
                kwargs=self._options,
                open=False,
            )
            # Set before the first await, so concurrent first calls share one pool.
            self._apool, self._aloop = pool, loop
            self._aopening = asyncio.ensure_future(self._aopen(pool))
        assert self._aopening is not None
        await asyncio.shield(self._aopening)
        return self._apool

    async def _aopen(self, pool: Any) -> None:
        """Open ``pool`` after a first direct connection; on failure the next call tries
        again with a new pool (a server that was down at start-up may be up by then)."""
        try:
            await self._afirst_connection()
            await pool.open(wait=True, timeout=self.timeout)
        except BaseException:
            if self._apool is pool:
                self._apool = None
            await pool.close()
            raise

    @asynccontextmanager
    async def aconnection(self) -> AsyncIterator[Any]:
        """Async twin of [`connection`][], from the running event loop's pool."""
        import psycopg

        if self.availability.must_try():  # raises while down, but once an interval
            await self._arecover()
        if self._stale:
            await self._acheck_pool()
        try:
            pool = await self._async_pool()
            async with pool.connection() as conn:
                yield conn
        except psycopg.Error as exc:
            raise self._failure(exc) from exc

    @asynccontextmanager
    async def atransaction(self) -> AsyncIterator[Any]:
        """Async twin of [`transaction`][]."""
        async with self.aconnection() as conn, conn.transaction():
            yield conn

    def run(self, plan: Callable[[], Plan[_T]], *, write: Write = True) -> _T:
        """Run the statements of ``plan()``: in one transaction when ``write`` is True, else
        in autocommit (a read, or a write of one statement: atomic on its own, without BEGIN
        and COMMIT round trips)."""
        with self.transaction() if write is True else self.connection() as conn:
            return run_plan(conn.cursor(), self.dialect, plan())

    async def arun(self, plan: Callable[[], Plan[_T]], *, write: Write = True) -> _T:
        """Async twin of [`run`][], on the running event loop's pool."""
        async with self.atransaction() if write is True else self.aconnection() as conn:
            return await arun_plan(conn.cursor(), self.dialect, plan())

    def migrate(self, migrations: MigrationSet) -> None:
        """Apply ``migrations`` in one transaction; idempotent."""
        with self.transaction() as conn:
            apply_migrations(conn, migrations)

    async def acall(self, call: Callable[[], _T]) -> _T:
        """Run the blocking ``call`` off the event loop, on keel's one blocking pool."""
        return await run_blocking(call)

    async def aping(self, connections: int = 1) -> None:
        """Wait until the running loop's pool holds ``connections`` connections (at most its
        ``max_size``) that each answered a query: a server warms its pool this way before it
        takes traffic, so that its first requests do not wait for new server processes.

        Raises:
            BackendUnavailableError: the database does not answer within ``timeout``.
        """
        wanted = max(1, min(connections, self.max_size))
        # Each keeps its connection until every other one is out too: only then has the pool
        # grown to ``wanted``.
        all_held = asyncio.Barrier(wanted)

        async def hold_one() -> None:
            async with self.aconnection() as conn:
                await conn.execute("SELECT 1")
                await all_held.wait()

        try:
            async with asyncio.timeout(self.timeout):
                await asyncio.gather(*(hold_one() for _ in range(wanted)))
        except TimeoutError as exc:
            raise BackendUnavailableError(
                f"PostgreSQL at {_location(self.url)} did not answer within {self.timeout:g} s",
                store=_STORE,
            ) from exc

    def close(self) -> None:
        """Close the pools (idempotent). An async pool on an event loop that runs in another
        thread (keel's bridge loop, which every sync twin such as ``erase_user`` runs on) is
        closed there; one on the caller's own running loop is left to [`aclose`][]."""
        pool, loop = self._apool, self._aloop
        if pool is not None and loop is not None and loop.is_running() and not _on(loop):
            self._apool = None
            # Left open, its worker tasks die with the loop at exit, each one printing "Task
            # was destroyed but it is pending!" after a CLI command had finished.
            closing = asyncio.run_coroutine_threadsafe(pool.close(), loop)
            with contextlib.suppress(Exception):
                closing.result(timeout=self.timeout)
        with self._open_lock:
            self._closed = True
            self._opened = False
            self._pool.close()

    async def aclose(self) -> None:
        """Close the async pool, then the sync pool (idempotent). A pool made on another event
        loop is closed there if that loop still runs, and dropped if it ended (a script's
        ``asyncio.run`` per call): its connections' tasks cannot be awaited on this one."""
        pool, loop, self._apool = self._apool, self._aloop, None
        try:
            if pool is not None and loop is asyncio.get_running_loop():
                await pool.close()
            elif pool is not None and loop is not None and not loop.is_closed():
                asyncio.run_coroutine_threadsafe(pool.close(), loop)
        finally:
            self.close()

    def __enter__(self) -> PostgresDatabase:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PostgresDatabase({_location(self.url)!r})"
