"""Memory's records, facts, outbox and scopes over SQL, written once for SQLite and PostgreSQL.

Both engines take the same statements (``INSERT ... ON CONFLICT DO NOTHING RETURNING``, epoch
seconds as floats, the same tables and columns); the database's `SqlDialect` carries what
differs in the spelling (markers, a list of ids as ``IN (...)`` or ``= ANY(...)``, the JSON
column's cast). Each operation is a plan (``_sql_plan.py``) the database runs. Each engine's
subclass keeps what really differs: its schema, its vector search and vector table, its full
text, PostgreSQL's per-fact lock and its one-statement plain insert.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from functools import cache
from typing import Any, TypeVar

from keel.errors import UsageError
from keel.memory._records import (
    MemoryFilter,
    MemoryRecord,
    Scope,
    is_fact,
    reopened,
    same_content,
)
from keel.memory._rows import (
    RECORD_COLUMNS,
    RecordCache,
    current_fact_sql,
    filter_sql,
    record_from_row,
    record_to_row,
    to_epoch,
)
from keel.memory._store import FloatArray, InsertResult, MemoryStore, OutboxEntry
from keel.stores._dialect import SqlDialect
from keel.stores._keywords import TermFrequencies
from keel.stores._migrations import Migration, MigrationSet
from keel.stores._sql_memory_erasure import MemoryErasure, deleting
from keel.stores._sql_plan import Plan, Result, SQLDatabase, Statement

__all__ = [
    "MemorySchema",
    "SQLMemoryStore",
    "count_records",
    "insert_row_sql",
    "require_database",
    "rows_of",
    "spans_by_session",
    "stored_content",
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

    #: The migration that indexes a scope's records by kind and time, so the profile (the
    #: newest semantic records) reads its rows, not every record of the scope past them.
    records_by_kind = Migration(
        "a scope's records by kind and time (the profile's look-up)",
        """
        CREATE INDEX memory_records_kind ON memory_records (tenant_id, user_id, kind, created_at);
        """,
    )


class SQLMemoryStore(MemoryErasure, MemoryStore):
    """The memory CRUD's plans, run by the database; a subclass keeps what its engine does
    its own way: search (vectors, full text), the vectors' table, and the lock writers of one
    key or fact take turns on.

    A subclass sets `inserted_order`, names its `migrations`, and implements search,
    `vectors` and `_write_vectors`. The schema is applied when the store is built, as every
    store's is: a memory that is off is never built (`Backends.open` leaves it out), so it
    creates no tables.
    """

    #: The column that orders rows as they were inserted (SQLite's rowid, PostgreSQL's seq).
    inserted_order: str
    #: The ``memory`` component's migrations in the engine's own schema.
    migrations: MigrationSet

    def __init__(self, db: SQLDatabase) -> None:
        self.db = db
        # The records of rows read before: a retrieval reads the same turns every turn.
        self.records = RecordCache()
        # Each scope's term counts, which plan its keyword queries (see keel.stores._keywords).
        self._term_frequencies = TermFrequencies()
        self._ready = False
        self.setup()

    def setup(self) -> None:
        """Apply the schema: run when the store is built (later calls return at once)."""
        if self._ready:
            return
        self.db.migrate(self.migrations)
        self._ready = True

    def _lock(self, what: str, record: MemoryRecord, name: str) -> Plan[None]:
        """Make the writers of one name of ``record``'s scope (a key, a fact) take turns, for
        the rest of the transaction. SQLite's write transactions take turns already."""
        yield from ()

    # --- writes -------------------------------------------------------------------------

    def insert(self, record: MemoryRecord) -> InsertResult:
        return self.db.run(lambda: self._insert(record))

    def insert_many(self, records: Sequence[MemoryRecord]) -> list[InsertResult]:
        if not records:
            return []
        return self.db.run(lambda: self._insert_all(records))

    def _insert_all(self, records: Sequence[MemoryRecord]) -> Plan[list[InsertResult]]:
        results = []
        for record in records:
            results.append((yield from self._insert(record)))
        return results

    def _insert(self, record: MemoryRecord) -> Plan[InsertResult]:
        if record.key is not None:
            # The record a key named is replaced, in this transaction (the very same
            # record added again stays as it is: adds are idempotent). Two writers of one
            # key take turns: each would otherwise delete the old row, and the second's
            # insert would then break the key's uniqueness.
            yield from self._lock("memory key", record, record.key)
            yield Statement(
                f"DELETE FROM memory_records WHERE {_IN_SCOPE} AND key = ? AND content_hash <> ?",
                (record.tenant_id, record.user_id, record.key, record.content_hash),
            )
        if is_fact(record):
            # Writers of one fact take turns: each reads the current value, then
            # supersedes it, and two at once would both leave theirs current.
            yield from self._lock("memory fact", record, f"{record.subject}\x1f{record.attribute}")
            for stored in _records((yield Statement(*current_fact_sql(record, "?")))):
                if same_content(stored, record):
                    return InsertResult(stored, created=False)
        if not (yield self._insert_row(record)).rows:
            if not is_fact(record):
                return InsertResult((yield from stored_content(record)), created=False)
            # A value the fact had before, and not now: it holds again from now on.
            record = reopened(record)
            yield self._insert_row(record)
        superseded = (yield from _supersede(record)) if is_fact(record) else ()
        yield Statement(
            "INSERT INTO memory_outbox (record_id, created_at) VALUES (?, ?)",
            (record.id, time.time()),
        )
        return InsertResult(record, created=True, superseded=superseded)

    def _insert_row(self, record: MemoryRecord) -> Statement:
        """Insert ``record``'s row, returning its id; no row when its scope holds the same
        content already."""
        return Statement(insert_row_sql(self.db.dialect), record_to_row(record))

    def delete(self, scope: Scope, record_id: str) -> bool:
        statement = Statement(
            f"DELETE FROM memory_records WHERE id = ? AND {_IN_SCOPE}",
            (record_id, scope.tenant_id, scope.user_id),
        )
        deleted = self.db.run(lambda: deleting([statement])) > 0
        if deleted:
            self._term_frequencies.forget(scope.tenant_id, scope.user_id)
        return deleted

    def set_expiry(self, scope: Scope, expiry: Mapping[str, datetime | None]) -> None:
        if not expiry:
            return
        statement = Statement(
            f"UPDATE memory_records SET expires_at = ? WHERE id = ? AND {_IN_SCOPE}",
            [
                (to_epoch(when), record_id, scope.tenant_id, scope.user_id)
                for record_id, when in expiry.items()
            ],
            many=True,
        )
        self.db.run(lambda: _changed(statement))

    def purge_expired(self, scope: Scope | None, now: datetime) -> int:
        where = "expires_at IS NOT NULL AND expires_at <= ?"
        params: tuple[object, ...] = (to_epoch(now),)
        if scope is not None:
            where += f" AND {_IN_SCOPE}"
            params += (scope.tenant_id, scope.user_id)
        statement = Statement(f"DELETE FROM memory_records WHERE {where}", params)
        deleted = self.db.run(lambda: deleting([statement]))
        if deleted:
            if scope is None:
                self._term_frequencies.forget()
            else:
                self._term_frequencies.forget(scope.tenant_id, scope.user_id)
        return deleted

    # --- reads --------------------------------------------------------------------------

    def _query(self, statement: str, params: Sequence[Any]) -> list[MemoryRecord]:
        query = Statement(statement, params)
        read_at = self.records.forgets  # before the read: an erasure meanwhile is seen
        rows = self.db.run(lambda: rows_of(query), write=False)
        return [self.records.record(row, read_at) for row in rows]

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
        dialect = self.db.dialect
        skip = dialect.skip_index
        for batch in dialect.batches(list(dict.fromkeys(record_ids))):
            ids, id_params = dialect.one_of("id", batch)
            yield (
                f"SELECT {columns} FROM memory_records WHERE {skip}tenant_id = ? "
                f"AND {skip}user_id = ? AND {ids}{condition}",
                (scope.tenant_id, scope.user_id, *id_params, *params),
            )

    def _scoped_ids(
        self, scope: Scope, filters: MemoryFilter, record_ids: Sequence[str] | None = None
    ) -> list[str]:
        """The ids of the rows of ``scope`` that pass ``filters`` (among ``record_ids`` when
        given): what search may return of its candidates."""
        statements = [Statement(*found) for found in self._scoped("id", scope, filters, record_ids)]
        return self.db.run(lambda: ids_of(statements), write=False)

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
        sessions = spans_by_session(spans)
        if not sessions:
            return []
        return self._query(*self._turns_sql(scope, sessions))

    def _turns_sql(
        self, scope: Scope, sessions: Sequence[tuple[str, list[int] | tuple[int, int]]]
    ) -> tuple[str, tuple[Any, ...]]:
        """The statement reading ``sessions``' turns (listed, or a range) in ``scope``, in
        session and turn order, and its parameters."""
        # Each condition names its scope and session too, so each is read through the
        # session index: with the scope outside the ORs, the engine walks every record of the
        # scope instead (a read that grew with the scope, every turn).
        conditions: list[str] = []
        params: list[Any] = []
        for session_id, turns in sessions:
            if isinstance(turns, list):
                listed, listed_params = self.db.dialect.one_of("turn", turns)
                conditions.append(f"({_IN_SCOPE} AND session_id = ? AND {listed})")
                params.extend((scope.tenant_id, scope.user_id, session_id, *listed_params))
            else:
                conditions.append(f"({_IN_SCOPE} AND session_id = ? AND turn BETWEEN ? AND ?)")
                params.extend((scope.tenant_id, scope.user_id, session_id, *turns))
        return (
            f"SELECT {_COLUMNS} FROM memory_records WHERE {' OR '.join(conditions)} "
            f"ORDER BY session_id, turn, {self.inserted_order}",
            tuple(params),
        )

    def count(self, scope: Scope | None = None) -> int:
        return self.db.run(lambda: count_records(scope), write=False)

    # --- outbox -------------------------------------------------------------------------

    def pending(
        self, limit: int, max_attempts: int = 5, *, scope: Scope | None = None
    ) -> list[OutboxEntry]:
        in_scope = "" if scope is None else " AND r.tenant_id = ? AND r.user_id = ?"
        scoped = () if scope is None else (scope.tenant_id, scope.user_id)
        query = Statement(
            "SELECT o.id, o.record_id, r.tenant_id, r.user_id, r.text, o.attempts, "
            "r.session_id, r.turn "
            "FROM memory_outbox o JOIN memory_records r ON r.id = o.record_id "
            f"WHERE o.attempts < ?{in_scope} ORDER BY o.id LIMIT ?",
            (int(max_attempts), *scoped, int(limit)),
        )
        rows = self.db.run(lambda: rows_of(query), write=False)
        return [_outbox_entry(row) for row in rows]

    def count_pending(self, max_attempts: int = 5) -> int:
        query = Statement(
            "SELECT COUNT(*) FROM memory_outbox o JOIN memory_records r ON r.id = o.record_id "
            "WHERE o.attempts < ?",
            (int(max_attempts),),
        )
        return int(self.db.run(lambda: rows_of(query), write=False)[0][0])

    @abstractmethod
    def _write_vectors(
        self, entries: Sequence[OutboxEntry], vectors: Sequence[FloatArray], model: str
    ) -> Plan[None]:
        """Store ``entries``' vectors, made by ``model``, in the transaction of `complete`."""

    def complete(
        self, entries: Sequence[OutboxEntry], vectors: Sequence[FloatArray], model: str
    ) -> None:
        if entries:
            self.db.run(lambda: self._complete(entries, vectors, model))

    def _complete(
        self, entries: Sequence[OutboxEntry], vectors: Sequence[FloatArray], model: str
    ) -> Plan[None]:
        yield from self._write_vectors(entries, vectors, model)
        dialect = self.db.dialect
        for batch in dialect.batches(entries):
            records, record_params = dialect.one_of("id", [e.record_id for e in batch])
            yield Statement(
                f"UPDATE memory_records SET embedding_model = ? WHERE {records}",
                (model, *record_params),
            )
            queued, queued_params = dialect.one_of("id", [e.id for e in batch])
            yield Statement(f"DELETE FROM memory_outbox WHERE {queued}", queued_params)

    def fail(self, entries: Sequence[OutboxEntry], error: str) -> None:
        if not entries:
            return
        dialect = self.db.dialect
        statements = []
        for batch in dialect.batches(entries):
            queued, params = dialect.one_of("id", [e.id for e in batch])
            statements.append(
                Statement(
                    "UPDATE memory_outbox SET attempts = attempts + 1, last_error = ? "
                    f"WHERE {queued}",
                    (error[:2000], *params),
                )
            )
        self.db.run(lambda: _all_changed(statements))

    def enqueue_reembed(self, model: str) -> int:
        statements = [
            # Entries that ran out of attempts (an embedder was down) get a fresh start.
            Statement("UPDATE memory_outbox SET attempts = 0 WHERE attempts > 0"),
            Statement(
                "INSERT INTO memory_outbox (record_id, created_at) "
                "SELECT id, ? FROM memory_records r WHERE "
                "(r.embedding_model IS NULL OR r.embedding_model <> ?) "
                "AND NOT EXISTS (SELECT 1 FROM memory_outbox o WHERE o.record_id = r.id)",
                (time.time(), model),
            ),
        ]
        return self.db.run(lambda: _all_changed(statements))

    def embedding_models(self) -> dict[str, int]:
        query = Statement(
            "SELECT COALESCE(embedding_model, ''), COUNT(*) FROM memory_records "
            "GROUP BY COALESCE(embedding_model, '')"
        )
        rows = self.db.run(lambda: rows_of(query), write=False)
        return {str(model): int(count) for model, count in rows}


