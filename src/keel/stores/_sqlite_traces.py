"""Run traces in the embedded SQLite database (component ``traces``); the SQL is
``_sql_traces.py``'s.

The tables share the file with every other embedded store. Times are exact integer Unix
microseconds; JSON fields are TEXT. SQLite has one writer at a time, so a batch adds each
step's difference to its run's totals as it goes.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from typing import TypeVar

from keel.errors import StoreError
from keel.stores._dialect import SQLITE
from keel.stores._sql_traces import SQLTraceStore, TraceStatements, trace_migrations
from keel.stores._sqlite import SQLiteDatabase
from keel.tracing._models import Run, Step
from keel.tracing._store import RunEnding

__all__ = ["TRACE_MIGRATIONS", "SQLiteTraceStore"]

TRACE_MIGRATIONS = trace_migrations(SQLITE)

_STATEMENTS = TraceStatements(SQLITE)
_RUN_EXISTS = "SELECT 1 FROM trace_runs WHERE run_id = ?"
_OLD_STEP = (
    "SELECT kind, error_type, prompt_tokens, completion_tokens FROM trace_steps "
    "WHERE run_id = ? AND step_id = ?"
)
_ADD_TOTALS = (
    "UPDATE trace_runs SET step_count = step_count + ?, "
    "model_calls = model_calls + ?, tool_calls = tool_calls + ?, "
    "tool_errors = tool_errors + ?, prompt_tokens = prompt_tokens + ?, "
    "completion_tokens = completion_tokens + ?, "
    "heartbeat_at = MAX(COALESCE(heartbeat_at, 0), ?) WHERE run_id = ?"
)

_T = TypeVar("_T")


def _contribution(kind: str, failed: bool, prompt: int, completion: int) -> tuple[int, ...]:
    """What one step adds to its run's totals, in the order of ``_ADD_TOTALS``."""
    return (
        1,
        int(kind == "model"),
        int(kind == "tool"),
        int(kind == "tool" and failed),
        prompt,
        completion,
    )


def _write_steps(conn: sqlite3.Connection, steps: Sequence[Step]) -> None:
    """Insert or replace each step; each run's totals move by the difference, once."""
    totals: dict[str, list[int]] = {}
    for step in steps:
        delta = totals.get(step.run_id)
        if delta is None:
            if conn.execute(_RUN_EXISTS, (step.run_id,)).fetchone() is None:
                raise StoreError(f"cannot write step {step.step_id}: no run {step.run_id!r}")
            delta = totals[step.run_id] = [0] * 6
        added = _contribution(step.kind, step.failed, step.prompt_tokens, step.completion_tokens)
        values = _STATEMENTS.step_values(step)
        if conn.execute(_STATEMENTS.insert_new_step, values).rowcount == 0:
            # A step written again: replace it, and count only what changed.
            old_row = conn.execute(_OLD_STEP, (step.run_id, step.step_id)).fetchone()
            old = _contribution(old_row[0], old_row[1] is not None, old_row[2], old_row[3])
            added = tuple(a - b for a, b in zip(added, old, strict=True))
            conn.execute(_STATEMENTS.upsert_step, values)
        for position, value in enumerate(added):
            delta[position] += value
    now = SQLITE.to_time(datetime.now(UTC))
    for run_id, delta in totals.items():
        conn.execute(_ADD_TOTALS, (*delta, now, run_id))


class SQLiteTraceStore(SQLTraceStore):
    """Traces in the embedded SQLite file (``keel.db``), next to state, memory and journal.

    Args:
        database: the shared [`SQLiteDatabase`][] (left open by
            [`close`][]).
    """

    statements = _STATEMENTS

    def __init__(self, database: SQLiteDatabase) -> None:
        super().__init__()
        self.db = database

    async def _run_twin(self, function: Callable[[], _T]) -> _T:
        return await self.db.acall(function)

    def _read(self) -> AbstractContextManager[sqlite3.Connection]:
        return self.db.translated()

    def _write(self) -> AbstractContextManager[sqlite3.Connection]:
        return self.db.transaction()

    def _migrate(self) -> None:
        self.db.setup(TRACE_MIGRATIONS)

    def write_batch(self, *, run: Run | None, steps: Sequence[Step], end: RunEnding | None) -> None:
        """One transaction for the whole batch, one totals update per run."""
        self._ensure()
        with self._write() as conn:
            if run is not None:
                conn.execute(_STATEMENTS.upsert_run, _STATEMENTS.run_values(run))
            if steps:
                _write_steps(conn, steps)
            if end is not None:
                ended = conn.execute(_STATEMENTS.end_run, _STATEMENTS.end_values(end))
                if ended.rowcount == 0:
                    raise StoreError(f"cannot end run {end.run_id!r}: no such run")

    def close(self) -> None:
        """Nothing to release: the database is the caller's to close."""

    def __repr__(self) -> str:
        return f"SQLiteTraceStore({self.db.path!r})"
