"""State checkpoints in PostgreSQL (on a [`PostgresDatabase`][]); the SQL is
``_sql_state.py``'s, the chain read and the append are this engine's own.

Safe behind a transaction-mode connection pooler (PgBouncer): no server-side prepared
statements (the database's connections never prepare), no session-level advisory locks or
settings; every operation is one short transaction. Compare-and-set is an
``UPDATE ... WHERE version = %s`` whose row lock serialises concurrent writers; the loser's
update matches nothing and its whole transaction rolls back.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager, asynccontextmanager, contextmanager
from typing import Any, TypeVar

from keel.errors import ConflictError
from keel.state._backend import Chain
from keel.stores._dialect import POSTGRES
from keel.stores._postgres import PostgresDatabase, apply_migrations
from keel.stores._sql_plan import Plan, Result, Statement, arun_plan
from keel.stores._sql_state import (
    CHECKPOINT_COLUMNS,
    Append,
    Scope,
    SQLStateBackend,
    checkpoint_from_row,
    live_head,
    state_migrations,
)

__all__ = ["POSTGRES_STATE_MIGRATIONS", "PostgresStateBackend"]

POSTGRES_STATE_MIGRATIONS = state_migrations(POSTGRES)

_CHAIN_COLUMNS = ", ".join("c." + name.strip() for name in CHECKPOINT_COLUMNS.split(","))

# The head and its chain up to %(v)s (the head if NULL) in one statement, so one snapshot.
_READ_CHAIN = f"""
WITH h AS (
    SELECT version, epoch, last_full, ttl, expires_at FROM keel_state_sessions
    WHERE session_id = %(sid)s
), t AS (
    SELECT coalesce(%(v)s::integer, h.version) AS target FROM h
), b AS (
    SELECT max(c.version) AS base FROM keel_state_checkpoints c, t
    WHERE c.session_id = %(sid)s AND c.kind = 'full' AND c.version <= t.target
)
SELECT h.version, h.epoch, h.last_full, h.ttl, h.expires_at, t.target, {_CHAIN_COLUMNS}
FROM h CROSS JOIN t LEFT JOIN b ON true
LEFT JOIN keel_state_checkpoints c
    ON c.session_id = %(sid)s AND c.version >= b.base AND c.version <= t.target
    AND t.target <= h.version AND t.target >= 1
ORDER BY c.version
"""

# The chain of the head for a reader that holds version %(kv)s of incarnation %(ke)s: while
# that is still the head, the head row alone (the reader knows its state; a flat cost however
# long the chain grows); otherwise the whole chain, as _READ_CHAIN. One statement, one snapshot.
_READ_HEAD_CHAIN = f"""
WITH h AS (
    SELECT version, epoch, last_full, ttl, expires_at FROM keel_state_sessions
    WHERE session_id = %(sid)s
), b AS (
    SELECT CASE WHEN h.version = %(kv)s::integer AND h.epoch = %(ke)s::text THEN h.version
        ELSE (SELECT max(c.version) FROM keel_state_checkpoints c
              WHERE c.session_id = %(sid)s AND c.kind = 'full' AND c.version <= h.version)
        END AS base
    FROM h
)
SELECT h.version, h.epoch, h.last_full, h.ttl, h.expires_at, h.version AS target,
       {_CHAIN_COLUMNS}
FROM h LEFT JOIN b ON true
LEFT JOIN keel_state_checkpoints c
    ON c.session_id = %(sid)s AND c.version >= b.base AND c.version <= h.version
    AND h.version >= 1
ORDER BY c.version
"""

# The version check, the head move and the row insert in one statement: atomic in autocommit,
# one round trip. A concurrent writer blocks on the head's row lock and then finds the version
# moved on, so its insert selects nothing.
_APPEND = f"""
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
INSERT INTO keel_state_checkpoints (session_id, {CHECKPOINT_COLUMNS})
SELECT head.session_id, %(version)s::integer, %(created_at)s::double precision,
    %(step)s::integer, %(reason)s::text, %(kind)s::text, %(payload)s::text,
    %(schema_name)s::text, %(schema_version)s::integer, %(good)s::boolean,
    %(forked_from)s::text
