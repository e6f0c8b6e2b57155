"""The embedded SQLite database every embedded store extends.

One file, WAL mode (readers never block the writer), a busy timeout instead of instant
"database is locked" failures, foreign keys on, and ordered per-component migrations applied
idempotently by ``setup()``. sqlite3 errors are translated into keel's ``StoreError`` family.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from keel.errors import (
    DatabaseCorruptError,
    DatabaseLockedError,
    DataDirectoryError,
    SchemaVersionError,
    StoreError,
)
from keel.stores._migrations import Migration, MigrationSet

__all__ = ["CORE_MIGRATIONS", "SQLiteDatabase", "translate_sqlite_error"]

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


def translate_sqlite_error(exc: sqlite3.Error, path: str) -> StoreError:
    """The keel error for a sqlite3 error (raise it ``from exc``)."""
    text = str(exc).lower()
    if "locked" in text or "busy" in text:
        return DatabaseLockedError(f"database {path} is locked by another writer: {exc}")
    if "not a database" in text or "malformed" in text or "corrupt" in text:
        return DatabaseCorruptError(f"database {path} is corrupt or not a SQLite database: {exc}")
    if "readonly" in text or "unable to open" in text or "disk i/o" in text:
        return DataDirectoryError(f"cannot write database {path}: {exc}")
    return StoreError(f"database {path}: {exc}")


class SQLiteDatabase:
    """A SQLite file shared by keel's embedded stores, safe to use from many threads.

    Each thread gets its own connection; writes go through ``transaction()``, which takes the
    write lock up front (``BEGIN IMMEDIATE``) so two writers never deadlock on an upgrade.
    """

    def __init__(self, path: Path | str, *, busy_timeout_ms: int = 5000) -> None:
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
        self._closed = False

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

    def connection(self) -> sqlite3.Connection:
        """This thread's connection, opened and configured on first use."""
        if self._closed:
            raise StoreError(f"database {self.path} is closed")
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is not None:
            return conn
        self._prepare_directory()
        try:
            conn = sqlite3.connect(
                self.path,
                timeout=self.busy_timeout_ms / 1000,
                isolation_level=None,  # autocommit; transactions are explicit
                check_same_thread=False,
            )
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_ms)}")
            conn.execute("PRAGMA foreign_keys = ON")
            if not self.is_memory:
                mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                if str(mode).lower() != "wal":
                    raise StoreError(f"database {self.path}: cannot enable WAL (got {mode})")
                conn.execute("PRAGMA synchronous = NORMAL")
        except sqlite3.Error as exc:
            raise translate_sqlite_error(exc, self.path) from exc
        self._local.conn = conn
        with self._lock:
            self._connections.append(conn)
        return conn

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """A write transaction: committed on success, rolled back on any exception."""
        conn = self.connection()
        with self._write_lock:
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise translate_sqlite_error(exc, self.path) from exc
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            try:
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                conn.execute("ROLLBACK")
                raise translate_sqlite_error(exc, self.path) from exc

    @contextmanager
    def translated(self) -> Iterator[sqlite3.Connection]:
        """This thread's connection, with sqlite3 errors translated to keel's."""
        try:
            yield self.connection()
        except sqlite3.Error as exc:
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
    import os

    return os.access(directory, os.W_OK | os.X_OK)
