"""Run traces in PostgreSQL (on a [`PostgresDatabase`][]), component ``traces``;
the SQL is ``_sql_traces.py``'s.

The same two tables as the SQLite backend, with native types: ``timestamptz`` times and
``jsonb`` JSON. The schema version is kept in ``keel_schema``; ``setup()`` takes a
transaction-level advisory lock so concurrent workers migrate once. A batch goes to the server
in one pipeline: per run, a row lock, the steps, and a recount of the run's totals.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import psycopg

from keel.errors import StoreError
from keel.stores._dialect import POSTGRES
from keel.stores._postgres import PostgresDatabase, apply_migrations
from keel.stores._sql_traces import SQLTraceStore, TraceStatements, trace_migrations
from keel.tracing._models import Run, Step
from keel.tracing._store import RunEnding

__all__ = ["POSTGRES_TRACE_MIGRATIONS", "PostgresTraceStore"]

POSTGRES_TRACE_MIGRATIONS = trace_migrations(POSTGRES)

_STATEMENTS = TraceStatements(POSTGRES)

# A run's totals, counted again from its steps (a run has at most its step limit of them), so
# the whole batch goes to the server in one pipeline with nothing read back in between.
_RECOUNT_TOTALS = (
    "UPDATE trace_runs r SET step_count = s.steps, model_calls = s.models, "
    "tool_calls = s.tools, tool_errors = s.errors, prompt_tokens = s.prompt, "
    "completion_tokens = s.completion, heartbeat_at = GREATEST(r.heartbeat_at, %s) "
    "FROM (SELECT count(*) AS steps, count(*) FILTER (WHERE kind = 'model') AS models, "
    "count(*) FILTER (WHERE kind = 'tool') AS tools, "
    "count(*) FILTER (WHERE kind = 'tool' AND error_type IS NOT NULL) AS errors, "
    "coalesce(sum(prompt_tokens), 0) AS prompt, "
    "coalesce(sum(completion_tokens), 0) AS completion "
    "FROM trace_steps WHERE run_id = %s) s WHERE r.run_id = %s"
)

# Locks the run row first: concurrent writers of one run's steps serialise here, and each
# later statement (READ COMMITTED) sees the steps of the writer before.
_LOCK_RUN = "SELECT 1 FROM trace_runs WHERE run_id = %s FOR UPDATE"


@dataclass(frozen=True)
class _Batch:
    """A batch's statements, in pipeline order, and what to check once it is through."""

    run: Run | None
    by_run: dict[str, list[Step]]
    end: RunEnding | None

    @classmethod
    def of(cls, run: Run | None, steps: Sequence[Step], end: RunEnding | None) -> _Batch:
        by_run: dict[str, list[Step]] = {}
        for step in steps:
            by_run.setdefault(step.run_id, []).append(step)
        return cls(run, by_run, end)

    def statements(self) -> list[tuple[str, Any, bool]]:
        """(statement, parameters, executemany) in order: the header, then per run its lock,
        its steps and its recount, then the end."""
        found: list[tuple[str, Any, bool]] = []
        if self.run is not None:
            found.append((_STATEMENTS.upsert_run, _STATEMENTS.run_values(self.run), False))
        now = datetime.now(UTC)
        for run_id, steps in self.by_run.items():
            found.append((_LOCK_RUN, (run_id,), False))
            values = [_STATEMENTS.step_values(step) for step in steps]
            found.append((_STATEMENTS.upsert_step, values, True))
            found.append((_RECOUNT_TOTALS, (now, run_id, run_id), False))
        if self.end is not None:
            found.append((_STATEMENTS.end_run, _STATEMENTS.end_values(self.end), False))
        return found

    def locks(self, cursors: list[Any]) -> list[Any]:
        """The cursors of the runs' locks, among the cursors of `statements` (one per
        statement that is not an executemany)."""
        first = int(self.run is not None)
        return cursors[first : first + 2 * len(self.by_run) : 2]

    def missing_run(self, exc: psycopg.errors.ForeignKeyViolation) -> StoreError:
        """The run a batch's steps named that does not exist, as the server reported it."""
        missing = next(
            (run_id for run_id in self.by_run if run_id in str(exc.diag.message_detail)),
            next(iter(self.by_run), "?"),
        )
        return StoreError(f"cannot write steps: no run {missing!r}")

    def check(self, locked: list[Any], ended_rowcount: int | None) -> None:
        """Raise for a run that was not there to lock, or an end that matched no run."""
        for run_id, row in zip(self.by_run, locked, strict=True):
            if row is None:
                raise StoreError(
                    f"cannot write step {self.by_run[run_id][0].step_id}: no run {run_id!r}"
                )
        if self.end is not None and ended_rowcount == 0:
            raise StoreError(f"cannot end run {self.end.run_id!r}: no such run")


class PostgresTraceStore(SQLTraceStore):
    """Traces in PostgreSQL, for keel processes that share one database.

    Args:
        database: the [`PostgresDatabase`][] to share (left open by
            [`close`][]); its pool is opened here.

    Raises:
        BackendUnavailableError: the server cannot be reached.
    """

    statements = _STATEMENTS

    def __init__(self, database: PostgresDatabase) -> None:
        super().__init__()
        self.database = database
        self.url = database.url
        database.open()

    def _read(self) -> AbstractContextManager[Any]:
        # One statement, atomic in autocommit: no BEGIN and COMMIT round trips.
        return self.database.connection()

    def _write(self) -> AbstractContextManager[Any]:
        return self.database.transaction()

    def _migrate(self) -> None:
        with self._write() as conn:
            apply_migrations(conn, POSTGRES_TRACE_MIGRATIONS)

    def write_batch(self, *, run: Run | None, steps: Sequence[Step], end: RunEnding | None) -> None:
        """One transaction for the whole batch, in one round trip (a pipeline)."""
        self._ensure()
        batch = _Batch.of(run, steps, end)
        with self._write() as conn:
            try:
                with conn.pipeline(), conn.cursor() as cursor:
                    cursors = []
                    for sql, params, many in batch.statements():
                        if many:
                            cursor.executemany(sql, params)
                        else:
                            cursors.append(conn.execute(sql, params))
            except psycopg.errors.ForeignKeyViolation as exc:
                raise batch.missing_run(exc) from exc
            locked = [lock.fetchone() for lock in batch.locks(cursors)]
            batch.check(locked, cursors[-1].rowcount if end is not None else None)

    # The writes' async twin runs on the event loop's own connections: a worker thread would
    # wait for the GIL while the loop serves other sessions (up to the 5 ms switch interval
    # each way), at every flush of every turn.

    async def awrite_batch(
        self, *, run: Run | None, steps: Sequence[Step], end: RunEnding | None
    ) -> None:
        """Async twin of [`write_batch`][]: the same statements in one pipeline."""
        if not self._ready:
            await asyncio.to_thread(self.setup)
        batch = _Batch.of(run, steps, end)
        async with self.database.atransaction() as conn:
            try:
                async with conn.pipeline(), conn.cursor() as cursor:
                    cursors = []
                    for sql, params, many in batch.statements():
                        if many:
                            await cursor.executemany(sql, params)
                        else:
                            cursors.append(await conn.execute(sql, params))
            except psycopg.errors.ForeignKeyViolation as exc:
                raise batch.missing_run(exc) from exc
            locked = [await lock.fetchone() for lock in batch.locks(cursors)]
            batch.check(locked, cursors[-1].rowcount if end is not None else None)

    def close(self) -> None:
        """Nothing to release: the database is the caller's to close."""

    def __repr__(self) -> str:
        return f"PostgresTraceStore({self.url.split('@')[-1]!r})"
