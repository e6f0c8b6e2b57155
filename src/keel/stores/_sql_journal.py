"""The tool journal's one implementation over SQL, for SQLite and PostgreSQL alike.

Both engines take the same statements (``INSERT ... ON CONFLICT DO NOTHING`` claims, epoch
seconds as floats); the :class:`~keel.stores._dialect.SqlDialect` carries what differs in the
SQL, and each engine's subclass says how it opens a write transaction and a read.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any

from keel.errors import StoreError
from keel.messages import Message
from keel.stores._dialect import SqlDialect
from keel.stores._migrations import Migration, MigrationSet
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


class SQLToolJournal(ToolJournal):
    """The journal's statements, run on the connections a subclass opens."""

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
        with self._write() as conn:
            # The new entry comes back with the insert; an existing one takes a read.
            entry = next(
                _entries(
                    conn.execute(
                        self.dialect.sql(_CLAIM),
                        (key, session_id, step, call_index, tool, arguments, time.time()),
                    )
                ),
                None,
            )
            created = entry is not None
            if entry is None:
                entry = self._select(conn, key)
        if entry is None:  # pragma: no cover - inserted or present in the same transaction
            raise StoreError(f"journal entry {key!r} vanished")
        return JournalClaim(created=created, entry=entry)

    def restart(self, key: str) -> JournalEntry:
        return self._update(key, _RESTART, ())

    def finish(self, key: str, *, ok: bool, content: str, output: str) -> JournalEntry:
        return self._update(key, _FINISH, self._finish_params(ok, content, output))

    def _finish_params(self, ok: bool, content: str, output: str) -> tuple[Any, ...]:
        return (
            "succeeded" if ok else "failed",
            self.dialect.flag(ok),
            content,
            output,
            time.time(),
        )

    def get(self, key: str) -> JournalEntry | None:
        with self._read() as conn:
            return self._select(conn, key)

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
        return self._entries(
            f"SELECT {_COLUMNS} FROM keel_tool_journal{where} "
            "ORDER BY started_at, step, call_index",
            params,
        )

    def same_calls(self, session_id: str, tool: str, arguments: str) -> list[JournalEntry]:
        # keel_tool_journal_session narrows to the session; a session has few entries.
        return self._entries(_SAME_CALLS, (session_id, tool, arguments))

    def record_decision(self, session_id: str, step: int, message: Message) -> Message:
        with self._write() as conn:
            row = conn.execute(
                self.dialect.sql(_RECORD_DECISION),
                (session_id, step, message.model_dump_json(), time.time()),
            ).fetchone()
            if row is None:  # decided before (a replay): that decision stands
                row = conn.execute(self.dialect.sql(_DECISION), (session_id, step)).fetchone()
        return Message.model_validate_json(row[0])

    def decision(self, session_id: str, step: int) -> Message | None:
        with self._read() as conn:
            row = conn.execute(self.dialect.sql(_DECISION), (session_id, step)).fetchone()
        return None if row is None else Message.model_validate_json(row[0])

    def _update(self, key: str, assignments: str, params: tuple[Any, ...]) -> JournalEntry:
        with self._write() as conn:
            cursor = conn.execute(self.dialect.sql(_returning(assignments)), (*params, key))
            entry = next(_entries(cursor), None)
        if entry is None:
            raise StoreError(f"no journal entry {key!r}{self._where()}")
        return entry

    def _entries(self, sql: str, params: Sequence[Any]) -> list[JournalEntry]:
        with self._read() as conn:
            return list(_entries(conn.execute(self.dialect.sql(sql), params)))

    def _select(self, conn: Any, key: str) -> JournalEntry | None:
        cursor = conn.execute(self.dialect.sql(_SELECT), (key,))
        return next(_entries(cursor), None)


class AsyncSQLToolJournal(SQLToolJournal):
    """The journal over an engine whose driver is async too (psycopg): the async twins run
    the same statements on the event loop's own connections, with no worker thread between.

    Under load a worker thread is not free: it waits for the GIL while the loop runs other
    sessions' turns (up to the 5 ms switch interval each way), once per journal write.
    """

    @abstractmethod
    def _awrite(self) -> AbstractAsyncContextManager[Any]:
        """Async twin of :meth:`_write`."""

    @abstractmethod
    def _aread(self) -> AbstractAsyncContextManager[Any]:
        """Async twin of :meth:`_read`."""

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
        async with self._awrite() as conn:
            cursor = await conn.execute(
                self.dialect.sql(_CLAIM),
                (key, session_id, step, call_index, tool, arguments, time.time()),
            )
            found = await _aentries(cursor)
            created = bool(found)
            if not found:
                found = await _aentries(await conn.execute(self.dialect.sql(_SELECT), (key,)))
        if not found:  # pragma: no cover - inserted or present in the same transaction
            raise StoreError(f"journal entry {key!r} vanished")
        return JournalClaim(created=created, entry=found[0])

    async def arestart(self, key: str) -> JournalEntry:
        return await self._aupdate(key, _RESTART, ())

    async def afinish(self, key: str, *, ok: bool, content: str, output: str) -> JournalEntry:
        return await self._aupdate(key, _FINISH, self._finish_params(ok, content, output))

    async def aget(self, key: str) -> JournalEntry | None:
        async with self._aread() as conn:
            found = await _aentries(await conn.execute(self.dialect.sql(_SELECT), (key,)))
        return found[0] if found else None

    async def asame_calls(self, session_id: str, tool: str, arguments: str) -> list[JournalEntry]:
        async with self._aread() as conn:
            return await _aentries(
                await conn.execute(self.dialect.sql(_SAME_CALLS), (session_id, tool, arguments))
            )

    async def arecord_decision(self, session_id: str, step: int, message: Message) -> Message:
        async with self._awrite() as conn:
            cursor = await conn.execute(
                self.dialect.sql(_RECORD_DECISION),
                (session_id, step, message.model_dump_json(), time.time()),
            )
            row = await cursor.fetchone()
            if row is None:  # decided before (a replay): that decision stands
                cursor = await conn.execute(self.dialect.sql(_DECISION), (session_id, step))
                row = await cursor.fetchone()
        return Message.model_validate_json(row[0])

    async def adecision(self, session_id: str, step: int) -> Message | None:
        async with self._aread() as conn:
            cursor = await conn.execute(self.dialect.sql(_DECISION), (session_id, step))
            row = await cursor.fetchone()
        return None if row is None else Message.model_validate_json(row[0])

    async def _aupdate(self, key: str, assignments: str, params: tuple[Any, ...]) -> JournalEntry:
        async with self._awrite() as conn:
            cursor = await conn.execute(self.dialect.sql(_returning(assignments)), (*params, key))
            found = await _aentries(cursor)
        if not found:
            raise StoreError(f"no journal entry {key!r}{self._where()}")
        return found[0]


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


async def _aentries(cursor: Any) -> list[JournalEntry]:
    names = [column[0] for column in cursor.description]
    return [entry_from_row(dict(zip(names, row, strict=True))) for row in await cursor.fetchall()]


def _entries(cursor: Any) -> Iterator[JournalEntry]:
    names = [column[0] for column in cursor.description]
    for row in cursor.fetchall():
        yield entry_from_row(dict(zip(names, row, strict=True)))
