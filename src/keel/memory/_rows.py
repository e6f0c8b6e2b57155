"""Column conversions shared by the memory backends (datetimes as epoch seconds, JSON metadata)."""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from datetime import UTC, datetime
from typing import Any

from keel.memory._records import MemoryRecord

__all__ = [
    "RECORD_COLUMNS",
    "RecordCache",
    "current_fact_sql",
    "filter_sql",
    "from_epoch",
    "is_selective",
    "record_from_row",
    "record_to_row",
    "to_epoch",
]

RECORD_COLUMNS = (
    "id",
    "tenant_id",
    "user_id",
    "kind",
    "type",
    "text",
    "provenance",
    "verified_by",
    "session_id",
    "step",
    "turn",
    "created_at",
    "event_time",
    "subject",
    "attribute",
    "valid_from",
    "valid_to",
    "content_hash",
    "embedding_model",
    "metadata",
    "key",
    "expires_at",
)


def to_epoch(value: datetime | None) -> float | None:
    """Seconds since the epoch (naive datetimes are taken as UTC)."""
    if value is None:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.timestamp()


def from_epoch(value: float | None) -> datetime | None:
    """A UTC datetime from epoch seconds."""
    return None if value is None else datetime.fromtimestamp(float(value), UTC)


def record_to_row(record: MemoryRecord) -> tuple[Any, ...]:
    """The record's values in ``RECORD_COLUMNS`` order."""
    return (
        record.id,
        record.tenant_id,
        record.user_id,
        record.kind,
        record.type,
        record.text,
        record.provenance,
        record.verified_by,
        record.session_id,
        record.step,
        record.turn,
        to_epoch(record.created_at),
        to_epoch(record.event_time),
        record.subject,
        record.attribute,
        to_epoch(record.valid_from),
        to_epoch(record.valid_to),
        record.content_hash,
        record.embedding_model,
        json.dumps(record.metadata, sort_keys=True, default=str),
        record.key,
        to_epoch(record.expires_at),
    )


def record_from_row(row: tuple[Any, ...] | Any) -> MemoryRecord:
    """A record from a row in ``RECORD_COLUMNS`` order."""
    values = dict(zip(RECORD_COLUMNS, tuple(row), strict=True))
    for key in ("created_at", "event_time", "valid_from", "valid_to", "expires_at"):
        values[key] = from_epoch(values[key])
    metadata = values["metadata"]
    values["metadata"] = json.loads(metadata) if isinstance(metadata, str) else (metadata or {})
    return MemoryRecord.model_validate(values)


class RecordCache:
    """Records built from rows, kept by the row's values: a row read again unchanged (the same
    turns recalled turn after turn) is the record built the first time, not validated again
    (about 6 us a record, most of a read's cost past the SQL). A row that changed in any
    column (superseded, embedded, given an expiry) is another key: nothing is invalidated, and
    what a read returns is always what the row holds now. The oldest of ``size`` go first.
    Records are frozen; the cached ones are shared between reads.
    """

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self.built = 0  # records validated from their rows (not found here)
        # Its oldest entry goes in one step (a plain dict's is found past every slot its
        # earlier drops emptied).
        self._records: OrderedDict[tuple[Any, ...], MemoryRecord] = OrderedDict()
        self._lock = threading.Lock()
        #: Bumped by each `forget`: rows read before it may be an erased user's, and the
        #: records built from them are not kept (see ``record``'s ``read_at``).
        self.forgets = 0

    def record(self, row: tuple[Any, ...] | Any, read_at: int | None = None) -> MemoryRecord:
        """The record of ``row`` (in ``RECORD_COLUMNS`` order); ``read_at``: ``forgets`` as it
        was before the row was read (a record of a row read before a `forget` is not kept)."""
        key = tuple(row)
        try:
            found = self._records.get(key)
        except TypeError:  # a value that is not hashable (a JSON column read as a dict)
            self.built += 1
            return record_from_row(key)
        if found is not None:
            return found
        record = record_from_row(key)
        with self._lock:
            self.built += 1
            if read_at is not None and read_at != self.forgets:
                return record
            if len(self._records) >= self.size:
                self._records.popitem(last=False)
            self._records[key] = record
        return record

    def forget(self, tenant_id: str, user_id: str) -> None:
        """Drop the records of ``tenant_id``'s ``user_id`` (erased: their rows are gone, and
        their texts should not outlive them in this process's memory either)."""
        with self._lock:
            self.forgets += 1
            for key in [
                key for key in self._records if key[_TENANT] == tenant_id and key[_USER] == user_id
            ]:
                del self._records[key]


_TENANT = RECORD_COLUMNS.index("tenant_id")
_USER = RECORD_COLUMNS.index("user_id")


