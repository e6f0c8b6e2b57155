"""How one SQL engine's statements differ from keel's: the one place the SQLite and PostgreSQL
stores disagree on spelling.

Each store's statements are written once, with ``?`` markers, over a :class:`SqlDialect`
(see ``_sql_journal.py``); the per-engine modules keep only what really differs (how a
connection and a transaction are opened, vector search, full text, compare-and-set specifics).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["POSTGRES", "SQLITE", "SqlDialect"]


@dataclass(frozen=True)
class SqlDialect:
    """How one engine's SQL differs from the statements keel writes once.

    Args:
        name: ``"sqlite"`` or ``"postgres"``, for the rare branch no field expresses.
        placeholder: the parameter marker (``?`` for sqlite3, ``%s`` for psycopg).
        flag: a boolean as a column stores it (SQLite has no boolean type).
    """

    name: str
    placeholder: str
    flag: Callable[[bool], object]

    def sql(self, statement: str) -> str:
        """``statement``, written with ``?`` markers, in this dialect."""
        return statement.replace("?", self.placeholder)


SQLITE = SqlDialect(name="sqlite", placeholder="?", flag=int)
POSTGRES = SqlDialect(name="postgres", placeholder="%s", flag=bool)
