"""The tool journal's one implementation over SQL, for SQLite and PostgreSQL alike.

Both engines take the same statements (``INSERT ... ON CONFLICT DO NOTHING`` claims, epoch
seconds as floats); the `SqlDialect` carries what differs in the
SQL, and each engine's subclass says how it opens a write transaction and a read. Each
operation is a plan (``_sql_plan.py``), written once and run by the sync or the async runner.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any, TypeVar

from keel.errors import StoreError
from keel.messages import Message
from keel.stores._dialect import SqlDialect
from keel.stores._migrations import Migration, MigrationSet
from keel.stores._sql_plan import Plan, Result, Statement, arun_plan, run_plan
from keel.tools._journal import JournalClaim, JournalEntry, ToolJournal, entry_from_row

__all__ = ["AsyncSQLToolJournal", "SQLToolJournal", "journal_migrations"]


def journal_migrations(dialect: SqlDialect) -> MigrationSet:
    """The ``journal`` component's migrations in ``dialect``'s column types."""
    real = dialect.real_type
    return MigrationSet(
        "journal",
        (
            Migration(
                "tool-call intents and results, and each step's decided tool calls",
                f"""
                CREATE TABLE IF NOT EXISTS keel_tool_journal (
                    key TEXT PRIMARY KEY,
                    session_id TEXT NOT NULL,
                    step INTEGER NOT NULL,
                    call_index INTEGER NOT NULL,
                    tool TEXT NOT NULL,
                    arguments TEXT NOT NULL,
                    status TEXT NOT NULL CHECK (status IN ('started', 'succeeded', 'failed')),
                    ok {dialect.flag_type},
                    content TEXT,
                    output TEXT,
                    attempts INTEGER NOT NULL DEFAULT 1,
                    started_at {real} NOT NULL,
                    finished_at {real}
                );
                CREATE INDEX IF NOT EXISTS keel_tool_journal_session
                    ON keel_tool_journal (session_id, step, call_index);
                CREATE TABLE IF NOT EXISTS keel_tool_decisions (
                    session_id TEXT NOT NULL,
                    step INTEGER NOT NULL,
                    message TEXT NOT NULL,
                    created_at {real} NOT NULL,
                    PRIMARY KEY (session_id, step)
                );
                """,
            ),
        ),
    )


_COLUMNS = (
    "key, session_id, step, call_index, tool, arguments, status, ok, content, output, "
    "attempts, started_at, finished_at"
)
_NAMES = tuple(name.strip() for name in _COLUMNS.split(","))

_T = TypeVar("_T")


class SQLToolJournal(ToolJournal):
    """The journal's plans, run on the connections a subclass opens; the async twins run
    the same plans through `_arun` (the sync runner, through `_run_twin`,
    unless an engine's async driver runs them natively)."""

    dialect: SqlDialect

    @abstractmethod
    def _write(self) -> AbstractContextManager[Any]:
        """One write transaction's connection, driver errors translated."""

    @abstractmethod
    def _read(self) -> AbstractContextManager[Any]:
        """A connection for one read statement, driver errors translated."""

    def _where(self) -> str:
        """Where the journal is, for error messages ('' or ' in ...')."""
        return ""

    def _run(self, write: bool, plan: Callable[[], Plan[_T]]) -> _T:
        """Run the plan ``plan()`` builds (afresh: a call that moves may run again)."""
        with self._write() if write else self._read() as conn:
            return run_plan(conn.cursor(), self.dialect, plan())

    async def _arun(self, write: bool, plan: Callable[[], Plan[_T]]) -> _T:
        """Async twin of `_run`."""
        return await self._run_twin(lambda: self._run(write, plan))

    def _claim(self, params: tuple[Any, ...]) -> Plan[JournalClaim]:
        # The new entry comes back with the insert; an existing one takes a read.
        created = _entries((yield Statement(_CLAIM, params)))
        found = created or _entries((yield Statement(_SELECT, (params[0],))))
        if not found:  # pragma: no cover - inserted or present in the same transaction
            raise StoreError(f"journal entry {params[0]!r} vanished")
        return JournalClaim(created=bool(created), entry=found[0])

    def _update(self, key: str, assignments: str, params: tuple[Any, ...]) -> Plan[JournalEntry]:
        found = _entries((yield Statement(_returning(assignments), (*params, key))))
        if not found:
            raise StoreError(f"no journal entry {key!r}{self._where()}")
        return found[0]

    def _finish(self, key: str, ok: bool, content: str, output: str) -> Plan[JournalEntry]:
        status = "succeeded" if ok else "failed"
        params = (status, self.dialect.flag(ok), content, output, time.time())
        return self._update(key, _FINISH, params)

    def _record_decision(self, session_id: str, step: int, message: Message) -> Plan[Message]:
        params = (session_id, step, message.model_dump_json(), time.time())
        rows = (yield Statement(_RECORD_DECISION, params)).rows
        if not rows:  # decided before (a replay): that decision stands
            rows = (yield Statement(_DECISION, (session_id, step))).rows
        return Message.model_validate_json(rows[0][0])

    def claim(
        self,
        *,
        key: str,
        session_id: str,
        step: int,
        call_index: int,
        tool: str,
        arguments: str,
    ) -> JournalClaim:
        params = (key, session_id, step, call_index, tool, arguments, time.time())
        return self._run(True, lambda: self._claim(params))

    async def aclaim(
        self,
        *,
        key: str,
        session_id: str,
        step: int,
        call_index: int,
        tool: str,
        arguments: str,
    ) -> JournalClaim:
        params = (key, session_id, step, call_index, tool, arguments, time.time())
        return await self._arun(True, lambda: self._claim(params))

    def restart(self, key: str) -> JournalEntry:
        return self._run(True, lambda: self._update(key, _RESTART, ()))

    async def arestart(self, key: str) -> JournalEntry:
        return await self._arun(True, lambda: self._update(key, _RESTART, ()))

    def finish(self, key: str, *, ok: bool, content: str, output: str) -> JournalEntry:
        return self._run(True, lambda: self._finish(key, ok, content, output))

    async def afinish(self, key: str, *, ok: bool, content: str, output: str) -> JournalEntry:
        return await self._arun(True, lambda: self._finish(key, ok, content, output))

    def get(self, key: str) -> JournalEntry | None:
        found = self._run(False, lambda: _select(_SELECT, (key,)))
        return found[0] if found else None

    async def aget(self, key: str) -> JournalEntry | None:
        found = await self._arun(False, lambda: _select(_SELECT, (key,)))
        return found[0] if found else None

    def entries(
        self, session_id: str | None = None, *, in_doubt_only: bool = False
    ) -> list[JournalEntry]:
        clauses: list[str] = []
        params: list[Any] = []
        if session_id is not None:
            clauses.append("session_id = ?")
            params.append(session_id)
        if in_doubt_only:
            clauses.append("status = 'started'")
        where = f" WHERE {' AND '.join(clauses)}" if clauses else ""
        sql = (
            f"SELECT {_COLUMNS} FROM keel_tool_journal{where} ORDER BY started_at, step, call_index"
        )
        return self._run(False, lambda: _select(sql, params))

    def same_calls(self, session_id: str, tool: str, arguments: str) -> list[JournalEntry]:
        # keel_tool_journal_session narrows to the session; a session has few entries.
        return self._run(False, lambda: _select(_SAME_CALLS, (session_id, tool, arguments)))

    async def asame_calls(self, session_id: str, tool: str, arguments: str) -> list[JournalEntry]:
        return await self._arun(False, lambda: _select(_SAME_CALLS, (session_id, tool, arguments)))

    def record_decision(self, session_id: str, step: int, message: Message) -> Message:
        return self._run(True, lambda: self._record_decision(session_id, step, message))

    async def arecord_decision(self, session_id: str, step: int, message: Message) -> Message:
        return await self._arun(True, lambda: self._record_decision(session_id, step, message))

    def decision(self, session_id: str, step: int) -> Message | None:
        return self._run(False, lambda: _decision(session_id, step))

    async def adecision(self, session_id: str, step: int) -> Message | None:
        return await self._arun(False, lambda: _decision(session_id, step))


class AsyncSQLToolJournal(SQLToolJournal):
    """The journal over an engine whose driver is async too (psycopg): the async twins run
    the same plans on the event loop's own connections, with no worker thread between.

    Under load a worker thread is not free: it waits for the GIL while the loop runs other
    sessions' turns (up to the 5 ms switch interval each way), once per journal write.
    """

    @abstractmethod
    def _awrite(self) -> AbstractAsyncContextManager[Any]:
        """Async twin of `_write`."""

    @abstractmethod
    def _aread(self) -> AbstractAsyncContextManager[Any]:
        """Async twin of `_read`."""

    async def _arun(self, write: bool, plan: Callable[[], Plan[_T]]) -> _T:
        async with self._awrite() if write else self._aread() as conn:
            return await arun_plan(conn.cursor(), self.dialect, plan())


_CLAIM = (
    "INSERT INTO keel_tool_journal (key, session_id, step, call_index, tool, arguments, status, "
    "attempts, started_at) VALUES (?, ?, ?, ?, ?, ?, 'started', 1, ?) "
    f"ON CONFLICT (key) DO NOTHING RETURNING {_COLUMNS}"
)
_SELECT = f"SELECT {_COLUMNS} FROM keel_tool_journal WHERE key = ?"
_RESTART = "UPDATE keel_tool_journal SET attempts = attempts + 1"
_FINISH = (
    "UPDATE keel_tool_journal SET status = ?, ok = ?, content = ?, output = ?, finished_at = ?"
)
_SAME_CALLS = (
    f"SELECT {_COLUMNS} FROM keel_tool_journal WHERE session_id = ? AND tool = ? "
    "AND arguments = ? ORDER BY started_at, step, call_index"
)
_RECORD_DECISION = (
    "INSERT INTO keel_tool_decisions (session_id, step, message, created_at) "
    "VALUES (?, ?, ?, ?) ON CONFLICT (session_id, step) DO NOTHING RETURNING message"
)
_DECISION = "SELECT message FROM keel_tool_decisions WHERE session_id = ? AND step = ?"


def _returning(assignments: str) -> str:
    """An UPDATE of one entry by key that returns the entry as it is afterwards."""
    return f"{assignments} WHERE key = ? RETURNING {_COLUMNS}"


def _entries(result: Result) -> list[JournalEntry]:
    return [entry_from_row(dict(zip(_NAMES, row, strict=True))) for row in result.rows]


def _select(sql: str, params: Sequence[Any]) -> Plan[list[JournalEntry]]:
    return _entries((yield Statement(sql, params)))


def _decision(session_id: str, step: int) -> Plan[Message | None]:
    rows = (yield Statement(_DECISION, (session_id, step))).rows
    return None if not rows else Message.model_validate_json(rows[0][0])
