"""One store operation's statements, written once and run by a sync or an async driver.

A *plan* is a generator that yields `Statement` objects and is sent each one's
`Result`; what it returns is the operation's result, what it raises (a conflict, a
missing row) leaves through the runner and rolls the transaction back. The same plan runs on
a sqlite3 cursor, a psycopg cursor, or a psycopg async cursor: the statements and the logic
between them are never written twice for sync and async.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from keel.stores._dialect import SqlDialect
from keel.stores._migrations import MigrationSet

__all__ = ["Plan", "Result", "SQLDatabase", "Statement", "arun_plan", "run_plan"]

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Statement:
    """One statement, with ``?`` markers, and its parameters (a list of rows for ``many``;
    names, for a statement written in the driver's own ``%(name)s`` style)."""

    sql: str
    params: Sequence[Any] | Mapping[str, Any] = ()
    many: bool = False


@dataclass(frozen=True, slots=True)
class Result:
    """What a statement returned: its rows (none for a statement without a result) and the
    number of rows it changed."""

    rows: list[Any]
    rowcount: int


Plan = Generator[Statement, Result, _T]
"""The statements of one operation; returns its result."""


class SQLDatabase(Protocol):
    """What a store needs of its database ([`SQLiteDatabase`][keel.stores.SQLiteDatabase] or
    [`PostgresDatabase`][keel.stores.PostgresDatabase]): a store is one class over it, and
    uses nothing else of it."""

    @property
    def dialect(self) -> SqlDialect:
        """How the engine's SQL differs."""

    def run(self, plan: Callable[[], Plan[_T]], *, write: bool = True) -> _T:
        """Run the statements of ``plan()``: in one transaction when ``write``."""

    async def arun(self, plan: Callable[[], Plan[_T]], *, write: bool = True) -> _T:
        """Async twin of ``run``."""

    def migrate(self, migrations: MigrationSet) -> None:
        """Apply ``migrations``; idempotent."""

    async def acall(self, call: Callable[[], _T]) -> _T:
        """Run the blocking ``call`` for an event loop, the way the engine should."""


def run_plan(cursor: Any, dialect: SqlDialect, plan: Plan[_T]) -> _T:
    """Run ``plan`` on a DB-API cursor (sqlite3 or psycopg)."""
    try:
        statement = next(plan)
        while True:
            sql = dialect.sql(statement.sql)
            if statement.many:
                cursor.executemany(sql, statement.params)
            else:
                cursor.execute(sql, statement.params)
            rows = cursor.fetchall() if cursor.description is not None else []
            statement = plan.send(Result(rows, cursor.rowcount))
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


async def arun_plan(cursor: Any, dialect: SqlDialect, plan: Plan[_T]) -> _T:
    """Run ``plan`` on a psycopg async cursor: the statements of `run_plan`, awaited."""
    try:
        statement = next(plan)
        while True:
            sql = dialect.sql(statement.sql)
            if statement.many:
                await cursor.executemany(sql, statement.params)
            else:
                await cursor.execute(sql, statement.params)
            rows = await cursor.fetchall() if cursor.description is not None else []
            statement = plan.send(Result(rows, cursor.rowcount))
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
