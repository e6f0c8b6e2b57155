"""How one SQL engine's statements differ from keel's: the one place the SQLite and PostgreSQL
stores disagree on spelling.

Each store's statements are written once, with ``?`` markers, over a `SqlDialect`
(see ``_sql_journal.py``), as plans its database runs; the per-engine modules keep only what
really differs (vector search, full text, secure delete, a pipelined batch).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

__all__ = ["POSTGRES", "SQLITE", "SqlDialect"]

_T = TypeVar("_T")


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)


def _microseconds(value: datetime | None) -> int | None:
    # Integer microseconds round-trip exactly, unlike float seconds.
    return None if value is None else (value - _EPOCH) // _MICROSECOND


def _from_microseconds(value: int | None) -> datetime | None:
    return None if value is None else _EPOCH + value * _MICROSECOND


def _json_text(value: Any) -> str | None:
    return None if value is None else json.dumps(value, ensure_ascii=False)


def _from_json_text(value: str | None) -> Any:
    return None if value is None else json.loads(value)


def _jsonb(value: Any) -> object:
    """A ``jsonb`` parameter (SQL NULL for None: a JSON null and SQL NULL differ in jsonb)."""
    from psycopg.types.json import Jsonb  # the 'postgres' extra: only a PostgreSQL store calls

    return None if value is None else Jsonb(value)


def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class SqlDialect:
    """How one engine's SQL differs from the statements keel writes once.

    Args:
        name: ``"sqlite"`` or ``"postgres"``, for the rare branch no field expresses.
        placeholder: the parameter marker (``?`` for sqlite3, ``%s`` for psycopg).
        flag: a boolean as a column stores it (SQLite has no boolean type).
        to_time, from_time: a ``timestamp`` column's value, written and read (SQLite keeps
            exact integer Unix microseconds; PostgreSQL ``timestamptz``). None stays None.
        to_json, from_json: a ``json`` column's value, written and read (SQLite keeps text).
        arrays: the driver binds a list as one array parameter (``= ANY(%s)``); otherwise
            `one_of` spells ``IN (?, ?, ...)``.
        time_type, json_type, real_type, big_int_type, flag_type, bytes_type: column types
            in DDL (``bytes_type``: raw bytes, read back as ``bytes``).
        add_column: ``ALTER TABLE`` words that add a column (idempotent where the engine can).
        least: the two-argument minimum function.
        byte_length: the expression for a text column's size in bytes (``{}``: the column).
        plus_seconds: a ``timestamp`` column plus seconds (``{}``: the column, the seconds).
        row_lock: what a ``SELECT`` ends with to lock the rows it reads until the transaction
            ends (SQLite needs none: its write transaction holds the whole file).
        most_values: the most values `batches` puts in one list (0: no bound); SQLite
            caps a statement's parameters.
        skip_index: put before a column, keeps the planner from reaching rows through that
            column's indexes (SQLite's unary ``+``), so a look-up by key uses the key's index
            and not a scope's; PostgreSQL's planner needs no such hint.
        json_marker: the marker of a JSON parameter (PostgreSQL casts it to ``jsonb``).
    """

    name: str
    placeholder: str
    flag: Callable[[bool], object]

    to_time: Callable[[datetime | None], object] = _microseconds
    from_time: Callable[[Any], datetime | None] = _from_microseconds
    to_json: Callable[[Any], object] = _json_text
    from_json: Callable[[Any], Any] = _from_json_text
    arrays: bool = False
    time_type: str = "INTEGER"
    json_type: str = "TEXT"
    real_type: str = "REAL"
    big_int_type: str = "INTEGER"
    flag_type: str = "INTEGER"
    bytes_type: str = "BLOB"
    add_column: str = "ADD COLUMN"
    least: str = "MIN"
    byte_length: str = "length(CAST({} AS BLOB))"
    plus_seconds: str = "{} + CAST(1000000 * ({}) AS INTEGER)"
    row_lock: str = ""
    most_values: int = 0
    skip_index: str = ""
    json_marker: str = "?"

    def sql(self, statement: str) -> str:
        """``statement``, written with ``?`` markers, in this dialect."""
        return statement.replace("?", self.placeholder)

    def one_of(self, column: str, values: Sequence[object]) -> tuple[str, tuple[object, ...]]:
        """``column`` equal to one of ``values`` (not empty): the condition, with ``?``
        markers, and its parameters."""
        if self.arrays:
            return f"{column} = ANY(?)", (list(values),)
        return f"{column} IN ({', '.join('?' for _ in values)})", tuple(values)

    def batches(self, values: Sequence[_T]) -> Iterator[Sequence[_T]]:
        """``values`` in lists `one_of` takes in one statement (none when empty)."""
        size = self.most_values or max(len(values), 1)
        for start in range(0, len(values), size):
            yield values[start : start + size]


SQLITE = SqlDialect(name="sqlite", placeholder="?", flag=int, most_values=500, skip_index="+")
POSTGRES = SqlDialect(
    name="postgres",
    placeholder="%s",
    flag=bool,
    to_time=_same,
    from_time=_same,
    to_json=_jsonb,
    from_json=_same,
    arrays=True,
    time_type="TIMESTAMPTZ",
    json_type="JSONB",
    real_type="DOUBLE PRECISION",
    big_int_type="BIGINT",
    flag_type="BOOLEAN",
    bytes_type="BYTEA",
    add_column="ADD COLUMN IF NOT EXISTS",
    least="LEAST",
    byte_length="octet_length({})",
    plus_seconds="{} + make_interval(secs => {})",
    row_lock=" FOR UPDATE",
    json_marker="?::jsonb",
)
