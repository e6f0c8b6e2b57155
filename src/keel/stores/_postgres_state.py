"""State checkpoints in PostgreSQL (psycopg 3 with a connection pool).

Safe behind a transaction-mode connection pooler (PgBouncer): no server-side prepared
statements (``prepare_threshold=None``), no session-level advisory locks or settings; every
operation is one short transaction. Compare-and-set is an ``UPDATE ... WHERE version = %s``
whose row lock serialises concurrent writers; the loser's update matches nothing and its whole
transaction rolls back.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from keel.errors import BackendUnavailableError, ConflictError, ExpiredError, StoreError
from keel.state._backend import Chain, SessionHead, StateBackend, StoredCheckpoint

__all__ = ["POSTGRES_STATE_SCHEMA", "PostgresStateBackend"]

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

_VERSION = 1
_COLUMNS = (
    "version, created_at, step, reason, kind, payload, schema_name, schema_version, good, "
    "forked_from"
)


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
        url: a ``postgresql://`` connection URL.
        min_size: connections the pool keeps open.
        max_size: most connections the pool opens.
        timeout: seconds to wait for a pooled connection.
    """

    name = "postgres"

    def __init__(
        self, url: str, *, min_size: int = 1, max_size: int = 10, timeout: float = 30.0
    ) -> None:
        try:
            import psycopg
            from psycopg_pool import ConnectionPool
        except ImportError as exc:  # pragma: no cover - the extra is installed in tests
            raise BackendUnavailableError(
                "psycopg and psycopg-pool are not installed (the 'postgres' extra)"
            ) from exc
        self._psycopg = psycopg
        self.url = url
        try:
            self._pool = ConnectionPool(
                url,
                min_size=min_size,
                max_size=max_size,
                timeout=timeout,
                kwargs={"prepare_threshold": None, "autocommit": False},
                open=True,
            )
            self._pool.wait(timeout=timeout)
        except Exception as exc:
            raise BackendUnavailableError(f"cannot connect to PostgreSQL: {exc}") from exc
        self.setup()

    @contextmanager
    def _tx(self) -> Iterator[Any]:
        """One transaction on a pooled connection; driver errors translated."""
        psycopg = self._psycopg
        try:
            with self._pool.connection() as conn, conn.transaction(), conn.cursor() as cur:
                yield cur
        except (ConflictError, ExpiredError):
            raise
        except psycopg.OperationalError as exc:
            raise BackendUnavailableError(f"PostgreSQL is unavailable: {exc}") from exc
        except psycopg.Error as exc:
            raise StoreError(f"PostgreSQL: {exc}") from exc
        except Exception as exc:
            if type(exc).__name__ == "PoolTimeout":
                raise BackendUnavailableError(f"no PostgreSQL connection: {exc}") from exc
            raise

    def setup(self) -> None:
        """Create the tables (idempotent) and record the ``state`` schema version.

        Raises:
            SchemaVersionError: the database has a newer ``state`` schema than this code.
        """
        from keel.errors import SchemaVersionError

        with self._tx() as cur:
            # Serialise concurrent setups; a transaction-level lock is pooler-safe.
            cur.execute("SELECT pg_advisory_xact_lock(7311532)")
            for statement in POSTGRES_STATE_SCHEMA:
                cur.execute(statement)
            cur.execute("SELECT version FROM keel_schema WHERE component = 'state'")
            found = cur.fetchone()
            if found is not None and int(found[0]) > _VERSION:
                raise SchemaVersionError(
                    f"PostgreSQL has state schema version {found[0]}, newer than this keel "
                    f"knows ({_VERSION}); upgrade keel"
                )
            cur.execute(
                "INSERT INTO keel_schema (component, version, applied_at) "
                "VALUES ('state', %s, extract(epoch from now())) "
                "ON CONFLICT (component) DO NOTHING",
                (_VERSION,),
            )

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
        with self._tx() as cur:
            # REPEATABLE READ: the head and the rows come from one snapshot.
            cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            head = self._head(cur, session_id)
            if head is None:
                return None
            self._check_live(head, now)
            target = head.version if version is None else version
            if target > head.version or target < 1:
                return None
            cur.execute(
                f"SELECT {_COLUMNS} FROM keel_state_checkpoints WHERE session_id = %s "
                "AND version <= %s AND version >= (SELECT max(version) FROM "
                "keel_state_checkpoints WHERE session_id = %s AND version <= %s "
                "AND kind = 'full') ORDER BY version",
                (session_id, target, session_id, target),
            )
            rows = [_row(values) for values in cur.fetchall()]
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
        with self._tx() as cur:
            if expected_version is None:
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
            else:
                cur.execute(
                    "UPDATE keel_state_sessions SET version = %s, updated_at = %s, "
                    "last_full = CASE WHEN %s THEN %s ELSE last_full END, "
                    "expires_at = CASE WHEN ttl IS NULL THEN NULL ELSE %s + ttl END "
                    "WHERE session_id = %s AND version = %s AND epoch = %s "
                    "AND (expires_at IS NULL OR expires_at > %s)",
                    (
                        row.version,
                        now,
                        row.kind == "full",
                        row.version,
                        now,
                        session_id,
                        expected_version,
                        expected_epoch,
                        now,
                    ),
                )
                if cur.rowcount != 1:
                    cur.execute(
                        "SELECT version FROM keel_state_sessions WHERE session_id = %s",
                        (session_id,),
                    )
                    found = cur.fetchone()
                    raise ConflictError(
                        session_id, expected_version, None if found is None else int(found[0])
                    )
            cur.execute(
                f"INSERT INTO keel_state_checkpoints (session_id, {_COLUMNS}) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
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
                    row.good,
                    row.forked_from,
                ),
            )

    def history(self, session_id: str, now: float) -> list[StoredCheckpoint]:
        with self._tx() as cur:
            cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            head = self._head(cur, session_id)
            if head is None:
                return []
            self._check_live(head, now)
            cur.execute(
                "SELECT version, created_at, step, reason, kind, '', schema_name, "
                "schema_version, good, forked_from, octet_length(payload) "
                "FROM keel_state_checkpoints WHERE session_id = %s ORDER BY version",
                (session_id,),
            )
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
            cur.execute(
                "INSERT INTO keel_state_locks (key, owner, expires_at) VALUES (%s, %s, %s) "
                "ON CONFLICT (key) DO UPDATE SET owner = excluded.owner, "
                "expires_at = excluded.expires_at WHERE keel_state_locks.expires_at <= %s "
                "OR keel_state_locks.owner = excluded.owner",
                (key, owner, now + ttl, now),
            )
            return bool(cur.rowcount == 1)

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
        self._pool.close()