def current_fact_sql(record: MemoryRecord, placeholder: str) -> tuple[str, tuple[Any, ...]]:
    """A query of the current value of ``record``'s fact in its scope (one row, or none;
    more only where writers raced before they took turns), and its parameters."""
    p = placeholder
    return (
        f"SELECT {', '.join(RECORD_COLUMNS)} FROM memory_records WHERE tenant_id = {p} "
        f"AND user_id = {p} AND subject = {p} AND attribute = {p} AND valid_to IS NULL",
        (record.tenant_id, record.user_id, record.subject, record.attribute),
    )


def filter_sql(filters: Any, placeholder: str, prefix: str = "") -> tuple[str, list[Any]]:
    """SQL conditions (joined with AND, possibly empty) and parameters for a MemoryFilter."""
    try:
        where, fixed = _fixed_filter_sql(filters, placeholder, prefix)
    except TypeError:  # a filter holding a value that is not hashable: made afresh
        where, fixed = _fixed_filter_sql.__wrapped__(filters, placeholder, prefix)
    params = list(fixed)
    if filters.include_expired:
        return where, params
    # The clock is read for each statement, never kept with the rest.
    alive = f"({prefix}expires_at IS NULL OR {prefix}expires_at > {placeholder})"
    params.append(to_epoch(filters.alive_at or datetime.now(UTC)))
    return (f"{where} AND {alive}" if where else alive), params


@functools.lru_cache(maxsize=256)
def _fixed_filter_sql(filters: Any, placeholder: str, prefix: str) -> tuple[str, tuple[Any, ...]]:
    """`filter_sql` but for expiry: made once per filter (a search runs the same filter in
    several statements, each of which made it again: 13 us a time)."""
    conditions: list[str] = []
    params: list[Any] = []
    p = placeholder
    if filters.kinds:
        conditions.append(f"{prefix}kind IN ({', '.join(p for _ in filters.kinds)})")
        params.extend(filters.kinds)
    if filters.types:
        conditions.append(f"{prefix}type IN ({', '.join(p for _ in filters.types)})")
        params.extend(filters.types)
    if filters.exclude_types:
        conditions.append(f"{prefix}type NOT IN ({', '.join(p for _ in filters.exclude_types)})")
        params.extend(filters.exclude_types)
    if filters.session_id is not None:
        conditions.append(f"{prefix}session_id = {p}")
        params.append(filters.session_id)
    if not filters.include_superseded:
        conditions.append(f"{prefix}valid_to IS NULL")
    if filters.since is not None:
        conditions.append(f"{prefix}created_at >= {p}")
        params.append(to_epoch(filters.since))
    if filters.until is not None:
        conditions.append(f"{prefix}created_at < {p}")
        params.append(to_epoch(filters.until))
    if filters.keys:
        conditions.append(f"{prefix}key IN ({', '.join(p for _ in filters.keys)})")
        params.extend(filters.keys)
    if filters.key_prefix is not None:
        # An equality on the key's first characters, not LIKE: '%' and '_' are just text.
        conditions.append(f"substr({prefix}key, 1, CAST({p} AS INTEGER)) = {p}")
        params.extend((len(filters.key_prefix), filters.key_prefix))
    if filters.shown is not None and (kept := _not_shown(filters.shown, p, prefix, params)):
        conditions.append(kept)
    return " AND ".join(conditions), tuple(params)


def _not_shown(shown: Any, p: str, prefix: str, params: list[Any]) -> str | None:
    """The condition that keeps the records a prompt does not show (a `ShownSession`): those
    of another session or of none, and those of the shown session before its first shown turn
    (or of no turn) that are not its summary; None when it shows nothing. Every NULL is tested
    for, so none makes the condition NULL and drops a record it should keep."""
    own: list[str] = []
    values: list[Any] = [shown.session_id]
    if shown.first_turn is not None:
        own.append(f"({prefix}turn IS NULL OR {prefix}turn < {p})")
        values.append(shown.first_turn)
    if shown.summary_key is not None:
        own.append(f"({prefix}key IS NULL OR {prefix}key <> {p})")
        values.append(shown.summary_key)
    if not own:
        return None
    params.extend(values)
    return f"({prefix}session_id IS NULL OR {prefix}session_id <> {p} OR {' AND '.join(own)})"


def is_selective(filters: Any) -> bool:
    """True when a filter narrows beyond 'current records' (kinds, types, session, time,
    keys)."""
    return bool(
        filters.kinds
        or filters.types
        or filters.session_id is not None
        or filters.since is not None
        or filters.until is not None
        or filters.keys
        or filters.key_prefix is not None
    )
