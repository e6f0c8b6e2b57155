"""Run traces in the embedded SQLite database (component ``traces``).

Two tables share the file with every other embedded store: ``trace_runs`` (one row per run,
with running totals so listing and filtering never scans steps) and ``trace_steps`` (one row per
step, keyed by run and step id, ordered by ``seq``). Timestamps are exact integer Unix
microseconds; JSON fields are TEXT. Indexes serve each ``keel runs list`` filter.

A run's ``heartbeat_at`` is refreshed by every write of the run (start, resume, each step);
reads report a ``running`` run whose heartbeat is older than ``abandon_after_s`` of its time
limit as ``abandoned`` (``keel.tracing.RunStatus``).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

from keel.errors import StoreError
from keel.stores._migrations import Migration, MigrationSet
from keel.stores._sqlite import SQLiteDatabase, translate_sqlite_error
from keel.stores._trace_sql import BatchedTraceStore, step_contribution, upsert_run_sql
from keel.tracing._models import (
    ABANDON_SLACK_CAP_S,
    DEFAULT_RUN_TIME_LIMIT_S,
    Run,
    RunQuery,
    Step,
    StepMetric,
)
from keel.tracing._store import RunEnding

__all__ = ["TRACE_MIGRATIONS", "SQLiteTraceStore"]

TRACE_MIGRATIONS = MigrationSet(
    "traces",
    (
        Migration(
            "runs and steps",
            """
            CREATE TABLE IF NOT EXISTS trace_runs (
                run_id TEXT PRIMARY KEY,
                session_id TEXT NOT NULL,
                user_id TEXT,
                tenant_id TEXT,
                agent TEXT NOT NULL,
                status TEXT NOT NULL,
                started_at INTEGER NOT NULL,
                ended_at INTEGER,
                input TEXT,
                output TEXT,
                error_type TEXT,
                error_message TEXT,
                step_count INTEGER NOT NULL DEFAULT 0,
                model_calls INTEGER NOT NULL DEFAULT 0,
                tool_calls INTEGER NOT NULL DEFAULT 0,
                tool_errors INTEGER NOT NULL DEFAULT 0,
                prompt_tokens INTEGER NOT NULL DEFAULT 0,
                completion_tokens INTEGER NOT NULL DEFAULT 0,
                attributes TEXT NOT NULL DEFAULT '{}'
            );
            CREATE INDEX IF NOT EXISTS trace_runs_started ON trace_runs (started_at);
            CREATE INDEX IF NOT EXISTS trace_runs_session ON trace_runs (session_id, started_at);
            CREATE INDEX IF NOT EXISTS trace_runs_status ON trace_runs (status, started_at);
            CREATE INDEX IF NOT EXISTS trace_runs_steps ON trace_runs (step_count);
            CREATE INDEX IF NOT EXISTS trace_runs_tenant ON trace_runs (tenant_id, started_at);
            CREATE INDEX IF NOT EXISTS trace_runs_tool_errors
                ON trace_runs (started_at) WHERE tool_errors > 0;
            CREATE TABLE IF NOT EXISTS trace_steps (
                run_id TEXT NOT NULL REFERENCES trace_runs (run_id) ON DELETE CASCADE,
                step_id TEXT NOT NULL,
                parent_id TEXT,
                seq INTEGER NOT NULL,
                kind TEXT NOT NULL,
                name TEXT NOT NULL,
                started_at INTEGER NOT NULL,
                ended_at INTEGER,
                latency_ms REAL,
                ttft_ms REAL,
                attempt INTEGER NOT NULL DEFAULT 1,
                prompt_tokens INTEGER NOT NULL DEFAULT 0,
                completion_tokens INTEGER NOT NULL DEFAULT 0,
                model TEXT,
                finish_reason TEXT,
                budget TEXT,
                state_version INTEGER,
                raw_output TEXT,
                parsed_action TEXT,
                tool_name TEXT,
                tool_call_id TEXT,
                tool_arguments TEXT,
                tool_result TEXT,
                error_type TEXT,
                error_message TEXT,
                attributes TEXT NOT NULL DEFAULT '{}',
                PRIMARY KEY (run_id, step_id)
            );
            CREATE INDEX IF NOT EXISTS trace_steps_order ON trace_steps (run_id, seq);
            """,
        ),
        Migration(
            "run heartbeats and time limits (abandoned runs); model-call filter",
            """
            ALTER TABLE trace_runs ADD COLUMN heartbeat_at INTEGER;
            ALTER TABLE trace_runs ADD COLUMN time_limit_s REAL;
            UPDATE trace_runs SET heartbeat_at = COALESCE(ended_at, started_at);
            CREATE INDEX IF NOT EXISTS trace_runs_model_calls ON trace_runs (model_calls);
            """,
        ),
    ),
)

# The status as read: a run still 'running' with no sign of life for longer than
# abandon_after_s(time_limit_s) is 'abandoned' (its worker died). One parameter: now, in us.
_STATUS = (
    "CASE WHEN status = 'running' AND COALESCE(heartbeat_at, started_at) + CAST(1000000 * ("
    f"COALESCE(time_limit_s, {DEFAULT_RUN_TIME_LIMIT_S!r}) + MIN(COALESCE(time_limit_s, "
    f"{DEFAULT_RUN_TIME_LIMIT_S!r}), {ABANDON_SLACK_CAP_S!r})) AS INTEGER) < ? "
    "THEN 'abandoned' ELSE status END"
)
_RUN_COLUMNS = (
    f"run_id, session_id, user_id, tenant_id, agent, {_STATUS}, started_at, ended_at, input, "
    "output, error_type, error_message, step_count, model_calls, tool_calls, tool_errors, "
    "prompt_tokens, completion_tokens, attributes, time_limit_s"
)
_STEP_FIELDS = (
    "run_id",
    "step_id",
    "parent_id",
    "seq",
    "kind",
    "name",
    "started_at",
    "ended_at",
    "latency_ms",
    "ttft_ms",
    "attempt",
    "prompt_tokens",
    "completion_tokens",
    "model",
    "finish_reason",
    "budget",
    "state_version",
    "raw_output",
    "parsed_action",
    "tool_name",
    "tool_call_id",
    "tool_arguments",
    "tool_result",
    "error_type",
    "error_message",
    "attributes",
)
_STEP_JSON = frozenset({"budget", "parsed_action", "attributes"})
_STEP_TIMES = frozenset({"started_at", "ended_at"})


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)


def _ts(value: datetime | None) -> int | None:
    # Integer microseconds round-trip exactly, unlike float seconds.
    return None if value is None else (value - _EPOCH) // _MICROSECOND


def _dt(value: int | None) -> datetime | None:
    return None if value is None else _EPOCH + value * _MICROSECOND


def _run_from_row(row: sqlite3.Row | tuple[Any, ...]) -> Run:
    (
        run_id,
        session_id,
        user_id,
        tenant_id,
        agent,
        status,
        started_at,
        ended_at,
        input_,
        output,
        error_type,
        error_message,
        step_count,
        model_calls,
        tool_calls,
        tool_errors,
        prompt_tokens,
        completion_tokens,
        attributes,
        time_limit_s,
    ) = row
    return Run(
        run_id=run_id,
        session_id=session_id,
        user_id=user_id,
        tenant_id=tenant_id,
        agent=agent,
        status=status,
        started_at=_dt(started_at),
        ended_at=_dt(ended_at),
        input=input_,
        output=output,
        error_type=error_type,
        error_message=error_message,
        step_count=step_count,
        model_calls=model_calls,
        tool_calls=tool_calls,
        tool_errors=tool_errors,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        attributes=json.loads(attributes),
        time_limit_s=time_limit_s,
    )


def _now_us() -> int:
    return (datetime.now(UTC) - _EPOCH) // _MICROSECOND


def _step_from_row(row: tuple[Any, ...]) -> Step:
    data: dict[str, Any] = {}
    for name, value in zip(_STEP_FIELDS, row, strict=True):
        if name in _STEP_JSON:
            data[name] = None if value is None else json.loads(value)
        elif name in _STEP_TIMES:
            data[name] = _dt(value)
        else:
            data[name] = value
    if data["attributes"] is None:
        data["attributes"] = {}
    return Step.model_validate(data)


def _step_values(step: Step) -> tuple[Any, ...]:
    values: list[Any] = []
    for name in _STEP_FIELDS:
        value = getattr(step, name)
        if name in _STEP_JSON:
            values.append(None if value is None else json.dumps(value, ensure_ascii=False))
        elif name in _STEP_TIMES:
            values.append(_ts(value))
        else:
            values.append(value)
    return tuple(values)


_UPSERT_RUN = upsert_run_sql("?")

_INSERT_STEP = (
    f"INSERT INTO trace_steps ({', '.join(_STEP_FIELDS)}) "
    f"VALUES ({', '.join('?' for _ in _STEP_FIELDS)}) "
    "ON CONFLICT (run_id, step_id) DO UPDATE SET "
    + ", ".join(f"{name} = excluded.{name}" for name in _STEP_FIELDS[2:])
)


_INSERT_NEW_STEP = (
    f"INSERT INTO trace_steps ({', '.join(_STEP_FIELDS)}) "
    f"VALUES ({', '.join('?' for _ in _STEP_FIELDS)}) "
    "ON CONFLICT (run_id, step_id) DO NOTHING"
)


def _insert_run(conn: sqlite3.Connection, run: Run) -> None:
    conn.execute(
        _UPSERT_RUN,
        (
            run.run_id,
            run.session_id,
            run.user_id,
            run.tenant_id,
            run.agent,
            run.status,
            _ts(run.started_at),
            _ts(run.ended_at),
            run.input,
            run.output,
            run.error_type,
            run.error_message,
            json.dumps(run.attributes, ensure_ascii=False),
            run.time_limit_s,
            _now_us(),
        ),
    )


def _write_steps(conn: sqlite3.Connection, steps: Sequence[Step]) -> None:
    """Insert or replace each step; each run's totals move by the difference, once."""
    totals: dict[str, list[int]] = {}
    for step in steps:
        delta = totals.get(step.run_id)
        if delta is None:
            exists = conn.execute(
                "SELECT 1 FROM trace_runs WHERE run_id = ?", (step.run_id,)
            ).fetchone()
            if exists is None:
                raise StoreError(f"cannot write step {step.step_id}: no run {step.run_id!r}")
            delta = totals[step.run_id] = [0] * 6
        added = step_contribution(
            step.kind, step.failed, step.prompt_tokens, step.completion_tokens
        )
        values = _step_values(step)
        if conn.execute(_INSERT_NEW_STEP, values).rowcount == 0:
            # A step written again: replace it, and count only what changed.
            old_row = conn.execute(
                "SELECT kind, error_type, prompt_tokens, completion_tokens FROM trace_steps "
                "WHERE run_id = ? AND step_id = ?",
                (step.run_id, step.step_id),
            ).fetchone()
            old = step_contribution(old_row[0], old_row[1] is not None, old_row[2], old_row[3])
            added = tuple(a - b for a, b in zip(added, old, strict=True))
            conn.execute(_INSERT_STEP, values)
        for position, value in enumerate(added):
            delta[position] += value
    now = _now_us()
    for run_id, delta in totals.items():
        conn.execute(
            "UPDATE trace_runs SET step_count = step_count + ?, "
            "model_calls = model_calls + ?, tool_calls = tool_calls + ?, "
            "tool_errors = tool_errors + ?, prompt_tokens = prompt_tokens + ?, "
            "completion_tokens = completion_tokens + ?, "
            "heartbeat_at = MAX(COALESCE(heartbeat_at, 0), ?) WHERE run_id = ?",
            (*delta, now, run_id),
        )