FROM head
"""

_HEAD_VERSION = "SELECT version FROM keel_state_sessions WHERE session_id = ?"

_T = TypeVar("_T")
_ONE_STATEMENT = frozenset({Scope.READ, Scope.WRITE_ONE, Scope.CHAIN, Scope.APPEND})


def _chain_from(
    session_id: str, found: list[Any], now: float, known: tuple[int, str] | None
) -> Chain | None:
    """The chain in the rows of ``_READ_CHAIN`` or ``_READ_HEAD_CHAIN``."""
    if not found:
        return None
    first = found[0]
    head = live_head(session_id, first, now)
    if first[6] is None:  # no such version stored
        return None
    target = int(first[5])
    rows = [checkpoint_from_row(values[6:]) for values in found]
    if known == (head.version, head.epoch) and len(rows) == 1 and rows[0].version == target:
        return Chain(head, rows)  # the head the reader holds, alone
    if not rows or rows[-1].version != target or rows[0].kind != "full":
        return None
    if len(rows) != target - rows[0].version + 1:
        return None
    return Chain(head, rows)


class PostgresStateBackend(SQLStateBackend):
    """Checkpoints in PostgreSQL.

    Args:
        database: the [`PostgresDatabase`][] to share (left open by
            `close`); the ``state`` migrations are applied here.

    Raises:
        BackendUnavailableError: the server cannot be reached.
    """

    name = "postgres"
    dialect = POSTGRES

    def __init__(self, database: PostgresDatabase) -> None:
        super().__init__()
        self.database = database
        self.url = database.url
        self.setup()

    def setup(self) -> None:
        """Create the tables (idempotent) and record the ``state`` schema version.

        Raises:
            SchemaVersionError: the database has a newer ``state`` schema than this code.
        """
        with self.database.transaction() as conn:
            apply_migrations(conn, POSTGRES_STATE_MIGRATIONS)

    def _scope(self, scope: Scope) -> AbstractContextManager[Any]:
        # One statement runs in autocommit (itself atomic): one round trip, no BEGIN/COMMIT.
        # The chain read and the append are one statement each.
        one = scope in _ONE_STATEMENT
        return self.database.connection() if one else self.database.transaction()

    @contextmanager
    def _cursor(self, scope: Scope) -> Iterator[Any]:
        with self._scope(scope) as conn, conn.cursor() as cursor:
            if scope is Scope.SNAPSHOT:
                cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            yield cursor

    @asynccontextmanager
    async def _acursor(self, scope: Scope) -> AsyncIterator[Any]:
        one = scope in _ONE_STATEMENT
        opened = self.database.aconnection() if one else self.database.atransaction()
        async with opened as conn, conn.cursor() as cursor:
            if scope is Scope.SNAPSHOT:
                await cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            yield cursor

    async def _arun(self, scope: Scope, plan: Callable[[], Plan[_T]]) -> _T:
        # Natively on the event loop's own connections: a worker thread would wait for the
        # GIL while the loop serves other sessions.
        async with self._acursor(scope) as cursor:
            return await arun_plan(cursor, self.dialect, plan())

    def _chain(
        self, session_id: str, version: int | None, now: float, known: tuple[int, str] | None
    ) -> Plan[Chain | None]:
        if known is None:
            found: Result = yield Statement(_READ_CHAIN, {"sid": session_id, "v": version})
        else:
            params = {"sid": session_id, "kv": known[0], "ke": known[1]}
            found = yield Statement(_READ_HEAD_CHAIN, params)
        return _chain_from(session_id, found.rows, now, known)

    def _append(self, append: Append) -> Plan[None]:
        row = append.row
        params = {
            "sid": append.session_id,
            "expected": append.expected_version,
            "epoch": append.expected_epoch,
            "now": append.now,
            "full": row.kind == "full",
            "version": row.version,
            "created_at": row.created_at,
            "step": row.step,
            "reason": row.reason,
            "kind": row.kind,
            "payload": row.payload,
            "schema_name": row.schema_name,
            "schema_version": row.schema_version,
            "good": row.good,
            "forked_from": row.forked_from,
        }
        if (yield Statement(_APPEND, params)).rowcount == 1:
            return
        found = yield Statement(_HEAD_VERSION, (append.session_id,))
        head_version = int(found.rows[0][0]) if found.rows else None
        raise ConflictError(append.session_id, append.expected_version, head_version)

    def storage_bytes(self) -> int:
        with self.database.connection() as conn:
            found = conn.execute(
                "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
                "WHERE c.relkind = 'r' AND c.relname LIKE 'keel_state%%'"
            ).fetchone()
        return int(found[0]) if found else 0
