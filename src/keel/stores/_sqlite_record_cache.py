"""Records a SQLite memory store trusts across turns, kept in step with every writer.

A recall reads the same records turn after turn: its forty ranked candidates by id and the
neighbouring turns of its hits by session and turn. Each read was a statement and its rows
(about 3M instructions of a late recall). Here they are kept, and each read first asks the
database what changed since: triggers on ``memory_records`` log each inserted, updated and
deleted row's id and turn in ``memory_changes``, whoever writes it (this process on any of
its connections, another process, ``keel memory prune``, an erasure, a hand-written
``DELETE``), in the writer's own transaction. A read applies the changes it has not seen (one
indexed statement, no rows when nothing changed), dropping what they touched, then serves
what it still holds and reads the rest.

Why a log, not ``PRAGMA data_version``: each thread has a connection, and the version moves
on every commit of another connection, this process's own included (a turn's checkpoint, the
outbox's embeddings): it would clear everything every turn, and tell nothing of what changed.

What is kept:

- records by id, each with its row, for `fetch_by_id` and `fetch`:
  a kept record is returned when its row passes the filter (`row_passes`, the filter's SQL
  evaluated on the row: the same clock reading rule, expiry judged at each read);
- the records of one session's turn, in the table's order, for ``turns_around``; any change
  to a row of that turn number (in any session) drops them, an insert included.

The log keeps its newest 4,096 entries; a reader further behind (a gap in the sequence)
drops everything. A read inside a transaction bypasses all this (a write's reads may roll
back, a snapshot's may be older than what was applied). Records read by a thread that another
thread's catching up overtook are not kept (their row may predate a change already applied).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from keel.memory._records import MemoryFilter, MemoryRecord, Scope
from keel.memory._rows import RECORD_COLUMNS, to_epoch
from keel.stores._migrations import Migration
from keel.stores._sql_plan import Plan, Statement

__all__ = ["CHANGES_MIGRATION", "TrustedRecords", "row_passes"]

CHANGES_MIGRATION = Migration(
    "memory_changes logs the id and turn of every record inserted, updated or deleted",
    # Written by triggers, so every writer logs, whatever its code; read by each process's
    # record cache (keel.stores._sqlite_record_cache). Only ids and turn numbers: nothing of
    # a user (an erasure leaves these). The newest 4,096 entries stay.
    """
    CREATE TABLE memory_changes (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        record_id TEXT NOT NULL,
        turn INTEGER
    );
    CREATE TRIGGER memory_changes_ai AFTER INSERT ON memory_records BEGIN
        INSERT INTO memory_changes (record_id, turn) VALUES (new.id, new.turn);
    END;
    CREATE TRIGGER memory_changes_au AFTER UPDATE ON memory_records BEGIN
        INSERT INTO memory_changes (record_id, turn) VALUES (old.id, old.turn);
    END;
    CREATE TRIGGER memory_changes_au_moved AFTER UPDATE ON memory_records
    WHEN new.id IS NOT old.id OR new.turn IS NOT old.turn BEGIN
        INSERT INTO memory_changes (record_id, turn) VALUES (new.id, new.turn);
    END;
    CREATE TRIGGER memory_changes_ad AFTER DELETE ON memory_records BEGIN
        INSERT INTO memory_changes (record_id, turn) VALUES (old.id, old.turn);
    END;
    CREATE TRIGGER memory_changes_trim AFTER INSERT ON memory_changes
    WHEN new.seq % 1024 = 0 BEGIN
        DELETE FROM memory_changes WHERE seq <= new.seq - 4096;
    END;
    """,
)

_C = {column: index for index, column in enumerate(RECORD_COLUMNS)}
_ID, _TENANT, _USER = _C["id"], _C["tenant_id"], _C["user_id"]
_KIND, _TYPE, _SESSION, _TURN = _C["kind"], _C["type"], _C["session_id"], _C["turn"]
_CREATED, _VALID_TO, _KEY, _EXPIRES = _C["created_at"], _C["valid_to"], _C["key"], _C["expires_at"]

TurnKey = tuple[str, str, str, int]
"""A scope's session's turn: tenant, user, session, turn."""


def row_passes(row: Sequence[Any], filters: MemoryFilter, alive_at: float | None) -> bool:
    """Whether ``row`` (``RECORD_COLUMNS`` order, as read) passes ``filters``: the conditions
    of `keel.memory._rows.filter_sql`, evaluated as SQL does on the same values (a NULL
    fails a comparison); ``alive_at``: the epoch seconds expiry is judged at (unused with
    ``include_expired``)."""
    if filters.kinds and row[_KIND] not in filters.kinds:
        return False
    if filters.types and row[_TYPE] not in filters.types:
        return False
    if filters.exclude_types and row[_TYPE] in filters.exclude_types:
        return False
    if filters.session_id is not None and row[_SESSION] != filters.session_id:
        return False
    if not filters.include_superseded and row[_VALID_TO] is not None:
        return False
    created = row[_CREATED]
    if filters.since is not None and not created >= to_epoch(filters.since):
        return False
    if filters.until is not None and not created < to_epoch(filters.until):
        return False
    key = row[_KEY]
    if filters.keys and key not in filters.keys:
        return False
    if filters.key_prefix is not None and (
        key is None or key[: len(filters.key_prefix)] != filters.key_prefix
    ):
        return False
    shown = filters.shown
    if (
        shown is not None
        and (shown.first_turn is not None or shown.summary_key is not None)
        and row[_SESSION] == shown.session_id
        and not (
            (shown.first_turn is None or row[_TURN] is None or row[_TURN] < shown.first_turn)
            and (shown.summary_key is None or key is None or key != shown.summary_key)
        )
    ):
        return False
    if filters.include_expired:
        return True
    expires = row[_EXPIRES]
    return expires is None or (alive_at is not None and expires > alive_at)


def alive_at(filters: MemoryFilter) -> float | None:
    """The epoch seconds a filter judges expiry at (the clock read now, as `filter_sql`
    reads it for each statement)."""
    return to_epoch(filters.alive_at or datetime.now(UTC))


class TrustedRecords:
    """The records and turns one store keeps across reads (see the module's docstring).

    ``seen``: the last ``memory_changes`` entry applied (None: none read yet, nothing
    kept). ``generation``: bumped by each clear and each `forget`; a read that began in an
    earlier one, or before entries it did not apply, keeps nothing.
    """

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self.seen: int | None = None
        self.generation = 0
        self.records: OrderedDict[str, tuple[MemoryRecord, tuple[Any, ...]]] = OrderedDict()
        self.turns: OrderedDict[TurnKey, tuple[MemoryRecord, ...]] = OrderedDict()
        self._by_turn: dict[int, set[TurnKey]] = {}
        self._lock = threading.Lock()
        #: Entries read from the log (changes applied), reads served, rows read: for tests.
        self.applied = 0
        self.served = 0

    # --- keeping in step --------------------------------------------------------------------

    def catch_up(self) -> Plan[tuple[int | None, int]]:
        """Apply the log's entries past ``seen``: a plan of one statement. Returns the
        position (seen, generation) a read that follows may keep its rows at."""
        seen = self.seen
        if seen is None:
            newest = (yield Statement("SELECT MAX(seq) FROM memory_changes")).rows[0][0]
            with self._lock:
                if self.seen is None:
                    self.seen = int(newest or 0)
                return self.seen, self.generation
        rows = (
            yield Statement(
                "SELECT seq, record_id, turn FROM memory_changes WHERE seq > ? ORDER BY seq",
                (seen,),
            )
        ).rows
        with self._lock:
            # Another thread may have applied some of them meanwhile (the log has no gaps
            # but where it was trimmed: the entries past ``current`` follow it).
            current = self.seen
            assert current is not None  # set by the first read, never unset
            newer = [row for row in rows if int(row[0]) > current]
            if newer:
                if int(newer[0][0]) != current + 1:  # the entries after it were trimmed
                    self._clear()
                else:
                    for _, record_id, turn in newer:
                        self._drop(str(record_id), turn)
                    self.applied += len(newer)
                self.seen = int(newer[-1][0])
            return self.seen, self.generation

    def _drop(self, record_id: str, turn: int | None) -> None:
        self.records.pop(record_id, None)
        if turn is not None:
            for key in self._by_turn.pop(int(turn), ()):
                self.turns.pop(key, None)

    def _clear(self) -> None:
        self.records.clear()
        self.turns.clear()
        self._by_turn.clear()
        self.generation += 1

    def forget(self, tenant_id: str | None = None, user_id: str | None = None) -> None:
        """Drop what is kept of ``tenant_id``'s ``user_id`` (erased), or everything."""
        with self._lock:
            self.generation += 1
            if tenant_id is None or user_id is None:
                self._clear()
                return
            for record_id in [
                record_id
                for record_id, (_, row) in self.records.items()
                if row[_TENANT] == tenant_id and row[_USER] == user_id
            ]:
                del self.records[record_id]
            for key in [key for key in self.turns if key[:2] == (tenant_id, user_id)]:
                del self.turns[key]
                self._by_turn.get(key[3], set()).discard(key)

    # --- by id ------------------------------------------------------------------------------

    def kept(
        self, scope: Scope, record_ids: Sequence[str], filters: MemoryFilter
    ) -> tuple[dict[str, MemoryRecord], list[str]]:
        """The kept records of ``record_ids`` in ``scope`` that pass ``filters``, and the ids
        not kept (to be read)."""
        found: dict[str, MemoryRecord] = {}
        missing: list[str] = []
        when = None if filters.include_expired else alive_at(filters)
        records = self.records
        tenant, user = scope.tenant_id, scope.user_id
        for record_id in record_ids:
            entry = records.get(record_id)
            if entry is None:
                missing.append(record_id)
                continue
            record, row = entry
            if row[_TENANT] == tenant and row[_USER] == user and row_passes(row, filters, when):
                found[record_id] = record
        self.served += len(found)
        return found, missing

    def keep(
        self,
        position: tuple[int | None, int],
        rows: Sequence[tuple[Any, ...]],
        build: Callable[[tuple[Any, ...]], MemoryRecord],
    ) -> list[MemoryRecord]:
        """The records of ``rows`` (built by ``build``), kept when read at ``position``."""
        records = [build(row) for row in rows]
        with self._lock:
            if position != (self.seen, self.generation) or position[0] is None:
                return records
            for row, record in zip(rows, records, strict=True):
                self.records[record.id] = (record, row)
                self.records.move_to_end(record.id)
            while len(self.records) > self.size:
                self.records.popitem(last=False)
        return records

    # --- by turn ----------------------------------------------------------------------------

    def kept_turns(
        self, keys: Sequence[TurnKey]
    ) -> tuple[dict[TurnKey, tuple[MemoryRecord, ...]], list[TurnKey]]:
        """The kept records of each of ``keys``, and the keys not kept."""
        found: dict[TurnKey, tuple[MemoryRecord, ...]] = {}
        missing: list[TurnKey] = []
        turns = self.turns
        for key in keys:
            records = turns.get(key)
            if records is None:
                missing.append(key)
            else:
                found[key] = records
        self.served += len(found)
        return found, missing

    def keep_turns(
        self, position: tuple[int | None, int], read: dict[TurnKey, tuple[MemoryRecord, ...]]
    ) -> None:
        """Keep ``read`` (every one of its keys read whole at ``position``, empty ones too)."""
        with self._lock:
            if position != (self.seen, self.generation) or position[0] is None:
                return
            for key, records in read.items():
                self.turns[key] = records
                self.turns.move_to_end(key)
                self._by_turn.setdefault(key[3], set()).add(key)
            while len(self.turns) > self.size:
                old, _ = self.turns.popitem(last=False)
                self._by_turn.get(old[3], set()).discard(old)
