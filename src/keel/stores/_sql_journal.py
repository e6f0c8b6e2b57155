"""The tool journal: one class over a SQL database, SQLite or PostgreSQL alike.

Both engines take the same statements (``INSERT ... ON CONFLICT DO NOTHING`` claims, epoch
seconds as floats); the database's `SqlDialect` carries what differs in the SQL. Each
operation is a plan (``_sql_plan.py``), written once: the database runs it, in a write
transaction or as one read, for a sync method and its async twin alike.

The claim is committed in its own transaction before the tool runs, so of two writers racing
on one call (two threads, two processes on one SQLite file, two servers on one PostgreSQL)
exactly one claims it. On SQLite the journal lives in the same file as the checkpoints, so a
crash loses neither or both.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from keel.errors import StoreError
from keel.messages import Message
from keel.stores._dialect import SqlDialect
from keel.stores._erase_sql import count_deleted, starts_with
from keel.stores._migrations import Migration, MigrationSet
from keel.stores._sql_plan import Plan, Result, SQLDatabase, Statement
from keel.tools._journal import JournalClaim, JournalEntry, ToolJournal, entry_from_row

__all__ = ["SQLToolJournal", "journal_migrations"]


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


class SQLToolJournal(ToolJournal):
    """The tool journal in a SQL database ([`SQLiteDatabase`][keel.stores.SQLiteDatabase]
    or [`PostgresDatabase`][keel.stores.PostgresDatabase]); applies its migrations on
    construction. The async twins run the same plans through the database's
    ``arun``: inline on SQLite unless a write would wait, on the event loop's own
    connections on PostgreSQL (no worker thread between).

    Args:
        db: the database to share (the caller closes it).
    """

    def __init__(self, db: SQLDatabase) -> None:
        self.db = db
        db.migrate(journal_migrations(db.dialect))

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
            raise StoreError(f"no journal entry {key!r} in {self.db!r}")
        return found[0]

    def _finish(self, key: str, ok: bool, content: str, output: str) -> Plan[JournalEntry]:
        status = "succeeded" if ok else "failed"
        params = (status, self.db.dialect.flag(ok), content, output, time.time())
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
        return self.db.run(lambda: self._claim(params))

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
        return await self.db.arun(lambda: self._claim(params))

    def restart(self, key: str) -> JournalEntry:
        return self.db.run(lambda: self._update(key, _RESTART, ()))

    async def arestart(self, key: str) -> JournalEntry:
        return await self.db.arun(lambda: self._update(key, _RESTART, ()))

    def finish(self, key: str, *, ok: bool, content: str, output: str) -> JournalEntry:
        return self.db.run(lambda: self._finish(key, ok, content, output))

    async def afinish(self, key: str, *, ok: bool, content: str, output: str) -> JournalEntry:
        return await self.db.arun(lambda: self._finish(key, ok, content, output))

    def get(self, key: str) -> JournalEntry | None:
        found = self.db.run(lambda: _select(_SELECT, (key,)), write=False)
        return found[0] if found else None

    async def aget(self, key: str) -> JournalEntry | None:
        found = await self.db.arun(lambda: _select(_SELECT, (key,)), write=False)
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
        return self.db.run(lambda: _select(sql, params), write=False)

    def same_calls(self, session_id: str, tool: str, arguments: str) -> list[JournalEntry]:
        # keel_tool_journal_session narrows to the session; a session has few entries.
        params = (session_id, tool, arguments)
        return self.db.run(lambda: _select(_SAME_CALLS, params), write=False)

    async def asame_calls(self, session_id: str, tool: str, arguments: str) -> list[JournalEntry]:
        params = (session_id, tool, arguments)
        return await self.db.arun(lambda: _select(_SAME_CALLS, params), write=False)

    def record_decision(self, session_id: str, step: int, message: Message) -> Message:
        return self.db.run(lambda: self._record_decision(session_id, step, message))

    async def arecord_decision(self, session_id: str, step: int, message: Message) -> Message:
        return await self.db.arun(lambda: self._record_decision(session_id, step, message))

    def decision(self, session_id: str, step: int) -> Message | None:
        return self.db.run(lambda: _decision(session_id, step), write=False)

    async def adecision(self, session_id: str, step: int) -> Message | None:
        return await self.db.arun(lambda: _decision(session_id, step), write=False)

    def erase_sessions(self, session_ids: Sequence[str]) -> dict[str, int]:
        ids = list(dict.fromkeys(session_ids))
        return self.db.run(lambda: _erase_sessions(ids))


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


def _erase_sessions(session_ids: list[str]) -> Plan[dict[str, int]]:
    """The sessions' entries and decisions (a turn's are keyed ``<session>#<turn>``), in one
    transaction."""
    counts = {"tool_journal": 0, "tool_decisions": 0}
    for session_id in session_ids:
        turns, params = starts_with("session_id", session_id + "#")
        for table in ("journal", "decisions"):
            sql = f"DELETE FROM keel_tool_{table} WHERE session_id = ? OR {turns}"
            yield from count_deleted(counts, f"tool_{table}", sql, (session_id, *params))
    return counts
