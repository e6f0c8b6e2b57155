"""Memory's records, facts, outbox and scopes over SQL, written once for SQLite and PostgreSQL.

Both engines take the same statements (``INSERT ... ON CONFLICT DO NOTHING RETURNING``, epoch
seconds as floats, the same tables and columns); the `SqlDialect`
carries what differs in the spelling (markers, a list of ids as ``IN (...)`` or ``= ANY(...)``,
the JSON column's cast). Each engine's subclass says how it opens a write transaction and a
read, and keeps what really differs: its vector search, its full text, PostgreSQL's per-fact
lock and its one-statement plain insert.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, closing
from datetime import datetime
from functools import cache
from typing import Any, TypeVar

from keel.errors import UsageError
from keel.memory._records import MemoryFilter, MemoryRecord, Scope, is_fact, reopened, same_content
from keel.memory._rows import (
    RECORD_COLUMNS,
    current_fact,
    filter_sql,
    record_from_row,
    record_to_row,
    to_epoch,
)
from keel.memory._store import FloatArray, InsertResult, MemoryStore, OutboxEntry
from keel.stores._dialect import SqlDialect
from keel.stores._migrations import Migration

__all__ = [
    "MemorySchema",
    "SQLMemoryStore",
    "insert_row_sql",
    "require_database",
]

_D = TypeVar("_D")
_COLUMNS = ", ".join(RECORD_COLUMNS)
_IN_SCOPE = "tenant_id = ? AND user_id = ?"


class MemorySchema:
    """The parts of the memory schema both engines spell alike, for the migrations of each
    (which add their own keys, number and JSON types, full text and vectors). Whitespace
    aside, it is the schema those migrations always made."""

    #: The columns of ``memory_records`` between its key and its first timestamp.
    record_columns = ", ".join(
        (
            "tenant_id TEXT NOT NULL",
            "user_id TEXT NOT NULL",
            "kind TEXT NOT NULL",
            "type TEXT NOT NULL",
            "text TEXT NOT NULL",
            "provenance TEXT NOT NULL",
            "verified_by TEXT",
            "session_id TEXT",
            "step INTEGER",
            "turn INTEGER",
        )
    )
    #: The indexes of a scope's records by time, by session and turn, and by fact.
    record_indexes = """
        CREATE INDEX memory_records_scope_time ON memory_records (tenant_id, user_id, created_at);
        CREATE INDEX memory_records_session
            ON memory_records (tenant_id, user_id, session_id, turn);
        CREATE INDEX memory_records_fact
            ON memory_records (tenant_id, user_id, subject, attribute);
    """

    @staticmethod
    def keyed_records(number: str) -> Migration:
        """The migration that adds a record's key (one record per key and scope) and expiry,
        with ``number`` the engine's type for epoch seconds."""
        return Migration(
            "keyed records (a key names one record per scope) and expiry",
            f"""
            ALTER TABLE memory_records ADD COLUMN key TEXT;
            ALTER TABLE memory_records ADD COLUMN expires_at {number};
            CREATE UNIQUE INDEX memory_records_key
                ON memory_records (tenant_id, user_id, key) WHERE key IS NOT NULL;
            CREATE INDEX memory_records_expiry
                ON memory_records (expires_at) WHERE expires_at IS NOT NULL;
            """,
        )


