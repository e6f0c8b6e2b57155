"""How one SQL engine's statements differ from keel's: the one place the SQLite and PostgreSQL
stores disagree on spelling.

Each store's statements are written once, with ``?`` markers, over a :class:`SqlDialect`
(see ``_sql_journal.py``); the per-engine modules keep only what really differs (how a
connection and a transaction are opened, vector search, full text, compare-and-set specifics).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["POSTGRES", "SQLITE", "SqlDialect"]

_T = TypeVar("_T")


@dataclass(frozen=True)
class SqlDialect:
    """How one engine's SQL differs from the statements keel writes once.

    Args:
        name: ``"sqlite"`` or ``"postgres"``, for the rare branch no field expresses.
        placeholder: the parameter marker (``?`` for sqlite3, ``%s`` for psycopg).
        flag: a boolean as a column stores it (SQLite has no boolean type).
        arrays: the driver binds a list as one array parameter (``= ANY(%s)``); otherwise
            :meth:`one_of` spells ``IN (?, ?, ...)``.
        most_values: the most values :meth:`batches` puts in one list (0: no bound); SQLite
            caps a statement's parameters.
        skip_index: put before a column, keeps the planner from reaching rows through that
            column's indexes (SQLite's unary ``+``), so a look-up by key uses the key's index
            and not a scope's; PostgreSQL's planner needs no such hint.
        json_marker: the marker of a JSON parameter (PostgreSQL casts it to ``jsonb``).
    """

    name: str
    placeholder: str
    flag: Callable[[bool], object]
    arrays: bool = False
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
        """``values`` in lists :meth:`one_of` takes in one statement (none when empty)."""
        size = self.most_values or max(len(values), 1)
        for start in range(0, len(values), size):
            yield values[start : start + size]


SQLITE = SqlDialect(name="sqlite", placeholder="?", flag=int, most_values=500, skip_index="+")
POSTGRES = SqlDialect(
    name="postgres", placeholder="%s", flag=bool, arrays=True, json_marker="?::jsonb"
)