def _end_run(conn: sqlite3.Connection, end: RunEnding) -> None:
    updated = conn.execute(
        "UPDATE trace_runs SET status = ?, ended_at = ?, output = ?, "
        "error_type = ?, error_message = ? WHERE run_id = ?",
        (end.status, _ts(end.ended_at), end.output, end.error_type, end.error_message, end.run_id),
    ).rowcount
    if updated == 0:
        raise StoreError(f"cannot end run {end.run_id!r}: no such run")


_T = TypeVar("_T")


class SQLiteTraceStore(BatchedTraceStore):
    """Traces in the embedded SQLite file (``keel.db``), next to state, memory and journal.

    Args:
        database: the shared :class:`~keel.stores.SQLiteDatabase`, or a path to open one.
        close_database: whether :meth:`close` closes the database; by default only one this
            store opened from a path.
    """

    def __init__(
        self, database: SQLiteDatabase | Path | str, *, close_database: bool | None = None
    ) -> None:
        opened = not isinstance(database, SQLiteDatabase)
        self.db = SQLiteDatabase(database) if not isinstance(database, SQLiteDatabase) else database
        self._owns_db = opened if close_database is None else close_database
        self._ready = False

    async def _run_twin(self, function: Callable[[], _T]) -> _T:
        return await self.db.arun(function)

    def setup(self) -> None:
        """Create or migrate the ``traces`` tables; idempotent."""
        self.db.setup(TRACE_MIGRATIONS)
        self._ready = True

    def _ensure(self) -> None:
        if not self._ready:
            self.setup()

    def write_batch(self, *, run: Run | None, steps: Sequence[Step], end: RunEnding | None) -> None:
        """One transaction for the whole batch, one totals update per run."""
        self._ensure()
        with self.db.transaction() as conn:
            try:
                if run is not None:
                    _insert_run(conn, run)
                if steps:
                    _write_steps(conn, steps)
                if end is not None:
                    _end_run(conn, end)
            except sqlite3.Error as exc:
                raise translate_sqlite_error(exc, self.db.path) from exc

    def get_run(self, run_id: str) -> Run | None:
        """The run with this id, or None."""
        self._ensure()
        with self.db.translated() as conn:
            row = conn.execute(
                f"SELECT {_RUN_COLUMNS} FROM trace_runs WHERE run_id = ?", (_now_us(), run_id)
            ).fetchone()
        return None if row is None else _run_from_row(row)

    def get_steps(self, run_id: str) -> list[Step]:
        """The run's steps in start order."""
        self._ensure()
        with self.db.translated() as conn:
            rows = conn.execute(
                f"SELECT {', '.join(_STEP_FIELDS)} FROM trace_steps WHERE run_id = ? "
                "ORDER BY seq, started_at",
                (run_id,),
            ).fetchall()
        return [_step_from_row(row) for row in rows]

    def list_runs(self, query: RunQuery | None = None) -> list[Run]:
        """Runs matching ``query``, newest first."""
        self._ensure()
        query = query or RunQuery()
        now = _now_us()
        where: list[str] = []
        params: list[Any] = [now]
        for column in ("session_id", "user_id", "tenant_id", "agent"):
            value = getattr(query, column)
            if value is not None:
                where.append(f"{column} = ?")
                params.append(value)
        if query.status is not None:
            where.append(f"({_STATUS}) = ?")
            params.extend((now, query.status))
        if query.min_steps is not None:
            where.append("step_count >= ?")
            params.append(query.min_steps)
        if query.min_model_calls is not None:
            where.append("model_calls >= ?")
            params.append(query.min_model_calls)
        if query.tool_error is True:
            where.append("tool_errors > 0")
        elif query.tool_error is False:
            where.append("tool_errors = 0")
        if query.since is not None:
            where.append("started_at >= ?")
            params.append(_ts(query.since))
        if query.until is not None:
            where.append("started_at < ?")
            params.append(_ts(query.until))
        sql = f"SELECT {_RUN_COLUMNS} FROM trace_runs"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY started_at DESC, run_id DESC LIMIT ?"
        params.append(query.limit)
        with self.db.translated() as conn:
            rows = conn.execute(sql, params).fetchall()
        return [_run_from_row(row) for row in rows]

    def step_metrics(
        self,
        *,
        session_id: str | None = None,
        since: datetime | None = None,
        tenant_id: str | None = None,
    ) -> list[StepMetric]:
        """Indicator columns of matching steps, oldest first."""
        self._ensure()
        where: list[str] = []
        params: list[Any] = []
        if session_id is not None:
            where.append("r.session_id = ?")
            params.append(session_id)
        if tenant_id is not None:
            where.append("r.tenant_id = ?")
            params.append(tenant_id)
        if since is not None:
            where.append("r.started_at >= ?")
            params.append(_ts(since))
        sql = (
            "SELECT r.session_id, s.run_id, s.kind, s.name, s.started_at, s.attempt, "
            "s.prompt_tokens, s.ttft_ms, s.error_type IS NOT NULL "
            "FROM trace_runs r JOIN trace_steps s ON s.run_id = r.run_id"
        )
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY s.started_at, s.run_id, s.seq"
        with self.db.translated() as conn:
            rows = conn.execute(sql, params).fetchall()
        return [
            StepMetric(
                session_id=row[0],
                run_id=row[1],
                kind=row[2],
                name=row[3],
                started_at=_EPOCH + row[4] * _MICROSECOND,
                attempt=row[5],
                prompt_tokens=row[6],
                ttft_ms=row[7],
                failed=bool(row[8]),
            )
            for row in rows
        ]

    def run_ids_starting_with(self, prefix: str, *, limit: int = 2) -> list[str]:
        """Up to ``limit`` run ids that start with ``prefix``."""
        self._ensure()
        pattern = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        with self.db.translated() as conn:
            rows = conn.execute(
                "SELECT run_id FROM trace_runs WHERE run_id LIKE ? ESCAPE '\\' "
                "ORDER BY run_id LIMIT ?",
                (pattern, limit),
            ).fetchall()
        return [str(row[0]) for row in rows]

    def delete_runs(self, *, before: datetime) -> int:
        """Delete runs started before ``before`` with their steps; returns how many runs."""
        self._ensure()
        cutoff = _ts(before)
        with self.db.transaction() as conn:
            try:
                conn.execute(
                    "DELETE FROM trace_steps WHERE run_id IN "
                    "(SELECT run_id FROM trace_runs WHERE started_at < ?)",
                    (cutoff,),
                )
                deleted = conn.execute(
                    "DELETE FROM trace_runs WHERE started_at < ?", (cutoff,)
                ).rowcount
            except sqlite3.Error as exc:
                raise translate_sqlite_error(exc, self.db.path) from exc
        return int(deleted)

    def close(self) -> None:
        """Close the database if this store opened it."""
        if self._owns_db:
            self.db.close()

    def __repr__(self) -> str:
        return f"SQLiteTraceStore({self.db.path!r})"
