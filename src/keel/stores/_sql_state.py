"""The SQL state backends' statements, written once for SQLite and PostgreSQL over a
`SqlDialect`.

Every operation is a plan (``_sql_plan.py``): its statements and the logic between them,
written once and run by the sync runner or the async one. Each engine's subclass says how a
scope's cursor is opened (a write transaction, one statement, a consistent snapshot), how a
chain is read and how an append's compare-and-set is made: that is where the engines differ
(SQLite reads in a WAL snapshot and writes under its one write lock; PostgreSQL reads and
appends in one statement each, in autocommit, behind a pooler).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

from keel.errors import ConflictError, ExpiredError
from keel.state._backend import Chain, SessionHead, StateBackend, StoredCheckpoint
from keel.stores._dialect import SqlDialect
from keel.stores._migrations import Migration, MigrationSet
from keel.stores._sql_plan import Plan, Statement, run_plan

__all__ = [
    "CHECKPOINT_COLUMNS",
    "HEAD",
    "Append",
    "SQLStateBackend",
    "Scope",
    "checkpoint_from_row",
    "checkpoint_values",
    "head_from_row",
    "live_head",
    "state_migrations",
]

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


class Scope(Enum):
    """What a plan's statements run in."""

    WRITE = "write"
    """One write transaction."""
    WRITE_ONE = "write_one"
    """One write statement (atomic on its own where the engine allows: autocommit)."""
    READ = "read"
    """One read statement."""
    SNAPSHOT = "snapshot"
    """Several reads that see one consistent version of the data."""
    CHAIN = "chain"
    """The engine's chain read (`SQLStateBackend._chain`)."""
    APPEND = "append"
    """The engine's compare-and-set append (`SQLStateBackend._append`)."""


@dataclass(frozen=True, slots=True)
class Append:
    """An append: ``row`` goes after the head if that is still ``expected_version`` of
    incarnation ``expected_epoch``."""

    session_id: str
    row: StoredCheckpoint
    expected_version: int
    expected_epoch: str | None
    now: float


