"""The embedded SQLite database every embedded store extends.

One file, WAL mode (readers never block the writer), a busy timeout instead of instant
"database is locked" failures, foreign keys on, and ordered per-component migrations applied
idempotently by ``setup()``. sqlite3 errors are translated into keel's ``StoreError`` family by
their SQLite result code (``SQLITE_FULL`` -> ``StorageFullError``, ...), never by guesswork on
the message alone, and a failed rollback never hides the error that caused it.

The file is identified by its device and inode when first opened; a file deleted or replaced
while open (reads would go on to the unlinked file, new connections would create an empty one)
raises ``DatabaseFileError`` before the next read or write. The check is one ``stat`` call.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from keel._bridge import run_blocking
from keel._urls import parse_database_url
from keel.errors import (
    DatabaseCorruptError,
    DatabaseFileError,
    DatabaseLockedError,
    DatabaseReadOnlyError,
    DataDirectoryError,
    SchemaVersionError,
    StorageFullError,
    StoreError,
)
from keel.stores._dialect import SQLITE
from keel.stores._migrations import Migration, MigrationSet
from keel.stores._sql_plan import (
    Plan,
    RiderFailed,
    Write,
    ride,
    riders_for,
    run_plan,
    run_riders,
    run_statement,
)

__all__ = ["CORE_MIGRATIONS", "SQLiteDatabase", "translate_sqlite_error"]

logger = logging.getLogger("keel.stores")

_T = TypeVar("_T")


class _WouldWait(Exception):
    """An inline call met a held write lock before it wrote anything: run it in a thread."""


# Primary SQLite result codes (https://sqlite.org/rescode.html); extended codes keep them in
# their low byte.
_IDLE_CONNECTIONS = 8
"""Connections of ended threads kept open per busy timeout, for the next threads to take."""
_SQLITE_BUSY = 5
_SQLITE_LOCKED = 6
_SQLITE_READONLY = 8
_SQLITE_IOERR = 10
_SQLITE_CORRUPT = 11
_SQLITE_FULL = 13
_SQLITE_CANTOPEN = 14
_SQLITE_NOTADB = 26

_CURRENT_SCHEMA = "SELECT 1 FROM sqlite_master LIMIT 0"
"""Run first in every write transaction: it reloads the connection's copy of the schema if
another connection changed it since (its schema cookie check), before any statement of the
transaction is compiled. SQLite (3.40 to 3.51 at least) fails to compile a first DELETE on a
table with ``ON DELETE CASCADE`` children and a trigger writing to a virtual table (memory's
FTS5 index) against a stale copy: the virtual table's connect runs SQL of its own, which
notices the change and drops the schema mid-compile, and the cascade then finds no parent
table ("no such table: memory_records"). Reads never compile cascades."""

CORE_MIGRATIONS = MigrationSet(
    "core",
    (
        Migration(
            "key/value metadata about this database",
            """
            CREATE TABLE IF NOT EXISTS keel_meta (
                key TEXT PRIMARY KEY,
                value TEXT NOT NULL
            );
            """,
        ),
    ),
)


def _is_busy(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    return isinstance(code, int) and code & 0xFF in (_SQLITE_BUSY, _SQLITE_LOCKED)


def translate_sqlite_error(exc: sqlite3.Error, path: str) -> StoreError:
    """The keel error for a sqlite3 error (raise it ``from exc``).

    The SQLite result code decides when the driver reports one; the message is the fallback
    for errors raised without one.
    """
    code = getattr(exc, "sqlite_errorcode", None)
    primary = code & 0xFF if isinstance(code, int) else None
    text = str(exc).lower()
    if primary == _SQLITE_FULL or (primary is None and "is full" in text):
        return StorageFullError(
            f"database {path}: the disk or the database's size limit is full; nothing of "
            f"this write was kept (free space, then retry): {exc}"
        )
    if primary in (_SQLITE_BUSY, _SQLITE_LOCKED) or (
        primary is None and ("locked" in text or "busy" in text)
    ):
        return DatabaseLockedError(f"database {path} is locked by another writer: {exc}")
    if primary in (_SQLITE_CORRUPT, _SQLITE_NOTADB) or (
        primary is None and ("not a database" in text or "malformed" in text or "corrupt" in text)
    ):
        return DatabaseCorruptError(f"database {path} is corrupt or not a SQLite database: {exc}")
    if primary == _SQLITE_READONLY or (primary is None and "readonly" in text):
        return DatabaseReadOnlyError(
            f"database {path} is read-only (the file or its file system cannot be written): {exc}"
        )
    if primary in (_SQLITE_IOERR, _SQLITE_CANTOPEN) or (
        primary is None and ("unable to open" in text or "disk i/o" in text)
    ):
        return DataDirectoryError(f"cannot write database {path}: {exc}")
    return StoreError(f"database {path}: {exc}")


class _InlineCall:
    """The progress of one call that ``SQLiteDatabase.arun`` runs inline."""

    __slots__ = ("wrote",)

    def __init__(self) -> None:
        self.wrote = False


class SQLiteDatabase:
    """A SQLite file shared by keel's embedded stores, safe to use from many threads.

    Each thread gets its own connection; writes go through ``transaction()``, which takes the
    write lock up front (``BEGIN IMMEDIATE``) so two writers never deadlock on an upgrade.
    Stores run their SQL through it: [`run`][] / [`arun`][] a plan, [`migrate`][] their schema.
    """

    dialect = SQLITE

    def __init__(self, path: Path | str, *, busy_timeout_ms: int = 5000) -> None:
        # A ``sqlite:///`` URL names its file, as everywhere else keel takes one: read as a
        # bare path it would open ``./sqlite:/...``, a stray directory beside the caller.
        if isinstance(path, str) and path.startswith("sqlite:"):
            parsed = parse_database_url(path, kinds=("sqlite",)).path
            assert parsed is not None
            path = parsed
        self.path = str(path)
        self.busy_timeout_ms = busy_timeout_ms
        self._local = threading.local()
        self._lock = threading.Lock()
        # SQLite admits one writer at a time. Threads of this process queue here instead of
        # in SQLite's busy handler, which polls with growing sleeps and can starve a thread
        # past the busy timeout when dozens write at once. Other processes still meet the
        # busy timeout.
        self._write_lock = threading.RLock()
        self._connections: list[sqlite3.Connection] = []
        # Whose each connection is (and its busy timeout): a thread that has ended can no
        # longer use its connection, so the next thread that needs one takes it over instead
        # of opening another (a pool that starts threads per task, as LangGraph's executor
        # does, would otherwise open a connection per task and keep every one of them open).
        self._owners: dict[threading.Thread, list[tuple[sqlite3.Connection, int]]] = {}
        self._idle: dict[int, list[sqlite3.Connection]] = {}
        self._closed = False
        # (st_dev, st_ino) of the file when it was first opened; None until then.
        self._identity: tuple[int, int] | None = None

    @property
    def is_memory(self) -> bool:
        """True for an in-memory database (tests)."""
        return self.path == ":memory:" or self.path.startswith("file::memory:")

    def _prepare_directory(self) -> None:
        if self.is_memory:
            return
        directory = Path(self.path).expanduser().resolve().parent
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DataDirectoryError(
                f"cannot create data directory {directory}: {exc.strerror}"
            ) from exc
        if not _writable(directory):
            raise DataDirectoryError(f"data directory {directory} is not writable")

    def _file_identity(self) -> tuple[int, int] | None:
        try:
            # os.stat, not Path.stat: this runs before every transaction.
            found = os.stat(self.path)  # noqa: PTH116
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise DataDirectoryError(f"cannot read database {self.path}: {exc.strerror}") from exc
        return found.st_dev, found.st_ino

    def check_file(self) -> None:
        """Raise DatabaseFileError if the file was deleted or replaced since it was opened."""
        if self._identity is None:
            return
        now = self._file_identity()
        if now == self._identity:
            return
        what = "deleted" if now is None else "replaced by another file"
        raise DatabaseFileError(
            f"database {self.path} was {what} while open; nothing more is read from or "
            "written to it: restore the file (or start afresh) and reopen the database"
        )

    def connection(self) -> sqlite3.Connection:
        """This thread's connection, opened and configured on first use."""
        if self._closed:
            raise StoreError(f"database {self.path} is closed")
        # A call run inline on an event loop has a connection of its own that never waits
        # for a lock (busy timeout 0): meeting one, the call moves to a worker thread.
        slot = "conn" if getattr(self._local, "inline", None) is None else "inline_conn"
        conn: sqlite3.Connection | None = getattr(self._local, slot, None)
        if conn is not None:
            return conn
        busy_timeout_ms = int(self.busy_timeout_ms) if slot == "conn" else 0
        # A new connection to a deleted file would silently create an empty database.
        self.check_file()
        with self._lock:
            self._reclaim_ended_threads_connections()
            idle = self._idle.get(busy_timeout_ms)
            conn = idle.pop() if idle else None
            if conn is not None:
                self._owners.setdefault(threading.current_thread(), []).append(
                    (conn, busy_timeout_ms)
                )
        if conn is not None:
            setattr(self._local, slot, conn)
            return conn
        self._prepare_directory()
        try:
            conn = sqlite3.connect(
                self.path,
                timeout=busy_timeout_ms / 1000,
                isolation_level=None,  # autocommit; transactions are explicit
                check_same_thread=False,
            )
            conn.execute(f"PRAGMA busy_timeout = {busy_timeout_ms}")
            conn.execute("PRAGMA foreign_keys = ON")
            if not self.is_memory:
                mode = self._enable_wal(conn)
                if str(mode).lower() != "wal":
                    raise StoreError(f"database {self.path}: cannot enable WAL (got {mode})")
                conn.execute("PRAGMA synchronous = NORMAL")
        except sqlite3.Error as exc:
            if conn is not None:
                conn.close()
            raise translate_sqlite_error(exc, self.path) from exc
        if not self.is_memory and self._identity is None:
            self._identity = self._file_identity()
        setattr(self._local, slot, conn)
        with self._lock:
            self._connections.append(conn)
            self._owners.setdefault(threading.current_thread(), []).append((conn, busy_timeout_ms))
        return conn

    def _reclaim_ended_threads_connections(self) -> None:
        """Take back the connections of threads that have ended (under ``_lock``): a few stay
        open for the next threads, the rest are closed."""
        for thread in [thread for thread in self._owners if not thread.is_alive()]:
            for conn, busy_timeout_ms in self._owners.pop(thread):
                idle = self._idle.setdefault(busy_timeout_ms, [])
                try:
                    if conn.in_transaction:
                        conn.rollback()  # the thread ended inside a transaction
                    reusable = len(idle) < _IDLE_CONNECTIONS
                except sqlite3.Error:
                    reusable = False  # closed (discarded) or broken
                if reusable:
                    idle.append(conn)
                    continue
                if conn in self._connections:
                    self._connections.remove(conn)
                with contextlib.suppress(sqlite3.Error):
                    conn.close()

    def _enable_wal(self, conn: sqlite3.Connection) -> str:
        """Switch to WAL, waiting out other processes doing the same: on a new file the switch
        answers "database is locked" at once, without SQLite's busy handler, while another
        connection holds its lock for a moment (two workers starting together)."""
        deadline = time.monotonic() + self.busy_timeout_ms / 1000
        delay = 0.005
        while True:
            try:
                return str(conn.execute("PRAGMA journal_mode = WAL").fetchone()[0])
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() >= deadline:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 0.1)

    def _discard(self, conn: sqlite3.Connection) -> None:
        """Forget this thread's connection (it is unusable); the next use opens a new one."""
        for slot in ("conn", "inline_conn"):
            if getattr(self._local, slot, None) is conn:
                setattr(self._local, slot, None)
        with self._lock:
            if conn in self._connections:
                self._connections.remove(conn)
        try:
            conn.close()
        except sqlite3.Error:
            logger.debug("closing a broken connection to %s failed", self.path, exc_info=True)

    def _rollback(self, conn: sqlite3.Connection, cause: BaseException) -> None:
        """Roll back what is open without ever replacing ``cause`` with a rollback error.

        SQLite rolls a transaction back by itself on some errors (SQLITE_FULL, SQLITE_IOERR,
        SQLITE_NOMEM, ...): a second ROLLBACK would fail with "no transaction is active" and
        hide the real error. A rollback that fails leaves the connection unusable, so it is
        discarded.
        """
        if not conn.in_transaction:
            return
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error as exc:
            logger.warning(
                "rollback on %s failed after %s: %s; the connection is discarded",
                self.path,
                type(cause).__name__,
                exc,
            )
            cause.add_note(f"(the rollback that followed failed too: {exc})")
            self._discard(conn)

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """A write transaction: committed on success, rolled back on any exception.

        sqlite3 errors, raised by the body or by COMMIT, leave as keel's ``StoreError``
        family with the original on ``__cause__``. A transaction opened inside another one on
        the same thread joins it: the outer one commits or rolls back the whole, so several
        store writes can be made atomic (and cost one commit).
        """
        if getattr(self._local, "open_transaction", False):
            yield self.connection()
            return
        self.check_file()
        conn = self.connection()
        inline: _InlineCall | None = getattr(self._local, "inline", None)
        if not self._write_lock.acquire(blocking=inline is None or inline.wrote):
            raise _WouldWait
        try:
            try:
                if inline is None:
                    conn.execute("BEGIN IMMEDIATE")
                else:
                    self._begin_inline(conn, inline)
            except sqlite3.Error as exc:
                raise translate_sqlite_error(exc, self.path) from exc
            self._local.open_transaction = True
            try:
                conn.execute(_CURRENT_SCHEMA)  # under the write lock: no change can follow
                yield conn
            except sqlite3.Error as exc:
                self._rollback(conn, exc)
                raise translate_sqlite_error(exc, self.path) from exc
            except BaseException as exc:
                self._rollback(conn, exc)
                raise
            finally:
                self._local.open_transaction = False
            try:
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                self._rollback(conn, exc)
                raise translate_sqlite_error(exc, self.path) from exc
        finally:
            self._write_lock.release()

    def _begin_inline(self, conn: sqlite3.Connection, inline: _InlineCall) -> None:
        deadline = time.monotonic() + self.busy_timeout_ms / 1000
        delay = 0.001
        while True:
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as exc:
                if not _is_busy(exc):
                    raise
                if not inline.wrote:
                    raise _WouldWait from exc
                # The call has written already, so it cannot move: wait here, as SQLite's
                # busy handler would have.
                if time.monotonic() >= deadline:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
                continue
            # From here on the call may have written: it must never run again.
            inline.wrote = True
            return

    def in_transaction(self) -> bool:
        """Whether this thread's connection has a transaction open: a write's (what it reads
        may roll back) or a [`snapshot`][]'s (what it reads may be older than the file)."""
        if getattr(self._local, "open_transaction", False):
            return True
        slot = "conn" if getattr(self._local, "inline", None) is None else "inline_conn"
        conn: sqlite3.Connection | None = getattr(self._local, slot, None)
        return conn is not None and conn.in_transaction

    def run(self, plan: Callable[[], Plan[_T]], *, write: Write = True) -> _T:
        """Run the statements of ``plan()`` (a fresh plan each call): in one transaction when
        ``write`` is True, else on this thread's connection outside one (a read of one
        statement is atomic on its own; so is a write of one, ``"statement"``, which still
        queues behind this process's other writes)."""
        if not write:
            with self.translated() as conn:
                return run_plan(conn.cursor(), self.dialect, plan())
        riders = riders_for(self)
        if write == "statement" and not riders:
            return self._run_statement(plan)
        joined = getattr(self._local, "open_transaction", False)
        try:
            with self.transaction() as conn:
                cursor = conn.cursor()
                result = run_plan(cursor, self.dialect, plan())
                # What waits for this write (a turn's trace) commits with it, at no extra
                # commit: in a transaction of the write's own, without a savepoint each.
                if joined:
                    riders = tuple(run_riders(cursor, self.dialect, riders))
                elif riders:
                    ride(cursor, self.dialect, riders)
        except RiderFailed as failed:
            # Rolled back, rider and write alike: the write is made again without it.
            failed.rider.error = failed.error
            return self.run(plan, write=write)
        for rider in riders:
            rider.ran = True
        return result

    def _run_statement(self, plan: Callable[[], Plan[_T]]) -> _T:
        """A write of one statement, without BEGIN and COMMIT: SQLite runs it atomically in a
        transaction of its own, taking the write lock as it starts (waiting out the busy
        timeout for it, as ``BEGIN IMMEDIATE`` does), so a statement that met the lock wrote
        nothing. Inside an open transaction it joins it; in an inline call that has written
        already (which must wait, never move) it runs as a transaction does."""
        inline: _InlineCall | None = getattr(self._local, "inline", None)
        if getattr(self._local, "open_transaction", False) or (inline is not None and inline.wrote):
            with self.transaction() as conn:
                return run_statement(conn.cursor(), self.dialect, plan())
        self.check_file()
        conn = self.connection()
        if not self._write_lock.acquire(blocking=inline is None):
            raise _WouldWait
        try:
            try:
                result = run_statement(conn.cursor(), self.dialect, plan())
            except sqlite3.Error as exc:
                if inline is not None and _is_busy(exc):
                    raise _WouldWait from exc
                raise translate_sqlite_error(exc, self.path) from exc
            if inline is not None:
                inline.wrote = True
            return result
        finally:
            self._write_lock.release()

    async def arun(self, plan: Callable[[], Plan[_T]], *, write: Write = True) -> _T:
        """[`run`][] for an event loop, as [`acall`][] runs a call (``plan`` may be called
        again: a plan is built fresh for each try)."""
        return await self.acall(lambda: self.run(plan, write=write))

    def migrate(self, migrations: MigrationSet) -> None:
        """Apply ``migrations`` (and the core ones); idempotent (see [`setup`][])."""
        self.setup(migrations)

    async def acall(self, call: Callable[[], _T]) -> _T:
        """Run ``call`` (the short body of a store method) for an event loop.

        A write costs tens of microseconds here: with WAL and ``synchronous = NORMAL`` a commit
        appends to the log without an fsync. Handing it to a worker thread costs several times
        that (a thread switch each way, the GIL passed twice), so the call runs inline on the
        loop, unless it would wait: when another thread of this process or another process
        holds the write lock, the call, which has written nothing yet, runs in a worker
        thread instead, where waiting blocks no one. A call never runs twice: once one of its
        transactions has begun, a later one that meets the lock waits for it inline (bounded
        by the busy timeout); only a call of several transactions under contention does.
        """
        if self.is_memory:
            # An in-memory database lives on one connection, bound to its thread.
            return call()
        previous = getattr(self._local, "inline", None)
        self._local.inline = _InlineCall()
        try:
            return call()
        except _WouldWait:
            pass
        finally:
            self._local.inline = previous
        return await run_blocking(call)

    async def aping(self, connections: int = 1) -> None:
        """Check that the file answers a query (``connections`` is for the interface
        [`PostgresDatabase`][] shares: each thread has one connection here).

        Raises:
            StoreError: the file cannot be read, or the database was closed.
        """

        def query() -> None:
            with self.translated() as conn:
                conn.execute("SELECT 1").fetchone()

        await self.acall(query)

    @contextmanager
    def snapshot(self) -> Iterator[sqlite3.Connection]:
        """A read transaction: every read inside sees one consistent version of the file.

        Errors are translated like ``translated()``'s; the transaction is ended without ever
        replacing the error that ended it.
        """
        with self.translated() as conn:
            conn.execute("BEGIN")
            try:
                yield conn
            except BaseException as exc:
                self._rollback(conn, exc)
                raise
            if conn.in_transaction:
                conn.execute("COMMIT")

    @contextmanager
    def translated(self) -> Iterator[sqlite3.Connection]:
        """This thread's connection, with sqlite3 errors translated to keel's."""
        self.check_file()
        try:
            yield self.connection()
        except sqlite3.Error as exc:
            inline: _InlineCall | None = getattr(self._local, "inline", None)
            if inline is not None and not inline.wrote and _is_busy(exc):
                raise _WouldWait from exc
            raise translate_sqlite_error(exc, self.path) from exc

    def schema_versions(self) -> dict[str, int]:
        """The applied schema version of each component (empty for a fresh database)."""
        with self.translated() as conn:
            exists = conn.execute(
                "SELECT 1 FROM sqlite_master WHERE type='table' AND name='keel_schema'"
            ).fetchone()
            if not exists:
                return {}
            rows = conn.execute("SELECT component, version FROM keel_schema").fetchall()
        return {str(component): int(version) for component, version in rows}

    def setup(self, *migration_sets: MigrationSet) -> dict[str, int]:
        """Apply the core migrations and ``migration_sets``; idempotent.

        Returns the schema version of every component afterwards.

        Raises:
            SchemaVersionError: the database holds a newer schema than this code knows.
        """
        sets = (CORE_MIGRATIONS, *migration_sets)
        with self.transaction() as conn:
            try:
                conn.execute(
                    """CREATE TABLE IF NOT EXISTS keel_schema (
                        component TEXT PRIMARY KEY,
                        version INTEGER NOT NULL,
                        applied_at REAL NOT NULL
                    )"""
                )
                current = {
                    str(component): int(version)
                    for component, version in conn.execute(
                        "SELECT component, version FROM keel_schema"
                    )
                }
                for migration_set in sets:
                    applied = current.get(migration_set.component, 0)
                    if applied > migration_set.version:
                        raise SchemaVersionError(
                            f"database {self.path} has {migration_set.component} schema "
                            f"version {applied}, newer than this keel knows "
                            f"({migration_set.version}); upgrade keel"
                        )
                    for migration in migration_set.migrations[applied:]:
                        if isinstance(migration.apply, str):
                            for statement in _statements(migration.apply):
                                conn.execute(statement)
                        else:
                            migration.apply(conn)
                    if applied < migration_set.version:
                        conn.execute(
                            "INSERT INTO keel_schema (component, version, applied_at) "
                            "VALUES (?, ?, ?) ON CONFLICT(component) DO UPDATE SET "
                            "version = excluded.version, applied_at = excluded.applied_at",
                            (migration_set.component, migration_set.version, time.time()),
                        )
            except sqlite3.Error as exc:
                raise translate_sqlite_error(exc, self.path) from exc
        return self.schema_versions()

    def check_integrity(self) -> None:
        """Raise DatabaseCorruptError unless SQLite's quick check passes."""
        with self.translated() as conn:
            result = conn.execute("PRAGMA quick_check").fetchone()
        if not result or result[0] != "ok":
            raise DatabaseCorruptError(f"database {self.path} failed its integrity check: {result}")

    def close(self) -> None:
        """Close every connection this object opened."""
        with self._lock:
            for conn in self._connections:
                conn.close()
            self._connections.clear()
            self._owners.clear()
            self._idle.clear()
            self._closed = True
        self._local = threading.local()

    def __enter__(self) -> SQLiteDatabase:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SQLiteDatabase({self.path!r})"


def _statements(script: str) -> list[str]:
    """Split a migration script into statements, honouring triggers' inner semicolons."""
    statements: list[str] = []
    buffer = ""
    for line in script.splitlines(keepends=True):
        buffer += line
        if sqlite3.complete_statement(buffer):
            if buffer.strip():
                statements.append(buffer.strip())
            buffer = ""
    if buffer.strip():
        statements.append(buffer.strip())
    return statements


def _writable(directory: Path) -> bool:

    return os.access(directory, os.W_OK | os.X_OK)