class SQLMemoryStore(MemoryStore):
    """The memory CRUD's statements, run on the connections a subclass opens.

    A subclass sets `dialect` and `inserted_order`, opens connections
    (`_connection`, `_reading`), creates its schema in `setup` (which sets
    ``_ready``), and implements search, `vectors` and `_write_vectors`.
    """

    dialect: SqlDialect
    #: The column that orders rows as they were inserted (SQLite's rowid, PostgreSQL's seq).
    inserted_order: str
    _ready: bool = False

    @abstractmethod
    def _connection(self) -> AbstractContextManager[Any]:
        """One write transaction's connection, driver errors translated."""

    @abstractmethod
    def _reading(self) -> AbstractContextManager[Any]:
        """A connection for reads, driver errors translated."""

    def _lock(self, conn: Any, what: str, record: MemoryRecord, name: str) -> None:
        """Make the writers of one name of ``record``'s scope (a key, a fact) take turns, for
        the rest of the transaction. SQLite's write transactions take turns already."""

    def _write(self) -> AbstractContextManager[Any]:
        if not self._ready:
            self.setup()
        return self._connection()

    def _read(self) -> AbstractContextManager[Any]:
        if not self._ready:
            self.setup()
        return self._reading()

    def _execute(self, conn: Any, statement: str, params: Sequence[Any] = ()) -> Any:
        return conn.execute(self.dialect.sql(statement), tuple(params))

    # --- writes -------------------------------------------------------------------------

    def insert(self, record: MemoryRecord) -> InsertResult:
        with self._write() as conn:
            if record.key is not None:
                # The record a key named is replaced, in this transaction (the very same
                # record added again stays as it is: adds are idempotent). Two writers of one
                # key take turns: each would otherwise delete the old row, and the second's
                # insert would then break the key's uniqueness.
                self._lock(conn, "memory key", record, record.key)
                self._execute(
                    conn,
                    f"DELETE FROM memory_records WHERE {_IN_SCOPE} AND key = ? "
                    "AND content_hash <> ?",
                    (record.tenant_id, record.user_id, record.key, record.content_hash),
                )
            if is_fact(record):
                # Writers of one fact take turns: each reads the current value, then
                # supersedes it, and two at once would both leave theirs current.
                self._lock(conn, "memory fact", record, f"{record.subject}\x1f{record.attribute}")
                for stored in current_fact(conn, record, self.dialect.placeholder):
                    if same_content(stored, record):
                        return InsertResult(stored, created=False)
            if not self._insert_row(conn, record):
                if not is_fact(record):
                    return InsertResult(self._stored_content(conn, record), created=False)
                # A value the fact had before, and not now: it holds again from now on.
                record = reopened(record)
                self._insert_row(conn, record)
            superseded = self._supersede(conn, record) if is_fact(record) else ()
            self._execute(
                conn,
                "INSERT INTO memory_outbox (record_id, created_at) VALUES (?, ?)",
                (record.id, time.time()),
            )
        return InsertResult(record, created=True, superseded=superseded)

    def _insert_row(self, conn: Any, record: MemoryRecord) -> bool:
        """Insert ``record``'s row; False when its scope holds the same content already."""
        return bool(
            self._execute(conn, insert_row_sql(self.dialect), record_to_row(record)).fetchall()
        )

    def _stored_content(self, conn: Any, record: MemoryRecord) -> MemoryRecord:
        """The record of ``record``'s scope with its content (there: its insert conflicted)."""
        row = self._execute(
            conn,
            f"SELECT {_COLUMNS} FROM memory_records WHERE {_IN_SCOPE} AND content_hash = ?",
            (record.tenant_id, record.user_id, record.content_hash),
        ).fetchone()
        return record_from_row(row)

    def _supersede(self, conn: Any, record: MemoryRecord) -> tuple[str, ...]:
        """End the other current values of ``record``'s fact where its own validity begins;
        their ids."""
        rows = self._execute(
            conn,
            f"UPDATE memory_records SET valid_to = ? WHERE {_IN_SCOPE} AND subject = ? "
            "AND attribute = ? AND valid_to IS NULL AND id <> ? RETURNING id",
            (
                to_epoch(record.valid_from or record.created_at),
                record.tenant_id,
                record.user_id,
                record.subject,
                record.attribute,
                record.id,
            ),
        ).fetchall()
        return tuple(str(row[0]) for row in rows)

    def delete(self, scope: Scope, record_id: str) -> bool:
        with self._write() as conn:
            cursor = self._execute(
                conn,
                f"DELETE FROM memory_records WHERE id = ? AND {_IN_SCOPE}",
                (record_id, scope.tenant_id, scope.user_id),
            )
            return bool(cursor.rowcount > 0)

    def set_expiry(self, scope: Scope, expiry: Mapping[str, datetime | None]) -> None:
        if not expiry:
            return
        with self._write() as conn, closing(conn.cursor()) as cursor:
            cursor.executemany(
                self.dialect.sql(
                    f"UPDATE memory_records SET expires_at = ? WHERE id = ? AND {_IN_SCOPE}"
                ),
                [
                    (to_epoch(when), record_id, scope.tenant_id, scope.user_id)
                    for record_id, when in expiry.items()
                ],
            )

    def purge_expired(self, scope: Scope | None, now: datetime) -> int:
        where = "expires_at IS NOT NULL AND expires_at <= ?"
        params: tuple[object, ...] = (to_epoch(now),)
        if scope is not None:
            where += f" AND {_IN_SCOPE}"
            params += (scope.tenant_id, scope.user_id)
        with self._write() as conn:
            return int(
                self._execute(conn, f"DELETE FROM memory_records WHERE {where}", params).rowcount
            )

    # --- reads --------------------------------------------------------------------------

    def _query(self, statement: str, params: Sequence[Any]) -> list[MemoryRecord]:
        with self._read() as conn:
            rows = self._execute(conn, statement, params).fetchall()
        return [record_from_row(row) for row in rows]

    def _scoped(
        self,
        columns: str,
        scope: Scope,
        filters: MemoryFilter,
        record_ids: Sequence[str] | None = None,
    ) -> Iterator[tuple[str, tuple[Any, ...]]]:
        """Statements reading ``columns`` of the rows of ``scope`` that pass ``filters``;
        among ``record_ids`` when given, in as many statements as the engine needs."""
        where, params = filter_sql(filters, "?")
        condition = f" AND {where}" if where else ""
        if record_ids is None:
            yield (
                f"SELECT {columns} FROM memory_records WHERE {_IN_SCOPE}{condition}",
                (scope.tenant_id, scope.user_id, *params),
            )
            return
        # By id, the scope is checked on the rows the id index finds.
        skip = self.dialect.skip_index
        for batch in self.dialect.batches(list(dict.fromkeys(record_ids))):
            ids, id_params = self.dialect.one_of("id", batch)
            yield (
                f"SELECT {columns} FROM memory_records WHERE {skip}tenant_id = ? "
                f"AND {skip}user_id = ? AND {ids}{condition}",
                (scope.tenant_id, scope.user_id, *id_params, *params),
            )

    def get(self, scope: Scope, record_id: str) -> MemoryRecord | None:
        found = self._query(
            f"SELECT {_COLUMNS} FROM memory_records WHERE id = ? AND {_IN_SCOPE}",
            (record_id, scope.tenant_id, scope.user_id),
        )
        return found[0] if found else None

    def fetch(
        self, scope: Scope, record_ids: Sequence[str], filters: MemoryFilter
    ) -> list[MemoryRecord]:
        records: list[MemoryRecord] = []
        for statement, params in self._scoped(_COLUMNS, scope, filters, record_ids):
            records.extend(self._query(statement, params))
        return records

    def list_records(
        self, scope: Scope, filters: MemoryFilter, *, limit: int = 50, newest_first: bool = True
    ) -> list[MemoryRecord]:
        ((statement, params),) = self._scoped(_COLUMNS, scope, filters)
        order = "DESC" if newest_first else "ASC"
        return self._query(
            f"{statement} ORDER BY created_at {order}, {self.inserted_order} {order} LIMIT ?",
            (*params, int(limit)),
        )

    def fact_history(self, scope: Scope, subject: str, attribute: str) -> list[MemoryRecord]:
        return self._query(
            f"SELECT {_COLUMNS} FROM memory_records WHERE {_IN_SCOPE} AND kind = 'semantic' "
            "AND subject = ? AND attribute = ? "
            f"ORDER BY COALESCE(valid_from, created_at), {self.inserted_order}",
            (scope.tenant_id, scope.user_id, subject, attribute),
        )

    def session_turns(
        self, scope: Scope, session_id: str, first_turn: int, last_turn: int
    ) -> list[MemoryRecord]:
        return self.turns_around(scope, [(session_id, first_turn, last_turn)])

    def turns_around(
        self, scope: Scope, spans: Sequence[tuple[str, int, int]]
    ) -> list[MemoryRecord]:
        if not spans:
            return []
        ranges = " OR ".join(["(session_id = ? AND turn BETWEEN ? AND ?)"] * len(spans))
        return self._query(
            f"SELECT {_COLUMNS} FROM memory_records WHERE {_IN_SCOPE} AND ({ranges}) "
            f"ORDER BY session_id, turn, {self.inserted_order}",
            (scope.tenant_id, scope.user_id, *(value for span in spans for value in span)),
        )

    def count(self, scope: Scope | None = None) -> int:
        with self._read() as conn:
            return self._count(conn, scope)

    def _count(self, conn: Any, scope: Scope | None) -> int:
        """`count`, on ``conn`` (keyword search plans with the scope's size)."""
        statement: str = "SELECT COUNT(*) FROM memory_records"
        params: tuple[str, ...] = ()
        if scope is not None:
            statement, params = f"{statement} WHERE {_IN_SCOPE}", (scope.tenant_id, scope.user_id)
        return int(self._execute(conn, statement, params).fetchone()[0])

    # --- outbox -------------------------------------------------------------------------

    def pending(
        self, limit: int, max_attempts: int = 5, *, scope: Scope | None = None
    ) -> list[OutboxEntry]:
        in_scope = "" if scope is None else " AND r.tenant_id = ? AND r.user_id = ?"
        scoped = () if scope is None else (scope.tenant_id, scope.user_id)
        with self._read() as conn:
            rows = self._execute(
                conn,
                "SELECT o.id, o.record_id, r.tenant_id, r.user_id, r.text, o.attempts, "
                "r.session_id, r.turn "
                "FROM memory_outbox o JOIN memory_records r ON r.id = o.record_id "
                f"WHERE o.attempts < ?{in_scope} ORDER BY o.id LIMIT ?",
                (int(max_attempts), *scoped, int(limit)),
            ).fetchall()
        return [_outbox_entry(row) for row in rows]

    def count_pending(self, max_attempts: int = 5) -> int:
        with self._read() as conn:
            row = self._execute(
                conn,
                "SELECT COUNT(*) FROM memory_outbox o JOIN memory_records r ON r.id = o.record_id "
                "WHERE o.attempts < ?",
                (int(max_attempts),),
            ).fetchone()
        return int(row[0])

    @abstractmethod
    def _write_vectors(
        self, conn: Any, entries: Sequence[OutboxEntry], vectors: Sequence[FloatArray], model: str
    ) -> None:
        """Store ``entries``' vectors, made by ``model``, in the transaction on ``conn``."""

    def complete(
        self, entries: Sequence[OutboxEntry], vectors: Sequence[FloatArray], model: str
    ) -> None:
        if not entries:
            return
        with self._write() as conn:
            self._write_vectors(conn, entries, vectors, model)
            for batch in self.dialect.batches(entries):
                records, record_params = self.dialect.one_of("id", [e.record_id for e in batch])
                self._execute(
                    conn,
                    f"UPDATE memory_records SET embedding_model = ? WHERE {records}",
                    (model, *record_params),
                )
                queued, queued_params = self.dialect.one_of("id", [e.id for e in batch])
                self._execute(conn, f"DELETE FROM memory_outbox WHERE {queued}", queued_params)

    def fail(self, entries: Sequence[OutboxEntry], error: str) -> None:
        if not entries:
            return
        with self._write() as conn:
            for batch in self.dialect.batches(entries):
                queued, params = self.dialect.one_of("id", [e.id for e in batch])
                self._execute(
                    conn,
                    "UPDATE memory_outbox SET attempts = attempts + 1, last_error = ? "
                    f"WHERE {queued}",
                    (error[:2000], *params),
                )

    def enqueue_reembed(self, model: str) -> int:
        with self._write() as conn:
            # Entries that ran out of attempts (an embedder was down) get a fresh start.
            retried = self._execute(
                conn, "UPDATE memory_outbox SET attempts = 0 WHERE attempts > 0"
            ).rowcount
            queued = self._execute(
                conn,
                "INSERT INTO memory_outbox (record_id, created_at) "
                "SELECT id, ? FROM memory_records r WHERE "
                "(r.embedding_model IS NULL OR r.embedding_model <> ?) "
                "AND NOT EXISTS (SELECT 1 FROM memory_outbox o WHERE o.record_id = r.id)",
                (time.time(), model),
            ).rowcount
        return int(queued) + int(retried)

    def embedding_models(self) -> dict[str, int]:
        with self._read() as conn:
            rows = self._execute(
                conn,
                "SELECT COALESCE(embedding_model, ''), COUNT(*) FROM memory_records "
                "GROUP BY COALESCE(embedding_model, '')",
            ).fetchall()
        return {str(model): int(count) for model, count in rows}


def require_database(database: object, kind: type[_D], store: str) -> _D:
    """``database`` when it is a ``kind``: a store is given an open database to share, never
    a path or URL ([`Backends`][] opens those)."""
    if not isinstance(database, kind):
        raise UsageError(
            f"{store} takes a {kind.__name__}, not a {type(database).__name__}: "
            f"open one with {kind.__name__}(...) and pass it"
        )
    return database


@cache
def insert_row_sql(dialect: SqlDialect) -> str:
    """A record's ``INSERT`` (``?`` markers), returning its id unless its scope holds the
    same content already."""
    values = ", ".join(
        dialect.json_marker if column == "metadata" else "?" for column in RECORD_COLUMNS
    )
    return (
        f"INSERT INTO memory_records ({_COLUMNS}) VALUES ({values}) "
        "ON CONFLICT (tenant_id, user_id, content_hash) DO NOTHING RETURNING id"
    )


def _outbox_entry(row: Sequence[Any]) -> OutboxEntry:
    return OutboxEntry(
        int(row[0]),
        str(row[1]),
        str(row[2]),
        str(row[3]),
        str(row[4]),
        int(row[5]),
        None if row[6] is None else str(row[6]),
        None if row[7] is None else int(row[7]),
    )