CHECKPOINT_COLUMNS = (
    "version, created_at, step, reason, kind, payload, schema_name, schema_version, good, "
    "forked_from"
)
HEAD = (
    "SELECT version, epoch, last_full, ttl, expires_at FROM keel_state_sessions "
    "WHERE session_id = ?"
)
"""A session's head row (see `head_from_row`)."""
_INSERT_CHECKPOINT = (
    f"INSERT INTO keel_state_checkpoints (session_id, {CHECKPOINT_COLUMNS}) "
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
# Ids per DELETE ... IN (...): far below any engine's limit on parameters.
_CHUNK = 500


def checkpoint_from_row(values: Sequence[Any], payload_size: int | None = None) -> StoredCheckpoint:
    """A checkpoint from its `CHECKPOINT_COLUMNS`."""
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


def checkpoint_values(dialect: SqlDialect, row: StoredCheckpoint) -> tuple[Any, ...]:
    """A checkpoint's `CHECKPOINT_COLUMNS` as parameters."""
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


def head_from_row(session_id: str, found: Sequence[Any]) -> SessionHead:
    """A session's head from the columns of `HEAD`."""
    return SessionHead(
        session_id=session_id,
        version=int(found[0]),
        epoch=str(found[1]),
        last_full=int(found[2]),
        ttl=None if found[3] is None else float(found[3]),
        expires_at=None if found[4] is None else float(found[4]),
    )


def live_head(session_id: str, found: Sequence[Any], now: float) -> SessionHead:
    """The head in the columns of `HEAD`, alive at ``now``.

    Raises:
        ExpiredError: the session's time to live has passed.
    """
    head = head_from_row(session_id, found)
    if head.expires_at is not None and head.expires_at <= now:
        raise ExpiredError(
            f"session {head.session_id!r} expired {now - head.expires_at:.1f}s ago "
            f"(version {head.version}); it reads as absent"
        )
    return head


def _chunks(values: Sequence[Any]) -> Iterator[Sequence[Any]]:
    for start in range(0, len(values), _CHUNK):
        yield values[start : start + _CHUNK]


class _Plans:
    """The plans every SQL engine shares, in one dialect."""

    def __init__(self, dialect: SqlDialect) -> None:
        self.dialect = dialect
        self.head_for_update = HEAD + dialect.row_lock

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
            session_id,
            row.version,
            new_epoch,
            row.version,
            ttl,
            None if ttl is None else now + ttl,
            now,
        )
        created = yield Statement(_CREATE_SESSION, session)
        if created.rowcount != 1:
            found = (yield Statement(self.head_for_update, (session_id,))).rows
            head = head_from_row(session_id, found[0]) if found else None
            if head is not None and (head.expires_at is None or head.expires_at > now):
                raise ConflictError(session_id, None, head.version)
            yield Statement(_DELETE_CHECKPOINTS, (session_id,))
            yield Statement(_REPLACE_SESSION, session)
        yield self.insert_checkpoint(session_id, row)

    def insert_checkpoint(self, session_id: str, row: StoredCheckpoint) -> Statement:
        return Statement(_INSERT_CHECKPOINT, (session_id, *checkpoint_values(self.dialect, row)))

    def history(self, session_id: str, now: float) -> Plan[list[StoredCheckpoint]]:
        found = (yield Statement(HEAD, (session_id,))).rows
        if not found:
            return []
        live_head(session_id, found[0], now)
        size = self.dialect.byte_length.format("payload")
        listed = yield Statement(
            "SELECT version, created_at, step, reason, kind, '', schema_name, schema_version, "
            f"good, forked_from, {size} FROM keel_state_checkpoints WHERE session_id = ? "
            "ORDER BY version",
            (session_id,),
        )
        return [checkpoint_from_row(values[:10], int(values[10])) for values in listed.rows]

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

    def delete(self, session_id: str) -> Plan[bool]:
        yield Statement(_DELETE_CHECKPOINTS, (session_id,))
        deleted = yield Statement(
            "DELETE FROM keel_state_sessions WHERE session_id = ?", (session_id,)
        )
        return deleted.rowcount == 1

    def sessions(self) -> Plan[list[str]]:
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

    def acquire_lock(self, key: str, owner: str, ttl: float, now: float) -> Plan[bool]:
        taken = yield Statement(_LOCK, (key, owner, now + ttl, now))
        return taken.rowcount == 1

    def lock_holder(self, key: str, now: float) -> Plan[str | None]:
        found = yield Statement(
            "SELECT owner FROM keel_state_locks WHERE key = ? AND expires_at > ?", (key, now)
        )
        return str(found.rows[0][0]) if found.rows else None

    def release_lock(self, key: str, owner: str) -> Plan[bool]:
        released = yield Statement(
            "DELETE FROM keel_state_locks WHERE key = ? AND owner = ?", (key, owner)
        )
        return released.rowcount == 1


