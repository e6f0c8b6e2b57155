"""A memory store's erasure of a user and its retention, over SQL on both engines: the part of
[`SQLMemoryStore`][keel.stores.SQLMemoryStore] that deletes a scope or a tenant's records
past its policy (`keel.memory.prune_memory`), kept apart from its reads and writes.

An engine says where its vectors are (`_vector_table_names`) and what it does once a scope's
rows are gone (`_after_erasure`: SQLite merges its full-text index).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from keel.errors import UsageError
from keel.memory._records import MemoryKind
from keel.memory._rows import RecordCache, to_epoch
from keel.stores._erase_sql import count_deleted
from keel.stores._keywords import TermFrequencies
from keel.stores._migrations import Migration
from keel.stores._sql_plan import Plan, SQLDatabase, Statement

__all__ = ["DELETIONS_MIGRATION", "MemoryErasure", "deleting"]

DELETIONS_MIGRATION = Migration(
    "memory_deletions counts the transactions that deleted records, for every process",
    # Read with the table's size by each keyword search: a change says that rows went (in this
    # process or another: a worker that erased a user, `keel memory prune`), so the term counts
    # kept are dropped (see keel.stores._keywords.TermFrequencies.saw_deletions).
    """
    CREATE TABLE memory_deletions (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        deletions BIGINT NOT NULL
    );
    INSERT INTO memory_deletions (id, deletions) VALUES (1, 0);
    """,
)
_COUNT_DELETION = Statement("UPDATE memory_deletions SET deletions = deletions + 1")

_IN_SCOPE = "tenant_id = ? AND user_id = ?"


class MemoryErasure:
    """A user's erasure and memory's retention, for a SQL memory store (a mixin: the store
    gives its migrated `db` and `inserted_order`)."""

    inserted_order: str
    _term_frequencies: TermFrequencies
    records: RecordCache
    db: SQLDatabase

    def user_sessions(self, tenant_id: str, user_id: str) -> list[str]:
        query = Statement(
            f"SELECT DISTINCT session_id FROM memory_records WHERE {_IN_SCOPE} "
            "AND session_id IS NOT NULL",
            (tenant_id, user_id),
        )
        rows = self.db.run(lambda: _rows(query), write=False)
        return sorted(str(session_id) for (session_id,) in rows)

    def erase_user(self, tenant_id: str, user_id: str) -> dict[str, int]:
        counts = self.db.run(lambda: self._erase_user(tenant_id, user_id))
        # The counts of the user's words go with the rows (and the words with them), and so
        # do the records this process built from their rows.
        self._term_frequencies.forget(tenant_id, user_id)
        self.records.forget(tenant_id, user_id)
        return counts

    def _erase_user(self, tenant_id: str, user_id: str) -> Plan[dict[str, int]]:
        """The scope's outbox rows, vectors and records (their keyword index entries go with
        them), in one transaction; the engine's `_after_erasure` then."""
        counts: dict[str, int] = {}
        params = (tenant_id, user_id)
        outbox = (
            "DELETE FROM memory_outbox WHERE record_id IN "
            f"(SELECT id FROM memory_records WHERE {_IN_SCOPE})"
        )
        yield from count_deleted(counts, "memory_outbox", outbox, params)
        for table in (yield from self._vector_table_names()):
            delete = f"DELETE FROM {table} WHERE {_IN_SCOPE}"
            yield from count_deleted(counts, "memory_vectors", delete, params)
        delete = f"DELETE FROM memory_records WHERE {_IN_SCOPE}"
        yield from count_deleted(counts, "memory_records", delete, params)
        if counts.get("memory_records"):
            yield _COUNT_DELETION
        yield from self._after_erasure(tenant_id, user_id)
        return counts

    def _vector_table_names(self) -> Plan[list[str]]:
        """The tables holding vectors (each with ``tenant_id`` and ``user_id`` columns)."""
        raise NotImplementedError

    def _after_erasure(self, tenant_id: str, user_id: str) -> Plan[None]:
        """What the engine does once a scope's rows are deleted, in the same transaction."""
        yield from ()

    def tenants(self) -> list[str]:
        query = Statement("SELECT DISTINCT tenant_id FROM memory_records ORDER BY tenant_id")
        rows = self.db.run(lambda: _rows(query), write=False)
        return [str(tenant_id) for (tenant_id,) in rows]

    def prune(
        self, tenant_id: str, kind: MemoryKind, *, before: datetime | None, keep: int | None
    ) -> int:
        if keep is not None and keep < 0:
            raise UsageError(f"keep must be 0 or more, not {keep}")
        statements: list[Statement] = []
        if before is not None:
            statements.append(
                Statement(
                    "DELETE FROM memory_records WHERE tenant_id = ? AND kind = ? "
                    "AND created_at < ?",
                    (tenant_id, kind, to_epoch(before)),
                )
            )
        if keep is not None:
            # Each user's newest ``keep`` of the kind stay (ties broken by insertion order).
            order = self.inserted_order
            ranked = (
                "SELECT id, ROW_NUMBER() OVER (PARTITION BY user_id "
                f"ORDER BY created_at DESC, {order} DESC) AS newest "
                "FROM memory_records WHERE tenant_id = ? AND kind = ?"
            )
            statements.append(
                Statement(
                    "DELETE FROM memory_records WHERE id IN "
                    f"(SELECT id FROM ({ranked}) ranked WHERE newest > ?)",
                    (tenant_id, kind, int(keep)),
                )
            )
        if not statements:
            return 0
        deleted = self.db.run(lambda: deleting(statements))
        if deleted:
            self._term_frequencies.forget(tenant_id)
        return deleted


def _rows(query: Statement) -> Plan[list[Any]]:
    return list((yield query).rows)


def deleting(statements: Sequence[Statement]) -> Plan[int]:
    """The records ``statements`` delete, counted in ``memory_deletions`` (in the same
    transaction) when there are any: every process's term counts learn that rows went."""
    total = 0
    for statement in statements:
        total += int((yield statement).rowcount)
    if total:
        yield _COUNT_DELETION
    return total
