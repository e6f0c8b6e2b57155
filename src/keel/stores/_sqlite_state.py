"""State checkpoints in the embedded SQLite database (the default backend); the SQL is
``_sql_state.py``'s.

Writes run in ``BEGIN IMMEDIATE`` transactions, so the version check and the append are one
atomic step across threads and processes; reads run in one deferred transaction, a consistent
WAL snapshot.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from keel.errors import ConflictError
from keel.state._backend import Chain
from keel.stores._dialect import SQLITE
from keel.stores._sql_plan import Plan, Statement
from keel.stores._sql_state import (
    CHECKPOINT_COLUMNS,
    HEAD,
    Append,
    Scope,
    SQLStateBackend,
    checkpoint_from_row,
    live_head,
    state_migrations,
)
from keel.stores._sqlite import SQLiteDatabase

__all__ = ["STATE_MIGRATIONS", "SQLiteStateBackend"]

STATE_MIGRATIONS = state_migrations(SQLITE)

_CHECKPOINT = (
    f"SELECT {CHECKPOINT_COLUMNS} FROM keel_state_checkpoints WHERE session_id = ? AND version = ?"
)
_BASE = (
    "SELECT max(version) FROM keel_state_checkpoints "
    "WHERE session_id = ? AND version <= ? AND kind = 'full'"
)
_CHAIN = (
    f"SELECT {CHECKPOINT_COLUMNS} FROM keel_state_checkpoints WHERE session_id = ? "
    "AND version BETWEEN ? AND ? ORDER BY version"
)
# The compare-and-set is the UPDATE itself: it moves only the head this writer read (version,
# incarnation, alive), so no row is written past a stale head whatever the checkpoint table
# would have said.
_MOVE_HEAD = (
    "UPDATE keel_state_sessions SET version = ?, updated_at = ?, "
    "last_full = CASE WHEN ? THEN ? ELSE last_full END, "
    "expires_at = CASE WHEN ttl IS NULL THEN NULL ELSE ? + ttl END "
    "WHERE session_id = ? AND version = ? AND epoch IS ? "
    "AND (expires_at IS NULL OR expires_at > ?)"
)

_T = TypeVar("_T")


class SQLiteStateBackend(SQLStateBackend):
    """Checkpoints in a [`SQLiteDatabase`][] (its ``state`` migrations are
    applied here; the database is left open by `close`)."""

    name = "sqlite"
    dialect = SQLITE

    def __init__(self, database: SQLiteDatabase) -> None:
        super().__init__()
        self.db = database
        database.setup(STATE_MIGRATIONS)

    async def _run_twin(self, call: Callable[[], _T]) -> _T:
        return await self.db.acall(call)

    @contextmanager
    def _cursor(self, scope: Scope) -> Iterator[sqlite3.Cursor]:
        if scope is Scope.READ:
            opened = self.db.translated()
        elif scope is Scope.SNAPSHOT or scope is Scope.CHAIN:
            opened = self.db.snapshot()
        else:
            opened = self.db.transaction()
        with opened as conn:
            yield conn.cursor()

    def _chain(
        self, session_id: str, version: int | None, now: float, known: tuple[int, str] | None
    ) -> Plan[Chain | None]:
        found = (yield Statement(HEAD, (session_id,))).rows
        if not found:
            return None
        head = live_head(session_id, found[0], now)
        if known == (head.version, head.epoch):
            # The head the reader holds: its row alone (its metadata is read fresh).
            rows = (yield Statement(_CHECKPOINT, (session_id, head.version))).rows
            if rows:
                return Chain(head, [checkpoint_from_row(rows[0])])
        target = head.version if version is None else version
        if target > head.version or target < 1:
            return None
        base = (yield Statement(_BASE, (session_id, target))).rows[0][0]
        if base is None:
            return None
        chain = yield Statement(_CHAIN, (session_id, base, target))
        rows = [checkpoint_from_row(values) for values in chain.rows]
        if not rows or rows[-1].version != target or len(rows) != target - int(base) + 1:
            return None
        return Chain(head, rows)

    def _append(self, append: Append) -> Plan[None]:
        session_id, row = append.session_id, append.row
        found = (yield Statement(HEAD, (session_id,))).rows
        moved = yield Statement(
            _MOVE_HEAD,
            (
                row.version, append.now, row.kind == "full", row.version, append.now,
                session_id, append.expected_version, append.expected_epoch, append.now,
            ),
        )  # fmt: skip
        if moved.rowcount != 1:
            head_version = int(found[0][0]) if found else None
            raise ConflictError(session_id, append.expected_version, head_version)
        yield self._plans.insert_checkpoint(session_id, row)

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