class SQLStateBackend(StateBackend):
    """Checkpoints over SQL: each operation is a plan, run in the scope a subclass opens.

    The async twins run the same plans through `_arun` (by default the sync runner,
    through `_run_twin`; an engine with an async driver runs them natively).
    """

    dialect: SqlDialect

    def __init__(self) -> None:
        self._plans = _Plans(self.dialect)

    @abstractmethod
    def _cursor(self, scope: Scope) -> AbstractContextManager[Any]:
        """A cursor for ``scope``, driver errors translated."""

    @abstractmethod
    def _chain(
        self, session_id: str, version: int | None, now: float, known: tuple[int, str] | None
    ) -> Plan[Chain | None]:
        """How this engine reads a chain (``known``: the head the reader holds, if any)."""

    @abstractmethod
    def _append(self, append: Append) -> Plan[None]:
        """How this engine appends (its compare-and-set): raises ConflictError, with nothing
        written, when the head is not the one expected."""

    def _run(self, scope: Scope, plan: Callable[[], Plan[_T]]) -> _T:
        """Run the plan ``plan()`` builds (built afresh, so a call that moves may run again)."""
        with self._cursor(scope) as cursor:
            return run_plan(cursor, self.dialect, plan())

    async def _arun(self, scope: Scope, plan: Callable[[], Plan[_T]]) -> _T:
        """Async twin of `_run`."""
        return await self._run_twin(lambda: self._run(scope, plan))

    def _write(
        self,
        session_id: str,
        row: StoredCheckpoint,
        expected: tuple[int | None, str | None],
        new_epoch: str | None,
        ttl: float | None,
        now: float,
    ) -> tuple[Scope, Callable[[], Plan[None]]]:
        """The scope and plan of `write`: a create, or an append."""
        version, epoch = expected
        if version is None:
            return Scope.WRITE, lambda: self._plans.create(session_id, row, new_epoch, ttl, now)
        append = Append(session_id, row, version, epoch, now)
        return Scope.APPEND, lambda: self._append(append)

    def read_chain(self, session_id: str, version: int | None, now: float) -> Chain | None:
        return self._run(Scope.CHAIN, lambda: self._chain(session_id, version, now, None))

    def read_head_chain(
        self, session_id: str, now: float, known_version: int, known_epoch: str
    ) -> Chain | None:
        known = (known_version, known_epoch)
        return self._run(Scope.CHAIN, lambda: self._chain(session_id, None, now, known))

    async def aread_chain(self, session_id: str, version: int | None, now: float) -> Chain | None:
        plan = lambda: self._chain(session_id, version, now, None)  # noqa: E731
        return await self._arun(Scope.CHAIN, plan)

    async def aread_head_chain(
        self, session_id: str, now: float, known_version: int, known_epoch: str
    ) -> Chain | None:
        known = (known_version, known_epoch)
        plan = lambda: self._chain(session_id, None, now, known)  # noqa: E731
        return await self._arun(Scope.CHAIN, plan)

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
        self._run(*self._write(session_id, row, expected, new_epoch, ttl, now))

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
        await self._arun(*self._write(session_id, row, expected, new_epoch, ttl, now))

    def history(self, session_id: str, now: float) -> list[StoredCheckpoint]:
        return self._run(Scope.SNAPSHOT, lambda: self._plans.history(session_id, now))

    async def ahistory(self, session_id: str, now: float) -> list[StoredCheckpoint]:
        return await self._arun(Scope.SNAPSHOT, lambda: self._plans.history(session_id, now))

    def mark(self, session_id: str, version: int, good: bool | None) -> bool:
        return self._run(Scope.WRITE_ONE, lambda: self._plans.mark(session_id, version, good))

    async def amark(self, session_id: str, version: int, good: bool | None) -> bool:
        plan = lambda: self._plans.mark(session_id, version, good)  # noqa: E731
        return await self._arun(Scope.WRITE_ONE, plan)

    def rewrite(self, session_id: str, delete: list[int], replace: list[StoredCheckpoint]) -> None:
        self._run(Scope.WRITE, lambda: self._plans.rewrite(session_id, delete, replace))

    def delete(self, session_id: str) -> bool:
        return self._run(Scope.WRITE, lambda: self._plans.delete(session_id))

    async def adelete(self, session_id: str) -> bool:
        return await self._arun(Scope.WRITE, lambda: self._plans.delete(session_id))

    def sessions(self) -> list[str]:
        return self._run(Scope.READ, self._plans.sessions)

    def purge_expired(self, now: float) -> list[str]:
        return self._run(Scope.WRITE, lambda: self._plans.purge_expired(now))

    def acquire_lock(self, key: str, owner: str, ttl: float, now: float) -> bool:
        plan = lambda: self._plans.acquire_lock(key, owner, ttl, now)  # noqa: E731
        return self._run(Scope.WRITE_ONE, plan)

    async def aacquire_lock(self, key: str, owner: str, ttl: float, now: float) -> bool:
        plan = lambda: self._plans.acquire_lock(key, owner, ttl, now)  # noqa: E731
        return await self._arun(Scope.WRITE_ONE, plan)

    def lock_holder(self, key: str, now: float) -> str | None:
        return self._run(Scope.READ, lambda: self._plans.lock_holder(key, now))

    async def alock_holder(self, key: str, now: float) -> str | None:
        return await self._arun(Scope.READ, lambda: self._plans.lock_holder(key, now))

    def release_lock(self, key: str, owner: str) -> bool:
        return self._run(Scope.WRITE_ONE, lambda: self._plans.release_lock(key, owner))

    async def arelease_lock(self, key: str, owner: str) -> bool:
        return await self._arun(Scope.WRITE_ONE, lambda: self._plans.release_lock(key, owner))

    def close(self) -> None:
        """Nothing to release: the database is the caller's to close."""