# A session's neighbouring turns are listed (``turn IN (...)``) up to this many in all; more
# are read as ranges.
_LISTED_TURNS = 64


def spans_by_session(
    spans: Sequence[tuple[str, int, int]],
) -> list[tuple[str, list[int] | tuple[int, int]]]:
    """``spans`` (session, first turn, last turn) as conditions: a session's turns listed
    (one look-up of the session index each, where each span was a range scan of its own,
    and the spans of hits a turn or two apart overlap), or where they are more than
    `_LISTED_TURNS`, its spans merged into ranges. The same rows either way."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    for session_id, first, last in sorted(spans):
        if first > last:
            continue
        merged = ranges.setdefault(session_id, [])
        if merged and first <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], last))
        else:
            merged.append((first, last))
    conditions: list[tuple[str, list[int] | tuple[int, int]]] = []
    for session_id, merged in ranges.items():
        if sum(last - first + 1 for first, last in merged) <= _LISTED_TURNS:
            conditions.append(
                (session_id, [turn for first, last in merged for turn in range(first, last + 1)])
            )
        else:
            conditions.extend((session_id, span) for span in merged)
    return conditions


def count_records(scope: Scope | None) -> Plan[int]:
    """`SQLMemoryStore.count` as a plan (keyword search plans with the scope's size)."""
    statement: str = "SELECT COUNT(*) FROM memory_records"
    params: tuple[str, ...] = ()
    if scope is not None:
        statement, params = f"{statement} WHERE {_IN_SCOPE}", (scope.tenant_id, scope.user_id)
    return int((yield Statement(statement, params)).rows[0][0])


def stored_content(record: MemoryRecord) -> Plan[MemoryRecord]:
    """The record of ``record``'s scope with its content (there: its insert conflicted)."""
    found = yield Statement(
        f"SELECT {_COLUMNS} FROM memory_records WHERE {_IN_SCOPE} AND content_hash = ?",
        (record.tenant_id, record.user_id, record.content_hash),
    )
    return record_from_row(found.rows[0])


def _supersede(record: MemoryRecord) -> Plan[tuple[str, ...]]:
    """End the other current values of ``record``'s fact where its own validity begins;
    their ids."""
    ended = yield Statement(
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
    )
    return tuple(str(row[0]) for row in ended.rows)


def _records(result: Result) -> list[MemoryRecord]:
    return [record_from_row(row) for row in result.rows]


def rows_of(query: Statement) -> Plan[list[Any]]:
    """The rows ``query`` returns."""
    return (yield query).rows


def ids_of(statements: Sequence[Statement]) -> Plan[list[str]]:
    found: list[str] = []
    for statement in statements:
        found.extend(str(row[0]) for row in (yield statement).rows)
    return found


def _changed(statement: Statement) -> Plan[int]:
    return int((yield statement).rowcount)


def _all_changed(statements: Sequence[Statement]) -> Plan[int]:
    total = 0
    for statement in statements:
        total += int((yield statement).rowcount)
    return total


def require_database(database: object, kind: type[_D], store: str) -> _D:
    """``database`` when it is a ``kind``: a store is given an open database to share, never
    a path or URL ([`Backends`][] opens those)."""
    if not isinstance(database, kind):
        raise UsageError(
            f"{store} takes a {kind.__name__}, not a value of type {type(database).__name__}: "
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
