"""What run traces do on PostgreSQL beyond the shared SQL: a batch in one round trip.

[`SQLTraceStore`][keel.stores.SQLTraceStore]'s batch reads between its statements (does the
run exist, was the step written before), a round trip each. Here the batch goes to the server
in one pipeline, with nothing read back in between: per run, a row lock, the steps, and a
recount of the run's totals from its steps (a run has at most its step limit of them). The
statements are ``_sql_traces.py``'s, spelled for psycopg; psycopg is imported at module level
(the ``postgres`` extra), so ``keel.stores`` loads this module only when asked for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import psycopg

from keel.errors import StoreError
from keel.stores._postgres import PostgresDatabase
from keel.stores._sql_plan import Statement
from keel.stores._sql_traces import SQLTraceStore, TraceSQL
from keel.tracing._models import Run, Step
from keel.tracing._store import RunEnding

__all__ = ["PostgresTraceStore"]

_RECOUNT_TOTALS = (
    "UPDATE trace_runs r SET step_count = s.steps, model_calls = s.models, "
    "tool_calls = s.tools, tool_errors = s.errors, prompt_tokens = s.prompt, "
    "completion_tokens = s.completion, heartbeat_at = GREATEST(r.heartbeat_at, ?) "
    "FROM (SELECT count(*) AS steps, count(*) FILTER (WHERE kind = 'model') AS models, "
    "count(*) FILTER (WHERE kind = 'tool') AS tools, "
    "count(*) FILTER (WHERE kind = 'tool' AND error_type IS NOT NULL) AS errors, "
    "coalesce(sum(prompt_tokens), 0) AS prompt, "
    "coalesce(sum(completion_tokens), 0) AS completion "
    "FROM trace_steps WHERE run_id = ?) s WHERE r.run_id = ?"
)


@dataclass(frozen=True)
class _Batch:
    """A batch's statements, in pipeline order, and what to check once it is through."""

    sql: TraceSQL
    run: Run | None
    by_run: dict[str, list[Step]]
    end: RunEnding | None

    @classmethod
    def of(
        cls, sql: TraceSQL, run: Run | None, steps: Sequence[Step], end: RunEnding | None
    ) -> _Batch:
        by_run: dict[str, list[Step]] = {}
        for step in steps:
            by_run.setdefault(step.run_id, []).append(step)
        return cls(sql, run, by_run, end)

    def statements(self) -> list[Statement]:
        """In order: the header, then per run its lock, its steps and its recount, then the
        end; each spelled for psycopg."""
        sql = self.sql
        found: list[Statement] = []
        if self.run is not None:
            found.append(Statement(sql.upsert_run, sql.run_values(self.run)))
        now = datetime.now(UTC)
        for run_id, steps in self.by_run.items():
            found.append(Statement(sql.lock_run, (run_id,)))
            values = [sql.step_values(step) for step in steps]
            found.append(Statement(sql.upsert_step, values, many=True))
            found.append(Statement(_RECOUNT_TOTALS, (now, run_id, run_id)))
        if self.end is not None:
            found.append(Statement(sql.end_run, sql.end_values(self.end)))
        return [Statement(sql.dialect.sql(s.sql), s.params, s.many) for s in found]

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
    """Traces in PostgreSQL: a [`SQLTraceStore`][keel.stores.SQLTraceStore] whose batches
    go to the server in one pipeline (one round trip per flush of a turn's trace).

    Args:
        db: the [`PostgresDatabase`][keel.stores.PostgresDatabase] to share (left open by
            [`close`][keel.stores.SQLTraceStore.close]).

    Raises:
        BackendUnavailableError: the server cannot be reached.
    """

    db: PostgresDatabase

    def __init__(self, db: PostgresDatabase) -> None:
        super().__init__(db)

    def write_batch(self, *, run: Run | None, steps: Sequence[Step], end: RunEnding | None) -> None:
        """One transaction for the whole batch, in one round trip (a pipeline)."""
        batch = _Batch.of(self.statements, run, steps, end)
        with self.db.transaction() as conn:
            try:
                with conn.pipeline(), conn.cursor() as cursor:
                    cursors = []
                    for statement in batch.statements():
                        if statement.many:
                            cursor.executemany(statement.sql, statement.params)
                        else:
                            cursors.append(conn.execute(statement.sql, statement.params))
            except psycopg.errors.ForeignKeyViolation as exc:
                raise batch.missing_run(exc) from exc
            locked = [lock.fetchone() for lock in batch.locks(cursors)]
            batch.check(locked, cursors[-1].rowcount if end is not None else None)

    async def awrite_batch(
        self, *, run: Run | None, steps: Sequence[Step], end: RunEnding | None
    ) -> None:
        """Async twin of [`write_batch`][]: the same statements in one pipeline, on the
        event loop's own connections."""
        batch = _Batch.of(self.statements, run, steps, end)
        async with self.db.atransaction() as conn:
            try:
                async with conn.pipeline(), conn.cursor() as cursor:
                    cursors = []
                    for statement in batch.statements():
                        if statement.many:
                            await cursor.executemany(statement.sql, statement.params)
                        else:
                            cursors.append(await conn.execute(statement.sql, statement.params))
            except psycopg.errors.ForeignKeyViolation as exc:
                raise batch.missing_run(exc) from exc
            locked = [await lock.fetchone() for lock in batch.locks(cursors)]
            batch.check(locked, cursors[-1].rowcount if end is not None else None)
