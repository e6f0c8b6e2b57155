"""One store operation's statements, written once and run by a sync or an async driver.

A *plan* is a generator that yields `Statement` objects and is sent each one's
`Result`; what it returns is the operation's result, what it raises (a conflict, a
missing row) leaves through the runner and rolls the transaction back. The same plan runs on
a sqlite3 cursor, a psycopg cursor, or a psycopg async cursor: the statements and the logic
between them are never written twice for sync and async.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, Sequence
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

from keel.errors import UsageError
from keel.stores._dialect import SqlDialect
from keel.stores._migrations import MigrationSet

__all__ = [
    "Plan",
    "Result",
    "Rider",
    "RiderFailed",
    "SQLDatabase",
    "Statement",
    "Write",
    "arun_plan",
    "ride",
    "riders_for",
    "riding",
    "run_plan",
    "run_statement",
    "table_names",
]

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

Write = bool | Literal["statement"]
"""How a database runs a plan: True, a write transaction; False, a read; ``"statement"``, a
write of one statement, atomic on its own without BEGIN and COMMIT (SQLite still queues it
behind the process's other writes, PostgreSQL runs it in autocommit)."""


class SQLDatabase(Protocol):
    """What a store needs of its database ([`SQLiteDatabase`][keel.stores.SQLiteDatabase] or
    [`PostgresDatabase`][keel.stores.PostgresDatabase]): a store is one class over it, and
    uses nothing else of it."""

    @property
    def dialect(self) -> SqlDialect:
        """How the engine's SQL differs."""

    def run(self, plan: Callable[[], Plan[_T]], *, write: Write = True) -> _T:
        """Run the statements of ``plan()``: in one transaction when ``write`` is True; a
        write of one statement, atomic on its own, with ``"statement"``."""

    async def arun(self, plan: Callable[[], Plan[_T]], *, write: Write = True) -> _T:
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


def run_statement(cursor: Any, dialect: SqlDialect, plan: Plan[_T]) -> _T:
    """Run ``plan``, a plan of one statement, on a DB-API cursor (``UsageError`` for a
    second one: a write run as one statement has no transaction to hold two)."""
    statement = next(plan)
    cursor.execute(dialect.sql(statement.sql), statement.params)
    rows = cursor.fetchall() if cursor.description is not None else []
    try:
        plan.send(Result(rows, cursor.rowcount))
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    plan.close()
    raise UsageError("a write run as one statement went on to a second statement")


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


class Rider:
    """A plan that rides along with the next write transaction on ``db`` made in its context
    (see [`riding`][keel.stores._sql_plan.riding]): two writes for one commit.

    It runs after the write's own plan, and its failure never undoes that write: ``error``
    keeps it and the write commits without it (the transaction is rolled back and the write
    made again alone, see [`RiderFailed`][keel.stores._sql_plan.RiderFailed]; or, in a
    transaction the write joined, the rider is rolled back to a savepoint). ``ran`` is set
    once the transaction that carried it has committed; a rider that neither ran nor failed
    met no write on ``db`` (its caller writes it on its own).
    """

    __slots__ = ("db", "error", "plan", "ran")

    def __init__(self, db: object, plan: Callable[[], Plan[None]]) -> None:
        self.db = db
        self.plan = plan
        self.ran = False
        self.error: Exception | None = None


_riders: ContextVar[tuple[Rider, ...]] = ContextVar("keel_plan_riders", default=())


class riding:
    """Writes on ``rider.db`` inside this block carry ``rider`` (the first one that commits
    runs it; a no-op for None). A class, not a generator: it is entered on every checkpoint."""

    __slots__ = ("_rider", "_token")

    def __init__(self, rider: Rider | None) -> None:
        self._rider = rider
        self._token: Token[tuple[Rider, ...]] | None = None

    def __enter__(self) -> None:
        if self._rider is not None:
            self._token = _riders.set((*_riders.get(), self._rider))

    def __exit__(self, *exc_info: object) -> None:
        if self._token is not None:
            _riders.reset(self._token)


def riders_for(db: object) -> tuple[Rider, ...]:
    """The riders waiting for a write on ``db`` in this context."""
    waiting = _riders.get()
    if not waiting:
        return ()
    return tuple(r for r in waiting if r.db is db and not r.ran and r.error is None)


class RiderFailed(Exception):
    """A rider's plan failed in the transaction it rode (raised by `ride`): the transaction is
    to be rolled back and its write made again without it."""

    def __init__(self, rider: Rider, error: Exception) -> None:
        super().__init__(f"a rider failed: {error}")
        self.rider = rider
        self.error = error


def ride(cursor: Any, dialect: SqlDialect, riders: tuple[Rider, ...]) -> None:
    """Run ``riders`` in the open transaction of their write, without a savepoint each (two
    statements a rider saved on every write): a rider that fails raises `RiderFailed`, and
    its caller rolls the whole transaction back and makes the write again without it, so the
    failure still never undoes the write. A rider failing is rare; a savepoint was paid on
    every write."""
    for rider in riders:
        try:
            run_plan(cursor, dialect, rider.plan())
        except Exception as exc:
            raise RiderFailed(rider, exc) from exc


def run_riders(cursor: Any, dialect: SqlDialect, riders: tuple[Rider, ...]) -> list[Rider]:
    """Run each of ``riders`` in a savepoint of the open transaction (one the write joined,
    which is not its to roll back); the ones that ran (to be marked ``ran`` once it commits).
    A rider that fails is rolled back to its savepoint, its error kept on it."""
    carried = []
    for rider in riders:
        cursor.execute("SAVEPOINT keel_rider")
        try:
            run_plan(cursor, dialect, rider.plan())
        except Exception as exc:
            try:
                cursor.execute("ROLLBACK TO keel_rider")
                cursor.execute("RELEASE keel_rider")
            except Exception:
                # The engine ended the whole transaction (a full disk): the write fails
                # with the rider's error, as it would have on its own.
                raise exc from None
            rider.error = exc
            continue
        cursor.execute("RELEASE keel_rider")
        carried.append(rider)
    return carried


def table_names(sql: SQLDatabase) -> set[str]:
    """The tables of ``sql`` (SQLite's schema, PostgreSQL's current schema)."""
    query = (
        "SELECT name FROM sqlite_master WHERE type = 'table'"
        if sql.dialect.name == "sqlite"
        else "SELECT table_name FROM information_schema.tables "
        "WHERE table_schema = current_schema()"
    )

    def plan() -> Plan[set[str]]:
        return {str(name) for (name,) in (yield Statement(query)).rows}

    return sql.run(plan, write=False)
