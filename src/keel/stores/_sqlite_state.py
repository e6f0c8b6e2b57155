"""State checkpoints in the embedded SQLite database (the default backend).

Writes run in ``BEGIN IMMEDIATE`` transactions, so the version check and the append are one
atomic step across threads and processes; reads run in one deferred transaction, a consistent
WAL snapshot.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from keel.errors import ConflictError, ExpiredError
from keel.state._backend import Chain, SessionHead, StateBackend, StoredCheckpoint
from keel.stores._migrations import Migration, MigrationSet
from keel.stores._sqlite import SQLiteDatabase, translate_sqlite_error

__all__ = ["STATE_MIGRATIONS", "SQLiteStateBackend"]

STATE_MIGRATIONS = MigrationSet(
    "state",
    (
        Migration(
            "sessions, checkpoints (full snapshots and deltas) and advisory leases",
            """
            CREATE TABLE IF NOT EXISTS keel_state_sessions (
                session_id TEXT PRIMARY KEY,
                version INTEGER NOT NULL,
                epoch TEXT NOT NULL,
                last_full INTEGER NOT NULL,
                ttl REAL,
                expires_at REAL,
                updated_at REAL NOT NULL
            );
            CREATE INDEX IF NOT EXISTS keel_state_sessions_expiry
                ON keel_state_sessions (expires_at) WHERE expires_at IS NOT NULL;
            CREATE TABLE IF NOT EXISTS keel_state_checkpoints (
                session_id TEXT NOT NULL,
                version INTEGER NOT NULL,
                created_at REAL NOT NULL,
                step INTEGER NOT NULL,
                reason TEXT NOT NULL,
                kind TEXT NOT NULL CHECK (kind IN ('full', 'delta')),
                payload TEXT NOT NULL,
                schema_name TEXT NOT NULL,
                schema_version INTEGER NOT NULL,
                good INTEGER,
                forked_from TEXT,
                PRIMARY KEY (session_id, version)
            );
            CREATE TABLE IF NOT EXISTS keel_state_locks (
                key TEXT PRIMARY KEY,
                owner TEXT NOT NULL,
                expires_at REAL NOT NULL
            );
            """,
        ),
    ),
)

_COLUMNS = (
    "version, created_at, step, reason, kind, payload, schema_name, schema_version, good, "
    "forked_from"
)


def _row(values: tuple[object, ...], payload_size: int | None = None) -> StoredCheckpoint:
    good = values[8]
    return StoredCheckpoint(
        version=int(values[0]),  # type: ignore[call-overload]
        created_at=float(values[1]),  # type: ignore[arg-type]
        step=int(values[2]),  # type: ignore[call-overload]
        reason=str(values[3]),
        kind="full" if values[4] == "full" else "delta",
        payload=str(values[5]),
        schema_name=str(values[6]),
        schema_version=int(values[7]),  # type: ignore[call-overload]
        good=None if good is None else bool(good),
        forked_from=None if values[9] is None else str(values[9]),
        payload_size=payload_size,
    )


_T = TypeVar("_T")


class SQLiteStateBackend(StateBackend):
    """Checkpoints in a ``SQLiteDatabase`` (its ``state`` migrations are applied on open).

    Args:
        database: an open ``SQLiteDatabase``, or a path to one.
    """

    name = "sqlite"

    def __init__(self, database: SQLiteDatabase | Path | str) -> None:
        self._owned = not isinstance(database, SQLiteDatabase)
        self.db = database if isinstance(database, SQLiteDatabase) else SQLiteDatabase(database)
        self.db.setup(STATE_MIGRATIONS)

    async def _run_twin(self, call: Callable[[], _T]) -> _T:
        return await self.db.arun(call)

    @contextmanager
    def _snapshot(self) -> Iterator[sqlite3.Connection]:
        with self.db.snapshot() as conn:
            yield conn

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self.db.transaction() as conn:
            try:
                yield conn
            except sqlite3.Error as exc:
                raise translate_sqlite_error(exc, self.db.path) from exc

    @staticmethod
    def _head(conn: sqlite3.Connection, session_id: str) -> SessionHead | None:
        found = conn.execute(
            "SELECT version, epoch, last_full, ttl, expires_at FROM keel_state_sessions "
            "WHERE session_id = ?",
            (session_id,),
        ).fetchone()
        if found is None:
            return None
        return SessionHead(
            session_id=session_id,
            version=int(found[0]),
            epoch=str(found[1]),
            last_full=int(found[2]),
            ttl=None if found[3] is None else float(found[3]),
            expires_at=None if found[4] is None else float(found[4]),
        )

    @staticmethod
    def _check_live(head: SessionHead, now: float) -> None:
        if head.expires_at is not None and head.expires_at <= now:
            raise ExpiredError(
                f"session {head.session_id!r} expired {now - head.expires_at:.1f}s ago "
                f"(version {head.version}); it reads as absent"
            )

    def read_head_chain(
        self, session_id: str, now: float, known_version: int, known_epoch: str
    ) -> Chain | None:
        with self._snapshot() as conn:
            head = self._head(conn, session_id)
            if head is None:
                return None
            self._check_live(head, now)
            if head.version == known_version and head.epoch == known_epoch:
                found = conn.execute(
                    f"SELECT {_COLUMNS} FROM keel_state_checkpoints "
                    "WHERE session_id = ? AND version = ?",
                    (session_id, head.version),
                ).fetchone()
                if found is not None:
                    return Chain(head, [_row(found)])
        return self.read_chain(session_id, None, now)

    def read_chain(self, session_id: str, version: int | None, now: float) -> Chain | None:
        with self._snapshot() as conn:
            head = self._head(conn, session_id)
            if head is None:
                return None
            self._check_live(head, now)
            target = head.version if version is None else version
            if target > head.version or target < 1:
                return None
            base = conn.execute(
                "SELECT max(version) FROM keel_state_checkpoints "
                "WHERE session_id = ? AND version <= ? AND kind = 'full'",
                (session_id, target),
            ).fetchone()[0]
            if base is None:
                return None
            rows = [
                _row(values)
                for values in conn.execute(
                    f"SELECT {_COLUMNS} FROM keel_state_checkpoints WHERE session_id = ? "
                    "AND version BETWEEN ? AND ? ORDER BY version",
                    (session_id, base, target),
                )
            ]
        if not rows or rows[-1].version != target or len(rows) != target - int(base) + 1:
            return None
        return Chain(head, rows)

    def write(
        self,
        session_id: str,
        row: StoredCheckpoint,
        *,
        expected_version: int | None,
        expected_epoch: str | None,
        new_epoch: str | None,
        ttl: float | None,
        now: float,
    ) -> None:
        with self._tx() as conn:
            head = self._head(conn, session_id)
            if expected_version is None:
                if head is not None:
                    if head.expires_at is None or head.expires_at > now:
                        raise ConflictError(session_id, None, head.version)
                    conn.execute(
                        "DELETE FROM keel_state_checkpoints WHERE session_id = ?", (session_id,)
                    )
                    conn.execute(
                        "DELETE FROM keel_state_sessions WHERE session_id = ?", (session_id,)
                    )
                conn.execute(
                    "INSERT INTO keel_state_sessions (session_id, version, epoch, last_full, ttl, "
                    "expires_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (
                        session_id,
                        row.version,
                        new_epoch,
                        row.version,
                        ttl,
                        None if ttl is None else now + ttl,
                        now,
                    ),
                )
            else:
                # The compare-and-set is the UPDATE itself: it moves only the head this writer
                # read (version, incarnation, alive), so no row is written past a stale head
                # whatever the checkpoint table would have said.
                moved = conn.execute(
                    "UPDATE keel_state_sessions SET version = ?, updated_at = ?, "
                    "last_full = CASE WHEN ? THEN ? ELSE last_full END, "
                    "expires_at = CASE WHEN ttl IS NULL THEN NULL ELSE ? + ttl END "
                    "WHERE session_id = ? AND version = ? AND epoch IS ? "
                    "AND (expires_at IS NULL OR expires_at > ?)",
                    (
                        row.version, now, row.kind == "full", row.version, now,
                        session_id, expected_version, expected_epoch, now,
                    ),
                )  # fmt: skip
                if moved.rowcount != 1:
                    raise ConflictError(
                        session_id, expected_version, None if head is None else head.version
                    )
            conn.execute(
                f"INSERT INTO keel_state_checkpoints (session_id, {_COLUMNS}) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    session_id,
                    row.version,
                    row.created_at,
                    row.step,
                    row.reason,
                    row.kind,
                    row.payload,
                    row.schema_name,
                    row.schema_version,
                    None if row.good is None else int(row.good),
                    row.forked_from,
                ),
            )

    def history(self, session_id: str, now: float) -> list[StoredCheckpoint]:
        with self._snapshot() as conn:
            head = self._head(conn, session_id)
            if head is None:
                return []
            self._check_live(head, now)
            found = conn.execute(
                "SELECT version, created_at, step, reason, kind, '', schema_name, "
                "schema_version, good, forked_from, length(CAST(payload AS BLOB)) "
                "FROM keel_state_checkpoints WHERE session_id = ? ORDER BY version",
                (session_id,),
            ).fetchall()
        return [_row(values[:10], payload_size=int(values[10])) for values in found]

    def mark(self, session_id: str, version: int, good: bool | None) -> bool:
        with self._tx() as conn:
            cursor = conn.execute(
                "UPDATE keel_state_checkpoints SET good = ? WHERE session_id = ? AND version = ?",
                (None if good is None else int(good), session_id, version),
            )
            return cursor.rowcount == 1

    def rewrite(self, session_id: str, delete: list[int], replace: list[StoredCheckpoint]) -> None:
        with self._tx() as conn:
            head = self._head(conn, session_id)
            if head is None:
                return
            for row in replace:
                conn.execute(
                    "UPDATE keel_state_checkpoints SET kind = ?, payload = ? "
                    "WHERE session_id = ? AND version = ?",
                    (row.kind, row.payload, session_id, row.version),
                )
            conn.executemany(
                "DELETE FROM keel_state_checkpoints WHERE session_id = ? AND version = ?",
                [(session_id, version) for version in delete if version != head.version],
            )

    def delete(self, session_id: str) -> bool:
        with self._tx() as conn:
            conn.execute("DELETE FROM keel_state_checkpoints WHERE session_id = ?", (session_id,))
            cursor = conn.execute(
                "DELETE FROM keel_state_sessions WHERE session_id = ?", (session_id,)
            )
            return cursor.rowcount == 1

    def sessions(self) -> list[str]:
        with self.db.translated() as conn:
            return [
                str(value)
                for (value,) in conn.execute(
                    "SELECT session_id FROM keel_state_sessions ORDER BY session_id"
                )
            ]

    def purge_expired(self, now: float) -> list[str]:
        with self._tx() as conn:
            expired = [
                str(value)
                for (value,) in conn.execute(
                    "SELECT session_id FROM keel_state_sessions "
                    "WHERE expires_at IS NOT NULL AND expires_at <= ?",
                    (now,),
                )
            ]
            for session_id in expired:
                conn.execute(
                    "DELETE FROM keel_state_checkpoints WHERE session_id = ?", (session_id,)
                )
                conn.execute("DELETE FROM keel_state_sessions WHERE session_id = ?", (session_id,))
            conn.execute("DELETE FROM keel_state_locks WHERE expires_at <= ?", (now,))
        return expired

    def acquire_lock(self, key: str, owner: str, ttl: float, now: float) -> bool:
        with self._tx() as conn:
            cursor = conn.execute(
                "INSERT INTO keel_state_locks (key, owner, expires_at) VALUES (?, ?, ?) "
                "ON CONFLICT(key) DO UPDATE SET owner = excluded.owner, "
                "expires_at = excluded.expires_at WHERE keel_state_locks.expires_at <= ? "
                "OR keel_state_locks.owner = excluded.owner",
                (key, owner, now + ttl, now),
            )
            return cursor.rowcount == 1

    def lock_holder(self, key: str, now: float) -> str | None:
        with self.db.translated() as conn:
            row = conn.execute(
                "SELECT owner FROM keel_state_locks WHERE key = ? AND expires_at > ?", (key, now)
            ).fetchone()
        return None if row is None else str(row[0])

    def release_lock(self, key: str, owner: str) -> bool:
        with self._tx() as conn:
            cursor = conn.execute(
                "DELETE FROM keel_state_locks WHERE key = ? AND owner = ?", (key, owner)
            )
            return cursor.rowcount == 1

    def storage_bytes(self) -> int:
        with self.db.translated() as conn:
            try:
                found = conn.execute(
                    "SELECT sum(pgsize) FROM dbstat WHERE name LIKE 'keel_state%' "
                    "OR name LIKE 'sqlite_autoindex_keel_state%'"
                ).fetchone()
                return int(found[0] or 0)
            except sqlite3.OperationalError:
                # dbstat is not compiled in: count the whole file.
                pages = conn.execute("PRAGMA page_count").fetchone()[0]
                size = conn.execute("PRAGMA page_size").fetchone()[0]
                return int(pages) * int(size)

    def close(self) -> None:
        if self._owned:
            self.db.close()
