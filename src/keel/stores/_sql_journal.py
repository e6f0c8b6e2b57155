"""The tool journal's one implementation over SQL, for SQLite and PostgreSQL alike.

Both engines take the same statements (``INSERT ... ON CONFLICT DO NOTHING`` claims, epoch
seconds as floats); a :class:`JournalDialect` carries what differs in the SQL, and each
engine's subclass says how it opens a write transaction and a read.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from keel.errors import StoreError
from keel.messages import Message
from keel.tools._journal import JournalClaim, JournalEntry, ToolJournal, entry_from_row

__all__ = ["JournalDialect", "SQLToolJournal"]

_COLUMNS = (
    "key, session_id, step, call_index, tool, arguments, status, ok, content, output, "
    "attempts, started_at, finished_at"
)


@dataclass(frozen=True)
class JournalDialect:
    """How one engine's SQL differs from the journal's statements.

    Args:
        placeholder: the parameter marker (``?`` for sqlite3, ``%s`` for psycopg).
        flag: a boolean as its ``ok`` column stores it (SQLite has no boolean type).
    """

    placeholder: str
    flag: Callable[[bool], object]

    def sql(self, statement: str) -> str:
        """``statement``, written with ``?`` markers, in this dialect."""
        return statement.replace("?", self.placeholder)


class SQLToolJournal(ToolJournal):
    """The journal's statements, run on the connections a subclass opens."""

    dialect: JournalDialect

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
                        self.dialect.sql(
                            "INSERT INTO keel_tool_journal (key, session_id, step, call_index, "
                            "tool, arguments, status, attempts, started_at) "
                            "VALUES (?, ?, ?, ?, ?, ?, 'started', 1, ?) "
                            f"ON CONFLICT (key) DO NOTHING RETURNING {_COLUMNS}"
                        ),
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
        return self._update(key, "UPDATE keel_tool_journal SET attempts = attempts + 1", ())

    def finish(self, key: str, *, ok: bool, content: str, output: str) -> JournalEntry:
        return self._update(
            key,
            "UPDATE keel_tool_journal SET status = ?, ok = ?, content = ?, output = ?, "
            "finished_at = ?",
            ("succeeded" if ok else "failed", self.dialect.flag(ok), content, output, time.time()),
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
        return self._entries(
            f"SELECT {_COLUMNS} FROM keel_tool_journal "
            "WHERE session_id = ? AND tool = ? AND arguments = ? "
            "ORDER BY started_at, step, call_index",
            (session_id, tool, arguments),
        )

    def record_decision(self, session_id: str, step: int, message: Message) -> Message:
        with self._write() as conn:
            row = conn.execute(
                self.dialect.sql(
                    "INSERT INTO keel_tool_decisions (session_id, step, message, created_at) "
                    "VALUES (?, ?, ?, ?) ON CONFLICT (session_id, step) DO NOTHING "
                    "RETURNING message"
                ),
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
            cursor = conn.execute(
                self.dialect.sql(f"{assignments} WHERE key = ? RETURNING {_COLUMNS}"),
                (*params, key),
            )
            entry = next(_entries(cursor), None)
        if entry is None:
            raise StoreError(f"no journal entry {key!r}{self._where()}")
        return entry

    def _entries(self, sql: str, params: Sequence[Any]) -> list[JournalEntry]:
        with self._read() as conn:
            return list(_entries(conn.execute(self.dialect.sql(sql), params)))

    def _select(self, conn: Any, key: str) -> JournalEntry | None:
        cursor = conn.execute(
            self.dialect.sql(f"SELECT {_COLUMNS} FROM keel_tool_journal WHERE key = ?"), (key,)
        )
        return next(_entries(cursor), None)


_DECISION = "SELECT message FROM keel_tool_decisions WHERE session_id = ? AND step = ?"


def _entries(cursor: Any) -> Iterator[JournalEntry]:
    names = [column[0] for column in cursor.description]
    for row in cursor.fetchall():
        yield entry_from_row(dict(zip(names, row, strict=True)))
