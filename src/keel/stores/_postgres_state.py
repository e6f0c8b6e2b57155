"""State checkpoints in PostgreSQL (on a :class:`~keel.stores.PostgresDatabase`).

Safe behind a transaction-mode connection pooler (PgBouncer): no server-side prepared
statements (the database's connections never prepare), no session-level advisory locks or
settings; every operation is one short transaction. Compare-and-set is an
``UPDATE ... WHERE version = %s`` whose row lock serialises concurrent writers; the loser's
update matches nothing and its whole transaction rolls back.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from keel.errors import ConflictError, ExpiredError
from keel.state._backend import Chain, SessionHead, StateBackend, StoredCheckpoint
from keel.stores._migrations import Migration, MigrationSet
from keel.stores._postgres import PostgresDatabase, apply_migrations

__all__ = ["POSTGRES_STATE_MIGRATIONS", "POSTGRES_STATE_SCHEMA", "PostgresStateBackend"]

POSTGRES_STATE_SCHEMA = (
    """
    CREATE TABLE IF NOT EXISTS keel_schema (
        component TEXT PRIMARY KEY,
        version INTEGER NOT NULL,
        applied_at DOUBLE PRECISION NOT NULL
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS keel_state_sessions (
        session_id TEXT PRIMARY KEY,
        version INTEGER NOT NULL,
        epoch TEXT NOT NULL,
        last_full INTEGER NOT NULL,
        ttl DOUBLE PRECISION,
        expires_at DOUBLE PRECISION,
        updated_at DOUBLE PRECISION NOT NULL
    )
    """,
    """
    CREATE INDEX IF NOT EXISTS keel_state_sessions_expiry
        ON keel_state_sessions (expires_at) WHERE expires_at IS NOT NULL
    """,
    """
    CREATE TABLE IF NOT EXISTS keel_state_checkpoints (
        session_id TEXT NOT NULL,
        version INTEGER NOT NULL,
        created_at DOUBLE PRECISION NOT NULL,
        step INTEGER NOT NULL,
        reason TEXT NOT NULL,
        kind TEXT NOT NULL CHECK (kind IN ('full', 'delta')),
        payload TEXT NOT NULL,
        schema_name TEXT NOT NULL,
        schema_version INTEGER NOT NULL,
        good BOOLEAN,
        forked_from TEXT,
        PRIMARY KEY (session_id, version)
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS keel_state_locks (
        key TEXT PRIMARY KEY,
        owner TEXT NOT NULL,
        expires_at DOUBLE PRECISION NOT NULL
    )
    """,
)
"""The ``state`` component's schema, version 1 (applied idempotently by ``setup``)."""


POSTGRES_STATE_MIGRATIONS = MigrationSet(
    "state",
    (Migration("sessions and checkpoints", ";\n".join(POSTGRES_STATE_SCHEMA)),),
)
_COLUMNS = (
    "version, created_at, step, reason, kind, payload, schema_name, schema_version, good, "
    "forked_from"
)


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
SELECT h.version, h.epoch, h.last_full, h.ttl, h.expires_at, t.target,
       {", ".join("c." + name.strip() for name in _COLUMNS.split(","))}
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
       {", ".join("c." + name.strip() for name in _COLUMNS.split(","))}
FROM h LEFT JOIN b ON true
LEFT JOIN keel_state_checkpoints c
    ON c.session_id = %(sid)s AND c.version >= b.base AND c.version <= h.version
    AND h.version >= 1
ORDER BY c.version
"""

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
INSERT INTO keel_state_checkpoints (session_id, {_COLUMNS})
SELECT head.session_id, %(version)s::integer, %(created_at)s::double precision,
    %(step)s::integer, %(reason)s::text, %(kind)s::text, %(payload)s::text,
    %(schema_name)s::text, %(schema_version)s::integer, %(good)s::boolean,
    %(forked_from)s::text
FROM head
"""


def _append_params(
    session_id: str,
    row: StoredCheckpoint,
    expected_version: int,
    expected_epoch: str | None,
    now: float,
) -> dict[str, Any]:
    return {
        "sid": session_id,
        "expected": expected_version,
        "epoch": expected_epoch,
        "now": now,
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


_HISTORY = (
    "SELECT version, created_at, step, reason, kind, '', schema_name, schema_version, good, "
    "forked_from, octet_length(payload) FROM keel_state_checkpoints WHERE session_id = %s "
    "ORDER BY version"
)
_UPSERT_SESSION = (
    "INSERT INTO keel_state_sessions (session_id, version, epoch, last_full, ttl, expires_at, "
    "updated_at) VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (session_id) DO UPDATE SET "
    "version = excluded.version, epoch = excluded.epoch, last_full = excluded.last_full, "
    "ttl = excluded.ttl, expires_at = excluded.expires_at, updated_at = excluded.updated_at"
)
_LOCK = (
    "INSERT INTO keel_state_locks (key, owner, expires_at) VALUES (%s, %s, %s) "
    "ON CONFLICT (key) DO UPDATE SET owner = excluded.owner, "
    "expires_at = excluded.expires_at WHERE keel_state_locks.expires_at <= %s "
    "OR keel_state_locks.owner = excluded.owner"
)


def _values(row: StoredCheckpoint) -> tuple[Any, ...]:
    return (
        row.version,
        row.created_at,
        row.step,
        row.reason,
        row.kind,
        row.payload,
        row.schema_name,
        row.schema_version,
        row.good,
        row.forked_from,
    )


def _known(session_id: str, version: int, epoch: str) -> dict[str, Any]:
    return {"sid": session_id, "kv": version, "ke": epoch}


def _row(values: Any, payload_size: int | None = None) -> StoredCheckpoint:
    return StoredCheckpoint(
        version=int(values[0]),
        created_at=float(values[1]),
        step=int(values[2]),
        reason=str(values[3]),
        kind="full" if values[4] == "full" else "delta",
        payload=str(values[5]),
        schema_name=str(values[6]),
        schema_version=int(values[7]),
        good=values[8],
        forked_from=values[9],
        payload_size=payload_size,
    )


class PostgresStateBackend(StateBackend):
    """Checkpoints in PostgreSQL.

    Args:
        database: the :class:`~keel.stores.PostgresDatabase` to share (left open by
            :meth:`close`), or a ``postgresql://`` URL for a database of this backend's own.
        min_size: with a URL, connections its pool keeps open.
        max_size: with a URL, most connections its pool opens.
        timeout: with a URL, seconds to wait for a pooled connection.
    """

    name = "postgres"

    def __init__(
        self,
        database: PostgresDatabase | str,
        *,
        min_size: int = 1,
        max_size: int = 10,
        timeout: float = 30.0,
    ) -> None:
        self._owns_database = isinstance(database, str)
        self.database = (
            PostgresDatabase(database, min_size=min_size, max_size=max_size, timeout=timeout)
            if isinstance(database, str)
            else database
        )
        self.url = self.database.url
        try:
            self.setup()
        except BaseException:
            if self._owns_database:
                self.database.close()
            raise

    @contextmanager
    def _tx(self, *, single: bool = False) -> Iterator[Any]:
        """One transaction's cursor (tuple rows).

        ``single=True`` runs one statement in autocommit (itself atomic): one round trip.
        """
        scope = self.database.connection() if single else self.database.transaction()
        with scope as conn, conn.cursor() as cur:
            yield cur

    def setup(self) -> None:
        """Create the tables (idempotent) and record the ``state`` schema version.

        Raises:
            SchemaVersionError: the database has a newer ``state`` schema than this code.
        """
        with self._tx() as cur:
            apply_migrations(cur, POSTGRES_STATE_MIGRATIONS)

    @staticmethod
    def _head(cur: Any, session_id: str, *, for_update: bool = False) -> SessionHead | None:
        cur.execute(
            "SELECT version, epoch, last_full, ttl, expires_at FROM keel_state_sessions "
            "WHERE session_id = %s" + (" FOR UPDATE" if for_update else ""),
            (session_id,),
        )
        found = cur.fetchone()
        if found is None:
            return None
        return SessionHead(
            session_id, int(found[0]), str(found[1]), int(found[2]), found[3], found[4]
        )

    @staticmethod
    def _check_live(head: SessionHead, now: float) -> None:
        if head.expires_at is not None and head.expires_at <= now:
            raise ExpiredError(
                f"session {head.session_id!r} expired {now - head.expires_at:.1f}s ago "
                f"(version {head.version}); it reads as absent"
            )

    def read_chain(self, session_id: str, version: int | None, now: float) -> Chain | None:
        # One statement, so one snapshot: the head and the rows always agree.
        with self._tx(single=True) as cur:
            cur.execute(_READ_CHAIN, {"sid": session_id, "v": version})
            found = cur.fetchall()
        return self._chain_from(session_id, found, now)

    def read_head_chain(
        self, session_id: str, now: float, known_version: int, known_epoch: str
    ) -> Chain | None:
        with self._tx(single=True) as cur:
            cur.execute(_READ_HEAD_CHAIN, _known(session_id, known_version, known_epoch))
            found = cur.fetchall()
        return self._chain_from(session_id, found, now, known=(known_version, known_epoch))

    def _chain_from(
        self,
        session_id: str,
        found: list[Any],
        now: float,
        *,
        known: tuple[int, str] | None = None,
    ) -> Chain | None:
        if not found:
            return None
        first = found[0]
        head = SessionHead(
            session_id, int(first[0]), str(first[1]), int(first[2]), first[3], first[4]
        )
        self._check_live(head, now)
        if first[6] is None:  # no such version stored
            return None
        target = int(first[5])
        rows = [_row(values[6:]) for values in found]
        if known == (head.version, head.epoch) and len(rows) == 1 and rows[0].version == target:
            return Chain(head, rows)  # the head the reader holds, alone
        if not rows or rows[-1].version != target or rows[0].kind != "full":
            return None
        if len(rows) != target - rows[0].version + 1:
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
        if expected_version is not None:
            self._append(session_id, row, expected_version, expected_epoch, now)
            return
        with self._tx() as cur:
            cur.execute(
                "INSERT INTO keel_state_sessions (session_id, version, epoch, last_full, "
                "ttl, expires_at, updated_at) VALUES (%s, %s, %s, %s, %s, %s, %s) "
                "ON CONFLICT (session_id) DO NOTHING",
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
            if cur.rowcount != 1:
                head = self._head(cur, session_id, for_update=True)
                if head is not None and (head.expires_at is None or head.expires_at > now):
                    raise ConflictError(session_id, None, head.version)
                cur.execute(
                    "DELETE FROM keel_state_checkpoints WHERE session_id = %s", (session_id,)
                )
                cur.execute(
                    "INSERT INTO keel_state_sessions (session_id, version, epoch, last_full, "
                    "ttl, expires_at, updated_at) VALUES (%s, %s, %s, %s, %s, %s, %s) "
                    "ON CONFLICT (session_id) DO UPDATE SET version = excluded.version, "
                    "epoch = excluded.epoch, last_full = excluded.last_full, "
                    "ttl = excluded.ttl, expires_at = excluded.expires_at, "
                    "updated_at = excluded.updated_at",
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
            cur.execute(
                f"INSERT INTO keel_state_checkpoints (session_id, {_COLUMNS}) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
                (session_id, *_values(row)),
            )

    def _append(
        self,
        session_id: str,
        row: StoredCheckpoint,
        expected_version: int,
        expected_epoch: str | None,
        now: float,
    ) -> None:
        # The version check, the head move and the row insert are one statement: atomic in
        # autocommit, one round trip. A concurrent writer blocks on the head's row lock and
        # then finds the version moved on, so its insert selects nothing.
        with self._tx(single=True) as cur:
            cur.execute(
                _APPEND, _append_params(session_id, row, expected_version, expected_epoch, now)
            )
            if cur.rowcount == 1:
                return
            cur.execute(
                "SELECT version FROM keel_state_sessions WHERE session_id = %s", (session_id,)
            )
            found = cur.fetchone()
        raise ConflictError(session_id, expected_version, None if found is None else int(found[0]))

    def history(self, session_id: str, now: float) -> list[StoredCheckpoint]:
        with self._tx() as cur:
            cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            head = self._head(cur, session_id)
            if head is None:
                return []
            self._check_live(head, now)
            cur.execute(_HISTORY, (session_id,))
            return [_row(values[:10], int(values[10])) for values in cur.fetchall()]

    def mark(self, session_id: str, version: int, good: bool | None) -> bool:
        with self._tx() as cur:
            cur.execute(
                "UPDATE keel_state_checkpoints SET good = %s WHERE session_id = %s "
                "AND version = %s",
                (good, session_id, version),
            )
            return bool(cur.rowcount == 1)

    def rewrite(self, session_id: str, delete: list[int], replace: list[StoredCheckpoint]) -> None:
        with self._tx() as cur:
            head = self._head(cur, session_id, for_update=True)
            if head is None:
                return
            for row in replace:
                cur.execute(
                    "UPDATE keel_state_checkpoints SET kind = %s, payload = %s "
                    "WHERE session_id = %s AND version = %s",
                    (row.kind, row.payload, session_id, row.version),
                )
            doomed = [version for version in delete if version != head.version]
            if doomed:
                cur.execute(
                    "DELETE FROM keel_state_checkpoints WHERE session_id = %s "
                    "AND version = ANY(%s)",
                    (session_id, doomed),
                )

    def delete(self, session_id: str) -> bool:
        with self._tx() as cur:
            cur.execute("DELETE FROM keel_state_checkpoints WHERE session_id = %s", (session_id,))
            cur.execute("DELETE FROM keel_state_sessions WHERE session_id = %s", (session_id,))
            return bool(cur.rowcount == 1)

    def sessions(self) -> list[str]:
        with self._tx() as cur:
            cur.execute("SELECT session_id FROM keel_state_sessions ORDER BY session_id")
            return [str(value) for (value,) in cur.fetchall()]

    def purge_expired(self, now: float) -> list[str]:
        with self._tx() as cur:
            cur.execute(
                "DELETE FROM keel_state_sessions WHERE expires_at IS NOT NULL "
                "AND expires_at <= %s RETURNING session_id",
                (now,),
            )
            expired = sorted(str(value) for (value,) in cur.fetchall())
            if expired:
                cur.execute(
                    "DELETE FROM keel_state_checkpoints WHERE session_id = ANY(%s)", (expired,)
                )
            cur.execute("DELETE FROM keel_state_locks WHERE expires_at <= %s", (now,))
        return expired

    def acquire_lock(self, key: str, owner: str, ttl: float, now: float) -> bool:
        with self._tx() as cur:
            cur.execute(_LOCK, (key, owner, now + ttl, now))
            return bool(cur.rowcount == 1)

    def lock_holder(self, key: str, now: float) -> str | None:
        with self._tx() as cur:
            cur.execute(
                "SELECT owner FROM keel_state_locks WHERE key = %s AND expires_at > %s", (key, now)
            )
            row = cur.fetchone()
        if row is None:
            return None
        return str(row["owner"] if isinstance(row, dict) else row[0])

    def release_lock(self, key: str, owner: str) -> bool:
        with self._tx() as cur:
            cur.execute("DELETE FROM keel_state_locks WHERE key = %s AND owner = %s", (key, owner))
            return bool(cur.rowcount == 1)

    def storage_bytes(self) -> int:
        with self._tx() as cur:
            cur.execute(
                "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
                "WHERE c.relkind = 'r' AND c.relname LIKE 'keel_state%%'"
            )
            found = cur.fetchone()
            return int(found[0]) if found else 0

    def close(self) -> None:
        if self._owns_database:
            self.database.close()

    # --- native async twins (the database's async pool, bound to the running loop) ------------

    @asynccontextmanager
    async def _atx(self, *, single: bool = False) -> AsyncIterator[Any]:
        scope = self.database.aconnection() if single else self.database.atransaction()
        async with scope as conn, conn.cursor() as cur:
            yield cur

    async def aread_chain(self, session_id: str, version: int | None, now: float) -> Chain | None:
        async with self._atx(single=True) as cur:
            await cur.execute(_READ_CHAIN, {"sid": session_id, "v": version})
            found = await cur.fetchall()
        return self._chain_from(session_id, found, now)

    async def aread_head_chain(
        self, session_id: str, now: float, known_version: int, known_epoch: str
    ) -> Chain | None:
        async with self._atx(single=True) as cur:
            await cur.execute(_READ_HEAD_CHAIN, _known(session_id, known_version, known_epoch))
            found = await cur.fetchall()
        return self._chain_from(session_id, found, now, known=(known_version, known_epoch))

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
        if expected_version is not None:
            async with self._atx(single=True) as cur:
                await cur.execute(
                    _APPEND, _append_params(session_id, row, expected_version, expected_epoch, now)
                )
                if cur.rowcount == 1:
                    return
                await cur.execute(
                    "SELECT version FROM keel_state_sessions WHERE session_id = %s", (session_id,)
                )
                found = await cur.fetchone()
            actual = None if found is None else int(found[0])
            raise ConflictError(session_id, expected_version, actual)
        session = (
            session_id,
            row.version,
            new_epoch,
            row.version,
            ttl,
            None if ttl is None else now + ttl,
            now,
        )
        async with self._atx() as cur:
            await cur.execute(
                "SELECT version, expires_at FROM keel_state_sessions WHERE session_id = %s "
                "FOR UPDATE",
                (session_id,),
            )
            existing = await cur.fetchone()
            if existing is not None:
                if existing[1] is None or existing[1] > now:
                    raise ConflictError(session_id, None, int(existing[0]))
                await cur.execute(
                    "DELETE FROM keel_state_checkpoints WHERE session_id = %s", (session_id,)
                )
            await cur.execute(_UPSERT_SESSION, session)
            await cur.execute(
                f"INSERT INTO keel_state_checkpoints (session_id, {_COLUMNS}) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
                (session_id, *_values(row)),
            )

    async def ahistory(self, session_id: str, now: float) -> list[StoredCheckpoint]:
        async with self._atx() as cur:
            await cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            await cur.execute(
                "SELECT version, epoch, last_full, ttl, expires_at FROM keel_state_sessions "
                "WHERE session_id = %s",
                (session_id,),
            )
            found = await cur.fetchone()
            if found is None:
                return []
            head = SessionHead(
                session_id, int(found[0]), str(found[1]), int(found[2]), found[3], found[4]
            )
            self._check_live(head, now)
            await cur.execute(_HISTORY, (session_id,))
            return [_row(values[:10], int(values[10])) for values in await cur.fetchall()]

    async def amark(self, session_id: str, version: int, good: bool | None) -> bool:
        async with self._atx(single=True) as cur:
            await cur.execute(
                "UPDATE keel_state_checkpoints SET good = %s WHERE session_id = %s "
                "AND version = %s",
                (good, session_id, version),
            )
            return bool(cur.rowcount == 1)

    async def adelete(self, session_id: str) -> bool:
        async with self._atx() as cur:
            await cur.execute(
                "DELETE FROM keel_state_checkpoints WHERE session_id = %s", (session_id,)
            )
            await cur.execute(
                "DELETE FROM keel_state_sessions WHERE session_id = %s", (session_id,)
            )
            return bool(cur.rowcount == 1)

    async def aacquire_lock(self, key: str, owner: str, ttl: float, now: float) -> bool:
        async with self._atx(single=True) as cur:
            await cur.execute(_LOCK, (key, owner, now + ttl, now))
            return bool(cur.rowcount == 1)

    async def arelease_lock(self, key: str, owner: str) -> bool:
        async with self._atx(single=True) as cur:
            await cur.execute(
                "DELETE FROM keel_state_locks WHERE key = %s AND owner = %s", (key, owner)
            )
            return bool(cur.rowcount == 1)

    async def aclose(self) -> None:
        if self._owns_database:
            await self.database.aclose()
