"""State checkpoints in a SQL database: one backend, [`SQLStateBackend`][], over the database
object ([`SQLiteDatabase`][] or [`PostgresDatabase`][]) whose `run` / `arun` run its plans.

Every operation is a plan (``_sql_plan.py``): its statements and the logic between them, written
once in ``?`` markers over the database's `SqlDialect` and run by the sync driver or the async
one. A read is one statement (the head and its chain together, the head and its history
together), atomic on its own in either engine. What the engines do differently is said in one
place, `_Engine`, at the end of this module:

- the compare-and-set append: SQLite moves the head with an ``UPDATE`` and inserts the row in
  one ``BEGIN IMMEDIATE`` transaction (its one write lock makes the pair atomic); PostgreSQL
  does both in one data-modifying statement (a CTE SQLite does not have), in autocommit: one
  round trip, the head's row lock serialising writers, safe behind a transaction pooler;
- a write of one statement (a mark, a lease) runs as one (``write="statement"``): atomic on
  its own without BEGIN and COMMIT, in autocommit on PostgreSQL (no round trips for them),
  queued behind the process's write lock on SQLite as every write there is;
- the bytes the state tables use (``dbstat`` on SQLite, ``pg_total_relation_size``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from keel.errors import ConflictError, ExpiredError, StoreError
from keel.state._backend import Chain, SessionHead, StateBackend, StoredCheckpoint
from keel.state._erasure import LEASE_KEY_PREFIX
from keel.stores._dialect import POSTGRES, SQLITE, SqlDialect
from keel.stores._erase_sql import count_deleted, starts_with
from keel.stores._migrations import Migration, MigrationSet
from keel.stores._postgres import PostgresDatabase
from keel.stores._sql_plan import Plan, Statement, Write
from keel.stores._sqlite import SQLiteDatabase

__all__ = ["POSTGRES_STATE_MIGRATIONS", "STATE_MIGRATIONS", "SQLStateBackend", "state_migrations"]

_T = TypeVar("_T")


def state_migrations(dialect: SqlDialect) -> MigrationSet:
    """The ``state`` component's migrations in ``dialect``'s column types."""
    real, flag = dialect.real_type, dialect.flag_type
    return MigrationSet(
        "state",
        (
            Migration(
                "sessions, checkpoints (full snapshots and deltas) and advisory leases",
                f"""
                CREATE TABLE IF NOT EXISTS keel_state_sessions (
                    session_id TEXT PRIMARY KEY,
                    version INTEGER NOT NULL,
                    epoch TEXT NOT NULL,
                    last_full INTEGER NOT NULL,
                    ttl {real},
                    expires_at {real},
                    updated_at {real} NOT NULL
                );
                CREATE INDEX IF NOT EXISTS keel_state_sessions_expiry
                    ON keel_state_sessions (expires_at) WHERE expires_at IS NOT NULL;
                CREATE TABLE IF NOT EXISTS keel_state_checkpoints (
                    session_id TEXT NOT NULL,
                    version INTEGER NOT NULL,
                    created_at {real} NOT NULL,
                    step INTEGER NOT NULL,
                    reason TEXT NOT NULL,
                    kind TEXT NOT NULL CHECK (kind IN ('full', 'delta')),
                    payload TEXT NOT NULL,
                    schema_name TEXT NOT NULL,
                    schema_version INTEGER NOT NULL,
                    good {flag},
                    forked_from TEXT,
                    PRIMARY KEY (session_id, version)
                );
                CREATE TABLE IF NOT EXISTS keel_state_locks (
                    key TEXT PRIMARY KEY,
                    owner TEXT NOT NULL,
                    expires_at {real} NOT NULL
                );
                """,
            ),
        ),
    )


STATE_MIGRATIONS = state_migrations(SQLITE)
"""The ``state`` migrations on SQLite."""
POSTGRES_STATE_MIGRATIONS = state_migrations(POSTGRES)
"""The ``state`` migrations on PostgreSQL."""


@dataclass(frozen=True, slots=True)
class _Append:
    """An append: ``row`` goes after the head if that is still ``expected_version`` of
    incarnation ``expected_epoch``."""

    session_id: str
    row: StoredCheckpoint
    expected_version: int
    expected_epoch: str | None
    now: float


_CHECKPOINT_NAMES = (
    "version", "created_at", "step", "reason", "kind", "payload", "schema_name",
    "schema_version", "good", "forked_from",
)  # fmt: skip
_CHECKPOINT_COLUMNS = ", ".join(_CHECKPOINT_NAMES)
_HEAD_COLUMNS = "version, epoch, last_full, ttl, expires_at"
_HEAD = f"SELECT {_HEAD_COLUMNS} FROM keel_state_sessions WHERE session_id = ?"
"""A session's head row (see `_head_from_row`)."""
_INSERT_CHECKPOINT = (
    f"INSERT INTO keel_state_checkpoints (session_id, {_CHECKPOINT_COLUMNS}) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_SESSION_COLUMNS = "session_id, version, epoch, last_full, ttl, expires_at, updated_at"
_CREATE_SESSION = (
    f"INSERT INTO keel_state_sessions ({_SESSION_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?) "
    "ON CONFLICT (session_id) DO NOTHING"
)
_REPLACE_SESSION = (
    f"INSERT INTO keel_state_sessions ({_SESSION_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?) "
    "ON CONFLICT (session_id) DO UPDATE SET version = excluded.version, "
    "epoch = excluded.epoch, last_full = excluded.last_full, ttl = excluded.ttl, "
    "expires_at = excluded.expires_at, updated_at = excluded.updated_at"
)
_DELETE_CHECKPOINTS = "DELETE FROM keel_state_checkpoints WHERE session_id = ?"
_LOCK = (
    "INSERT INTO keel_state_locks (key, owner, expires_at) VALUES (?, ?, ?) "
    "ON CONFLICT (key) DO UPDATE SET owner = excluded.owner, "
    "expires_at = excluded.expires_at WHERE keel_state_locks.expires_at <= ? "
    "OR keel_state_locks.owner = excluded.owner"
)
_NEWEST_FULL = (
    "(SELECT max(f.version) FROM keel_state_checkpoints f "
    "WHERE f.session_id = ? AND f.kind = 'full' AND f.version {} CAST(? AS INTEGER))"
)
# The head and the rows a read needs, in one statement (so one consistent view in either
# engine). Parameters: the session, the version wanted (NULL: the head) and the version and
# incarnation the reader holds (NULL: none). The rows start at the base: for a reader holding
# the head, the head row alone (its state is known; its metadata is read fresh); for one
# holding an older version of the same incarnation, the rows after it (or from the newest full
# snapshot among them); else the newest full snapshot at or before the target.
_READ_CHAIN = f"""
WITH h AS (
    SELECT {_HEAD_COLUMNS} FROM keel_state_sessions WHERE session_id = ?
), t AS (
    SELECT coalesce(CAST(? AS INTEGER), h.version) AS target FROM h
), b AS (
    SELECT CASE
        WHEN h.epoch = ? AND h.version = CAST(? AS INTEGER) THEN h.version
        WHEN h.epoch = ? AND h.version > CAST(? AS INTEGER)
            THEN coalesce({_NEWEST_FULL.format(">")}, CAST(? AS INTEGER) + 1)
        ELSE {_NEWEST_FULL.format("<=").replace("CAST(? AS INTEGER)", "t.target")}
    END AS base
    FROM h CROSS JOIN t
)
SELECT h.version, h.epoch, h.last_full, h.ttl, h.expires_at, t.target,
    {", ".join("c." + name for name in _CHECKPOINT_NAMES)}
FROM h CROSS JOIN t CROSS JOIN b
LEFT JOIN keel_state_checkpoints c
    ON c.session_id = ? AND c.version >= b.base AND c.version <= t.target
    AND t.target <= h.version AND t.target >= 1
ORDER BY c.version
"""
# Chunk of ids per DELETE ... IN (...): far below any engine's limit on parameters.
_CHUNK = 500


def _checkpoint_from_row(
    values: Sequence[Any], payload_size: int | None = None
) -> StoredCheckpoint:
    """A checkpoint from its ``_CHECKPOINT_COLUMNS``."""
    good, forked_from = values[8], values[9]
    return StoredCheckpoint(
        version=int(values[0]),
        created_at=float(values[1]),
        step=int(values[2]),
        reason=str(values[3]),
        kind="full" if values[4] == "full" else "delta",
        payload=str(values[5]),
        schema_name=str(values[6]),
        schema_version=int(values[7]),
        good=None if good is None else bool(good),
        forked_from=None if forked_from is None else str(forked_from),
        payload_size=payload_size,
    )


def _checkpoint_values(dialect: SqlDialect, row: StoredCheckpoint) -> tuple[Any, ...]:
    """A checkpoint's ``_CHECKPOINT_COLUMNS`` as parameters."""
    return (
        row.version,
        row.created_at,
        row.step,
        row.reason,
        row.kind,
        row.payload,
        row.schema_name,
        row.schema_version,
        None if row.good is None else dialect.flag(row.good),
        row.forked_from,
    )


def _head_from_row(session_id: str, found: Sequence[Any]) -> SessionHead:
    """A session's head from the columns of ``_HEAD``."""
    return SessionHead(
        session_id=session_id,
        version=int(found[0]),
        epoch=str(found[1]),
        last_full=int(found[2]),
        ttl=None if found[3] is None else float(found[3]),
        expires_at=None if found[4] is None else float(found[4]),
    )


def _live_head(session_id: str, found: Sequence[Any], now: float) -> SessionHead:
    """The head in the columns of ``_HEAD``, alive at ``now``.

    Raises:
        ExpiredError: the session's time to live has passed.
    """
    head = _head_from_row(session_id, found)
    if head.expires_at is not None and head.expires_at <= now:
        raise ExpiredError(
            f"session {head.session_id!r} expired {now - head.expires_at:.1f}s ago "
            f"(version {head.version}); it reads as absent"
        )
    return head


def _chain_from(
    session_id: str, found: list[Any], now: float, known: tuple[int, str] | None
) -> Chain | None:
    """The chain in the rows of ``_READ_CHAIN``: from a full snapshot, every version to the
    target; or, for a reader holding a version of this incarnation, the rows from it or after
    it (the reader's store checks that they are all there)."""
    if not found:
        return None
    first = found[0]
    head = _live_head(session_id, first, now)
    if first[6] is None:  # no such version stored
        return None
    target = int(first[5])
    rows = [_checkpoint_from_row(values[6:]) for values in found]
    if rows[-1].version != target:
        return None
    if rows[0].kind == "full":
        return Chain(head, rows) if len(rows) == target - rows[0].version + 1 else None
    if known is not None and known[1] == head.epoch and rows[0].version >= known[0]:
        return Chain(head, rows)
    return None


def _chunks(values: Sequence[Any]) -> Iterator[Sequence[Any]]:
    for start in range(0, len(values), _CHUNK):
        yield values[start : start + _CHUNK]


class _Plans:
    """The plans of each operation, in one database's dialect."""

    def __init__(self, dialect: SqlDialect, engine: _Engine) -> None:
        self.dialect = dialect
        self.engine = engine
        self.head_for_update = _HEAD + dialect.row_lock
        size = dialect.byte_length.format("c.payload")
        self.history_sql = (
            f"SELECT h.{_HEAD_COLUMNS.replace(', ', ', h.')}, "
            f"{', '.join('c.' + name for name in _CHECKPOINT_NAMES[:5])}, '', "
            f"{', '.join('c.' + name for name in _CHECKPOINT_NAMES[6:])}, {size} "
            "FROM keel_state_sessions h LEFT JOIN keel_state_checkpoints c "
            "ON c.session_id = h.session_id WHERE h.session_id = ? ORDER BY c.version"
        )

    def read_chain(
        self, session_id: str, version: int | None, now: float, known: tuple[int, str] | None
    ) -> Plan[Chain | None]:
        kv, ke = (None, None) if known is None else known
        params = (session_id, version, ke, kv, ke, kv, session_id, kv, kv, session_id, session_id)
        found = yield Statement(_READ_CHAIN, params)
        return _chain_from(session_id, found.rows, now, known)

    def write(
        self,
        session_id: str,
        row: StoredCheckpoint,
        expected: tuple[int | None, str | None],
        new_epoch: str | None,
        ttl: float | None,
        now: float,
    ) -> tuple[Callable[[], Plan[None]], Write]:
        """The plan of `write` (a create, or the engine's append) and its ``write`` flag."""
        version, epoch = expected
        if version is None:
            return lambda: self.create(session_id, row, new_epoch, ttl, now), True
        append = _Append(session_id, row, version, epoch, now)
        return lambda: self.engine.append(self, append), self.engine.append_write

    def create(
        self,
        session_id: str,
        row: StoredCheckpoint,
        new_epoch: str | None,
        ttl: float | None,
        now: float,
    ) -> Plan[None]:
        """A new session with ``row`` as version 1; an expired one is replaced."""
        session = (
            session_id, row.version, new_epoch, row.version, ttl,
            None if ttl is None else now + ttl, now,
        )  # fmt: skip
        created = yield Statement(_CREATE_SESSION, session)
        if created.rowcount != 1:
            found = (yield Statement(self.head_for_update, (session_id,))).rows
            head = _head_from_row(session_id, found[0]) if found else None
            if head is not None and (head.expires_at is None or head.expires_at > now):
                raise ConflictError(session_id, None, head.version)
            yield Statement(_DELETE_CHECKPOINTS, (session_id,))
            yield Statement(_REPLACE_SESSION, session)
        yield self.insert_checkpoint(session_id, row)

    def insert_checkpoint(self, session_id: str, row: StoredCheckpoint) -> Statement:
        return Statement(_INSERT_CHECKPOINT, (session_id, *_checkpoint_values(self.dialect, row)))

    def history(self, session_id: str, now: float) -> Plan[list[StoredCheckpoint]]:
        found = (yield Statement(self.history_sql, (session_id,))).rows
        if not found:
            return []
        _live_head(session_id, found[0], now)
        return [
            _checkpoint_from_row(values[5:15], int(values[15]))
            for values in found
            if values[5] is not None
        ]

    def mark(self, session_id: str, version: int, good: bool | None) -> Plan[bool]:
        marked = yield Statement(
            "UPDATE keel_state_checkpoints SET good = ? WHERE session_id = ? AND version = ?",
            (None if good is None else self.dialect.flag(good), session_id, version),
        )
        return marked.rowcount == 1

    def rewrite(
        self, session_id: str, delete: list[int], replace: list[StoredCheckpoint]
    ) -> Plan[None]:
        found = (yield Statement(self.head_for_update, (session_id,))).rows
        if not found:
            return
        if replace:
            yield Statement(
                "UPDATE keel_state_checkpoints SET kind = ?, payload = ? "
                "WHERE session_id = ? AND version = ?",
                [(row.kind, row.payload, session_id, row.version) for row in replace],
                many=True,
            )
        head_version = int(found[0][0])
        doomed = [version for version in delete if version != head_version]
        for chunk in _chunks(doomed):
            versions, params = self.dialect.one_of("version", chunk)
            yield Statement(
                f"DELETE FROM keel_state_checkpoints WHERE session_id = ? AND {versions}",
                (session_id, *params),
            )

    @staticmethod
    def delete(session_id: str) -> Plan[bool]:
        yield Statement(_DELETE_CHECKPOINTS, (session_id,))
        deleted = yield Statement(
            "DELETE FROM keel_state_sessions WHERE session_id = ?", (session_id,)
        )
        # Its lease given back (`release_lock` expires the row in place) goes with it: no row
        # naming the session outlives it; a lease still held is its holder's.
        yield Statement(
            "DELETE FROM keel_state_locks WHERE key = ? AND expires_at <= 0",
            (LEASE_KEY_PREFIX + session_id,),
        )
        return deleted.rowcount == 1

    @staticmethod
    def sessions() -> Plan[list[str]]:
        found = yield Statement("SELECT session_id FROM keel_state_sessions ORDER BY session_id")
        return [str(value) for (value,) in found.rows]

    def purge_expired(self, now: float) -> Plan[list[str]]:
        # The heads go first: a writer sliding one's expiry meanwhile waits for its row, then
        # finds it gone, so no live session ever loses its checkpoints.
        purged = yield Statement(
            "DELETE FROM keel_state_sessions WHERE expires_at IS NOT NULL AND expires_at <= ? "
            "RETURNING session_id",
            (now,),
        )
        expired = sorted(str(value) for (value,) in purged.rows)
        for chunk in _chunks(expired):
            sessions, params = self.dialect.one_of("session_id", chunk)
            yield Statement(f"DELETE FROM keel_state_checkpoints WHERE {sessions}", params)
        yield Statement("DELETE FROM keel_state_locks WHERE expires_at <= ?", (now,))
        return expired

    @staticmethod
    def acquire_lock(key: str, owner: str, ttl: float, now: float) -> Plan[bool]:
        taken = yield Statement(_LOCK, (key, owner, now + ttl, now))
        return taken.rowcount == 1

    @staticmethod
    def lock_holder(key: str, now: float) -> Plan[str | None]:
        found = yield Statement(
            "SELECT owner FROM keel_state_locks WHERE key = ? AND expires_at > ?", (key, now)
        )
        return str(found.rows[0][0]) if found.rows else None

    @staticmethod
    def release_lock(key: str, owner: str) -> Plan[bool]:
        # Expired in place, not deleted: the row's page alone is written (a delete rewrites
        # the key's index too, and the session's next turn inserts it again: two pages a turn
        # on SQLite's log). A released row reads as no lease (`lock_holder`), any owner takes
        # it (`_LOCK`), and `vacuum` deletes it with the other expired ones.
        released = yield Statement(
            "UPDATE keel_state_locks SET expires_at = 0 "
            "WHERE key = ? AND owner = ? AND expires_at > 0",
            (key, owner),
        )
        return released.rowcount == 1


class SQLStateBackend(StateBackend):
    """Checkpoints in a SQL database: SQLite (the embedded default) or PostgreSQL.

    Each operation is a plan, run by the database's `run` (the sync methods) or `arun` (their
    async twins: inline on the loop or on keel's blocking pool for SQLite, as its `acall`
    decides; natively on the loop's own connections for PostgreSQL). Compare-and-set holds
    across threads and processes; PostgreSQL's statements are safe behind a transaction-mode
    pooler (no prepared statements, no session-level locks or settings).

    Args:
        db: the [`SQLiteDatabase`][] or [`PostgresDatabase`][] to share (left open by
            `close`); the ``state`` migrations are applied here.

    Raises:
        BackendUnavailableError: the server cannot be reached.
        SchemaVersionError: the database has a newer ``state`` schema than this code.
    """

    def __init__(self, db: SQLiteDatabase | PostgresDatabase) -> None:
        self.db = db
        self.dialect: SqlDialect = db.dialect
        self.name = self.dialect.name
        self._engine = _ENGINES[self.dialect.name]
        self._plans = _Plans(self.dialect, self._engine)
        db.migrate(self._engine.migrations)

    # --- the interface: each method runs its plan, sync or async ------------------------------

    def read_chain(self, session_id: str, version: int | None, now: float) -> Chain | None:
        plan = lambda: self._plans.read_chain(session_id, version, now, None)  # noqa: E731
        return self.db.run(plan, write=False)

    async def aread_chain(self, session_id: str, version: int | None, now: float) -> Chain | None:
        plan = lambda: self._plans.read_chain(session_id, version, now, None)  # noqa: E731
        return await self.db.arun(plan, write=False)

    def read_head_chain(
        self, session_id: str, now: float, known_version: int, known_epoch: str
    ) -> Chain | None:
        known = (known_version, known_epoch)
        plan = lambda: self._plans.read_chain(session_id, None, now, known)  # noqa: E731
        return self.db.run(plan, write=False)

    async def aread_head_chain(
        self, session_id: str, now: float, known_version: int, known_epoch: str
    ) -> Chain | None:
        known = (known_version, known_epoch)
        plan = lambda: self._plans.read_chain(session_id, None, now, known)  # noqa: E731
        return await self.db.arun(plan, write=False)

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
        expected = (expected_version, expected_epoch)
        plan, write = self._plans.write(session_id, row, expected, new_epoch, ttl, now)
        self.db.run(plan, write=write)

    async def awrite(
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
        expected = (expected_version, expected_epoch)
        plan, write = self._plans.write(session_id, row, expected, new_epoch, ttl, now)
        await self.db.arun(plan, write=write)

    def history(self, session_id: str, now: float) -> list[StoredCheckpoint]:
        return self.db.run(lambda: self._plans.history(session_id, now), write=False)

    async def ahistory(self, session_id: str, now: float) -> list[StoredCheckpoint]:
        plan = lambda: self._plans.history(session_id, now)  # noqa: E731
        return await self.db.arun(plan, write=False)

    def mark(self, session_id: str, version: int, good: bool | None) -> bool:
        plan = lambda: self._plans.mark(session_id, version, good)  # noqa: E731
        return self.db.run(plan, write="statement")

    async def amark(self, session_id: str, version: int, good: bool | None) -> bool:
        plan = lambda: self._plans.mark(session_id, version, good)  # noqa: E731
        return await self.db.arun(plan, write="statement")

    def rewrite(self, session_id: str, delete: list[int], replace: list[StoredCheckpoint]) -> None:
        self.db.run(lambda: self._plans.rewrite(session_id, delete, replace))

    def delete(self, session_id: str) -> bool:
        return self.db.run(lambda: self._plans.delete(session_id))

    async def adelete(self, session_id: str) -> bool:
        return await self.db.arun(lambda: self._plans.delete(session_id))

    def sessions(self) -> list[str]:
        return self.db.run(self._plans.sessions, write=False)

    def purge_expired(self, now: float) -> list[str]:
        return self.db.run(lambda: self._plans.purge_expired(now))

    def acquire_lock(self, key: str, owner: str, ttl: float, now: float) -> bool:
        plan = lambda: self._plans.acquire_lock(key, owner, ttl, now)  # noqa: E731
        return self.db.run(plan, write="statement")

    async def aacquire_lock(self, key: str, owner: str, ttl: float, now: float) -> bool:
        plan = lambda: self._plans.acquire_lock(key, owner, ttl, now)  # noqa: E731
        return await self.db.arun(plan, write="statement")

    def lock_holder(self, key: str, now: float) -> str | None:
        return self.db.run(lambda: self._plans.lock_holder(key, now), write=False)

    async def alock_holder(self, key: str, now: float) -> str | None:
        return await self.db.arun(lambda: self._plans.lock_holder(key, now), write=False)

    def release_lock(self, key: str, owner: str) -> bool:
        plan = lambda: self._plans.release_lock(key, owner)  # noqa: E731
        return self.db.run(plan, write="statement")

    async def arelease_lock(self, key: str, owner: str) -> bool:
        plan = lambda: self._plans.release_lock(key, owner)  # noqa: E731
        return await self.db.arun(plan, write="statement")

    def storage_bytes(self) -> int:
        return self._engine.storage_bytes(self.db)

    def close(self) -> None:
        """Nothing to release: the database is the caller's to close."""

    async def aclose(self) -> None:
        """Nothing to release: the database is the caller's to close."""

    # --- a user's erasure (keel.stores._erasure): sessions found by their tenant's prefix --------

    def sessions_under(self, prefix: str) -> list[str]:
        return self.db.run(lambda: _sessions_under(prefix), write=False)

    def erase_sessions(self, session_ids: Sequence[str]) -> dict[str, int]:
        ids = list(dict.fromkeys(session_ids))
        return self.db.run(lambda: _erase_sessions(self.dialect, ids))

    def __repr__(self) -> str:
        return f"SQLStateBackend({self.db!r})"


# --- what the engines do differently -----------------------------------------------------------

# SQLite: the compare-and-set is the UPDATE itself, inside the append's write transaction: it
# moves only the head this writer read (version, incarnation, alive), so no row is written past
# a stale head whatever the checkpoint table would have said.
_SQLITE_MOVE_HEAD = (
    "UPDATE keel_state_sessions SET version = ?, updated_at = ?, "
    "last_full = CASE WHEN ? THEN ? ELSE last_full END, "
    "expires_at = CASE WHEN ttl IS NULL THEN NULL ELSE ? + ttl END "
    "WHERE session_id = ? AND version = ? AND epoch IS ? "
    "AND (expires_at IS NULL OR expires_at > ?)"
)


def _sqlite_append(plans: _Plans, append: _Append) -> Plan[None]:
    session_id, row = append.session_id, append.row
    moved = yield Statement(
        _SQLITE_MOVE_HEAD,
        (
            row.version, append.now, row.kind == "full", row.version, append.now,
            session_id, append.expected_version, append.expected_epoch, append.now,
        ),
    )  # fmt: skip
    if moved.rowcount != 1:
        # Read only on a conflict: the transaction holds the write lock, so the head is still
        # the one the UPDATE did not move (a success, nearly every write, reads nothing).
        found = (yield Statement(_HEAD, (session_id,))).rows
        head_version = int(found[0][0]) if found else None
        raise ConflictError(session_id, append.expected_version, head_version)
    yield plans.insert_checkpoint(session_id, row)


def _sqlite_storage_bytes(database: SQLiteDatabase | PostgresDatabase) -> int:
    def pages() -> Plan[int]:
        found = yield Statement(
            "SELECT sum(pgsize) FROM dbstat WHERE name LIKE 'keel_state%' "
            "OR name LIKE 'sqlite_autoindex_keel_state%'"
        )
        return int(found.rows[0][0] or 0)

    def whole_file() -> Plan[int]:
        count = (yield Statement("PRAGMA page_count")).rows[0][0]
        size = (yield Statement("PRAGMA page_size")).rows[0][0]
        return int(count) * int(size)

    try:
        return database.run(pages, write=False)
    except StoreError:
        return database.run(whole_file, write=False)  # dbstat is not compiled in


# PostgreSQL: the version check, the head move and the row insert in one statement: atomic in
# autocommit, one round trip. A concurrent writer blocks on the head's row lock and then finds
# the version moved on, so its insert selects nothing.
_POSTGRES_APPEND = f"""
WITH head AS (
    UPDATE keel_state_sessions SET
        version = %(version)s::integer,
        updated_at = %(now)s::double precision,
        last_full = CASE WHEN %(full)s::boolean THEN %(version)s::integer ELSE last_full END,
        expires_at = CASE WHEN ttl IS NULL THEN NULL ELSE %(now)s::double precision + ttl END
    WHERE session_id = %(sid)s AND version = %(expected)s::integer AND epoch = %(epoch)s
        AND (expires_at IS NULL OR expires_at > %(now)s::double precision)
    RETURNING session_id
)
INSERT INTO keel_state_checkpoints (session_id, {_CHECKPOINT_COLUMNS})
SELECT head.session_id, %(version)s::integer, %(created_at)s::double precision,
    %(step)s::integer, %(reason)s::text, %(kind)s::text, %(payload)s::text,
    %(schema_name)s::text, %(schema_version)s::integer, %(good)s::boolean,
    %(forked_from)s::text
FROM head
"""


def _postgres_append(plans: _Plans, append: _Append) -> Plan[None]:
    row = append.row
    params = {
        "sid": append.session_id,
        "expected": append.expected_version,
        "epoch": append.expected_epoch,
        "now": append.now,
        "full": row.kind == "full",
        **{name: getattr(row, name) for name in _CHECKPOINT_NAMES},
    }
    if (yield Statement(_POSTGRES_APPEND, params)).rowcount == 1:
        return
    found = yield Statement(
        "SELECT version FROM keel_state_sessions WHERE session_id = ?", (append.session_id,)
    )
    head_version = int(found.rows[0][0]) if found.rows else None
    raise ConflictError(append.session_id, append.expected_version, head_version)


def _postgres_storage_bytes(database: SQLiteDatabase | PostgresDatabase) -> int:
    def size() -> Plan[int]:
        found = yield Statement(
            "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
            "WHERE c.relkind = 'r' AND c.relname LIKE 'keel_state%%'"
        )
        return int(found.rows[0][0]) if found.rows else 0

    return database.run(size, write=False)


@dataclass(frozen=True, slots=True)
class _Engine:
    """What one engine does its own way (the module's docstring says why)."""

    migrations: MigrationSet
    append: Callable[[_Plans, _Append], Plan[None]]
    """The compare-and-set append: raises ConflictError, with nothing written, when the head
    is not the one expected."""
    append_write: Write
    """The append's ``write`` flag: a write transaction (two statements), or one statement."""
    storage_bytes: Callable[[SQLiteDatabase | PostgresDatabase], int]


_ENGINES = {
    SQLITE.name: _Engine(STATE_MIGRATIONS, _sqlite_append, True, _sqlite_storage_bytes),
    POSTGRES.name: _Engine(
        POSTGRES_STATE_MIGRATIONS, _postgres_append, "statement", _postgres_storage_bytes
    ),
}


def _sessions_under(prefix: str) -> Plan[list[str]]:
    under, params = starts_with("session_id", prefix)
    found = yield Statement(f"SELECT session_id FROM keel_state_sessions WHERE {under}", params)
    return sorted(str(value) for (value,) in found.rows)


def _erase_sessions(dialect: SqlDialect, session_ids: list[str]) -> Plan[dict[str, int]]:
    """Every checkpoint, head and lease of ``session_ids``, in one transaction."""
    counts = {"sessions": 0, "checkpoints": 0, "leases": 0}
    for batch in dialect.batches(session_ids):
        sessions, params = dialect.one_of("session_id", batch)
        delete = "DELETE FROM keel_state_{} WHERE " + sessions
        yield from count_deleted(counts, "checkpoints", delete.format("checkpoints"), params)
        yield from count_deleted(counts, "sessions", delete.format("sessions"), params)
        leases, params = dialect.one_of("key", [LEASE_KEY_PREFIX + key for key in batch])
        # A lease given back stays as a row that holds nothing (expired in place): removed
        # uncounted, so the count is of leases held, as on Redis, whose given-back lease is gone.
        delete = f"DELETE FROM keel_state_locks WHERE {leases}"
        yield Statement(delete + " AND expires_at <= 0", tuple(params))
        yield from count_deleted(counts, "leases", delete, params)
    return counts
