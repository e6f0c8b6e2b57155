"""Run traces in PostgreSQL (on a :class:`~keel.stores.PostgresDatabase`), component ``traces``.

The same two tables as the SQLite backend, with native types: ``timestamptz`` times and
``jsonb`` JSON. The schema version is kept in ``keel_schema`` (component, version, applied_at),
the same bookkeeping the embedded database uses; ``setup()`` takes a transaction-level advisory
lock so concurrent workers migrate once. Abandoned runs are derived on read exactly as in the
SQLite backend (a ``running`` run whose heartbeat is older than ``abandon_after_s`` of its time
limit).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from keel.errors import StoreError
from keel.stores._migrations import Migration, MigrationSet
from keel.stores._postgres import PostgresDatabase, apply_migrations
from keel.stores._trace_sql import BatchedTraceStore, upsert_run_sql
from keel.tracing._models import (
    ABANDON_SLACK_CAP_S,
    DEFAULT_RUN_TIME_LIMIT_S,
    Run,
    RunQuery,
    Step,
    StepMetric,
)
from keel.tracing._store import RunEnding

__all__ = ["POSTGRES_TRACE_MIGRATIONS", "PostgresTraceStore"]

POSTGRES_TRACE_MIGRATIONS = MigrationSet(
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
                started_at TIMESTAMPTZ NOT NULL,
                ended_at TIMESTAMPTZ,
                input TEXT,
                output TEXT,
                error_type TEXT,
                error_message TEXT,
                step_count INTEGER NOT NULL DEFAULT 0,
                model_calls INTEGER NOT NULL DEFAULT 0,
                tool_calls INTEGER NOT NULL DEFAULT 0,
                tool_errors INTEGER NOT NULL DEFAULT 0,
                prompt_tokens BIGINT NOT NULL DEFAULT 0,
                completion_tokens BIGINT NOT NULL DEFAULT 0,
                attributes JSONB NOT NULL DEFAULT '{}'
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
                started_at TIMESTAMPTZ NOT NULL,
                ended_at TIMESTAMPTZ,
                latency_ms DOUBLE PRECISION,
                ttft_ms DOUBLE PRECISION,
                attempt INTEGER NOT NULL DEFAULT 1,
                prompt_tokens INTEGER NOT NULL DEFAULT 0,
                completion_tokens INTEGER NOT NULL DEFAULT 0,
                model TEXT,
                finish_reason TEXT,
                budget JSONB,
                state_version BIGINT,
                raw_output TEXT,
                parsed_action JSONB,
                tool_name TEXT,
                tool_call_id TEXT,
                tool_arguments TEXT,
                tool_result TEXT,
                error_type TEXT,
                error_message TEXT,
                attributes JSONB NOT NULL DEFAULT '{}',
                PRIMARY KEY (run_id, step_id)
            );
            CREATE INDEX IF NOT EXISTS trace_steps_order ON trace_steps (run_id, seq);
            """,
        ),
        Migration(
            "run heartbeats and time limits (abandoned runs); model-call filter",
            """
            ALTER TABLE trace_runs ADD COLUMN IF NOT EXISTS heartbeat_at TIMESTAMPTZ;
            ALTER TABLE trace_runs ADD COLUMN IF NOT EXISTS time_limit_s DOUBLE PRECISION;
            UPDATE trace_runs SET heartbeat_at = COALESCE(ended_at, started_at);
            CREATE INDEX IF NOT EXISTS trace_runs_model_calls ON trace_runs (model_calls);
            """,
        ),
    ),
)

# The status as read (the same rule as SQLite's): a run still 'running' with no sign of life
# for longer than abandon_after_s(time_limit_s) is 'abandoned'. One parameter: now.
_STATUS = (
    "CASE WHEN status = 'running' AND COALESCE(heartbeat_at, started_at) + make_interval("
    f"secs => COALESCE(time_limit_s, {DEFAULT_RUN_TIME_LIMIT_S!r}) + LEAST(COALESCE("
    f"time_limit_s, {DEFAULT_RUN_TIME_LIMIT_S!r}), {ABANDON_SLACK_CAP_S!r})) < %s "
    "THEN 'abandoned' ELSE status END"
)

_RUN_FIELDS = (
    "run_id",
    "session_id",
    "user_id",
    "tenant_id",
    "agent",
    "status",
    "started_at",
    "ended_at",
    "input",
    "output",
    "error_type",
    "error_message",
    "step_count",
    "model_calls",
    "tool_calls",
    "tool_errors",
    "prompt_tokens",
    "completion_tokens",
    "attributes",
    "time_limit_s",
)
_RUN_SELECT = ", ".join(_STATUS if name == "status" else name for name in _RUN_FIELDS)
_STEP_FIELDS = tuple(Step.model_fields)
_STEP_JSON = frozenset({"budget", "parsed_action", "attributes"})
# A JSON null and SQL NULL differ in jsonb; parsed_action keeps None as SQL NULL.
_UPSERT_RUN = upsert_run_sql("%s")

_INSERT_STEP = (
    f"INSERT INTO trace_steps ({', '.join(_STEP_FIELDS)}) "
    f"VALUES ({', '.join('%s' for _ in _STEP_FIELDS)}) "
    "ON CONFLICT (run_id, step_id) DO UPDATE SET "
    + ", ".join(f"{name} = excluded.{name}" for name in _STEP_FIELDS[2:])
)


def _step_values(step: Step) -> tuple[Any, ...]:
    values: list[Any] = []
    for name in _STEP_FIELDS:
        value = getattr(step, name)
        values.append(Jsonb(value) if name in _STEP_JSON and value is not None else value)
    return tuple(values)


def _run_values(run: Run) -> tuple[Any, ...]:
    return (
        run.run_id,
        run.session_id,
        run.user_id,
        run.tenant_id,
        run.agent,
        run.status,
        run.started_at,
        run.ended_at,
        run.input,
        run.output,
        run.error_type,
        run.error_message,
        Jsonb(run.attributes),
        run.time_limit_s,
        datetime.now(UTC),
    )


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

_END_RUN = (
    "UPDATE trace_runs SET status = %s, ended_at = %s, output = %s, "
    "error_type = %s, error_message = %s WHERE run_id = %s"
)


def _end_values(end: RunEnding) -> tuple[Any, ...]:
    return (end.status, end.ended_at, end.output, end.error_type, end.error_message, end.run_id)


def _by_run(steps: Sequence[Step]) -> dict[str, list[Step]]:
    by_run: dict[str, list[Step]] = {}
    for step in steps:
        by_run.setdefault(step.run_id, []).append(step)
    return by_run


def _write_steps(
    conn: psycopg.Connection[tuple[Any, ...]], run_id: str, steps: list[Step]
) -> psycopg.Cursor[tuple[Any, ...]]:
    """Insert or replace one run's steps and recount its totals; the caller checks the
    returned cursor (the run's row lock) once the pipeline is through."""
    locked = conn.execute(_LOCK_RUN, (run_id,))
    with conn.cursor() as cursor:
        cursor.executemany(_INSERT_STEP, [_step_values(step) for step in steps])
    conn.execute(_RECOUNT_TOTALS, (datetime.now(UTC), run_id, run_id))
    return locked


async def _awrite_steps(
    conn: psycopg.AsyncConnection[tuple[Any, ...]], run_id: str, steps: list[Step]
) -> psycopg.AsyncCursor[tuple[Any, ...]]:
    """Async twin of :func:`_write_steps`."""
    locked = await conn.execute(_LOCK_RUN, (run_id,))
    async with conn.cursor() as cursor:
        await cursor.executemany(_INSERT_STEP, [_step_values(step) for step in steps])
    await conn.execute(_RECOUNT_TOTALS, (datetime.now(UTC), run_id, run_id))
    return locked


def _missing_run(exc: psycopg.errors.ForeignKeyViolation, by_run: dict[str, list[Step]]) -> str:
    """The run a batch's steps named that does not exist, as the server reported it."""
    return next(
        (run_id for run_id in by_run if run_id in str(exc.diag.message_detail)),
        next(iter(by_run), "?"),
    )


def _no_step_run(run_id: str, by_run: dict[str, list[Step]]) -> StoreError:
    return StoreError(f"cannot write step {by_run[run_id][0].step_id}: no run {run_id!r}")


def _no_end_run(end: RunEnding) -> StoreError:
    return StoreError(f"cannot end run {end.run_id!r}: no such run")


class PostgresTraceStore(BatchedTraceStore):
    """Traces in PostgreSQL, for keel processes that share one database.

    Args:
        database: the :class:`~keel.stores.PostgresDatabase` to share (left open by
            :meth:`close`), or a ``postgresql://`` URL for a database of the store's own.
        min_size: with a URL, connections its pool keeps open.
        max_size: with a URL, most connections its pool opens.
        connect_timeout: with a URL, seconds to wait for the first connection (and for a
            free one).

    Raises:
        BackendUnavailableError: the server cannot be reached.
    """

    def __init__(
        self,
        database: PostgresDatabase | str,
        *,
        min_size: int = 1,
        max_size: int = 4,
        connect_timeout: float = 10.0,
    ) -> None:
        self._owns_database = isinstance(database, str)
        self.database = (
            PostgresDatabase(
                database, min_size=min_size, max_size=max_size, timeout=connect_timeout
            )
            if isinstance(database, str)
            else database
        )
        self.url = self.database.url
        self._ready = False
        try:
            self.database.open()
        except BaseException:
            if self._owns_database:
                self.database.close()
            raise

    @contextmanager
    def _tx(self) -> Iterator[psycopg.Connection[tuple[Any, ...]]]:
        with self.database.transaction() as conn:
            yield conn

    def setup(self) -> None:
        """Create or migrate the ``traces`` tables; idempotent and safe to run concurrently."""
        migrations = POSTGRES_TRACE_MIGRATIONS
        with self._tx() as conn:
            apply_migrations(conn, migrations)
        self._ready = True

    def _ensure(self) -> None:
        if not self._ready:
            self.setup()

    def write_batch(self, *, run: Run | None, steps: Sequence[Step], end: RunEnding | None) -> None:
        """One transaction for the whole batch; per run, one lock, one read of the steps
        written before and one totals update."""
        self._ensure()
        by_run = _by_run(steps)
        with self._tx() as conn:
            try:
                # One round trip for the batch instead of one per statement.
                with conn.pipeline():
                    if run is not None:
                        conn.execute(_UPSERT_RUN, _run_values(run))
                    locks = {
                        run_id: _write_steps(conn, run_id, run_steps)
                        for run_id, run_steps in by_run.items()
                    }
                    ended = conn.execute(_END_RUN, _end_values(end)) if end is not None else None
            except psycopg.errors.ForeignKeyViolation as exc:
                missing = _missing_run(exc, by_run)
                raise StoreError(f"cannot write steps: no run {missing!r}") from exc
            for run_id, locked in locks.items():
                if locked.fetchone() is None:
                    raise _no_step_run(run_id, by_run)
            if end is not None and ended is not None and ended.rowcount == 0:
                raise _no_end_run(end)

    # The writes' async twins run on the event loop's own connections: a worker thread would
    # wait for the GIL while the loop serves other sessions (up to the 5 ms switch interval
    # each way), at every flush of every turn.

    async def awrite_batch(
        self, *, run: Run | None, steps: Sequence[Step], end: RunEnding | None
    ) -> None:
        """Async twin of :meth:`write_batch`: the same statements in one pipeline."""
        if not self._ready:
            await asyncio.to_thread(self.setup)
        by_run = _by_run(steps)
        async with self.database.atransaction() as conn:
            try:
                async with conn.pipeline():
                    if run is not None:
                        await conn.execute(_UPSERT_RUN, _run_values(run))
                    locks = {
                        run_id: await _awrite_steps(conn, run_id, run_steps)
                        for run_id, run_steps in by_run.items()
                    }
                    ended = (
                        await conn.execute(_END_RUN, _end_values(end)) if end is not None else None
                    )
            except psycopg.errors.ForeignKeyViolation as exc:
                missing = _missing_run(exc, by_run)
                raise StoreError(f"cannot write steps: no run {missing!r}") from exc
            for run_id, locked in locks.items():
                if await locked.fetchone() is None:
                    raise _no_step_run(run_id, by_run)
            if end is not None and ended is not None and ended.rowcount == 0:
                raise _no_end_run(end)

    def get_run(self, run_id: str) -> Run | None:
        """The run with this id, or None."""
        self._ensure()
        with self._tx() as conn:
            row = conn.execute(
                f"SELECT {_RUN_SELECT} FROM trace_runs WHERE run_id = %s".encode(),
                (datetime.now(UTC), run_id),
            ).fetchone()
        return None if row is None else Run.model_validate(dict(zip(_RUN_FIELDS, row, strict=True)))

    def get_steps(self, run_id: str) -> list[Step]:
        """The run's steps in start order."""
        self._ensure()
        with self._tx() as conn:
            rows = conn.execute(
                f"SELECT {', '.join(_STEP_FIELDS)} FROM trace_steps WHERE run_id = %s "
                "ORDER BY seq, started_at",
                (run_id,),
            ).fetchall()
        return [Step.model_validate(dict(zip(_STEP_FIELDS, row, strict=True))) for row in rows]

    def list_runs(self, query: RunQuery | None = None) -> list[Run]:
        """Runs matching ``query``, newest first."""
        self._ensure()
        query = query or RunQuery()
        now = datetime.now(UTC)
        where: list[str] = []
        params: list[Any] = [now]
        for column in ("session_id", "user_id", "tenant_id", "agent"):
            value = getattr(query, column)
            if value is not None:
                where.append(f"{column} = %s")
                params.append(value)
        if query.status is not None:
            where.append(f"({_STATUS}) = %s")
            params.extend((now, query.status))
        if query.min_steps is not None:
            where.append("step_count >= %s")
            params.append(query.min_steps)
        if query.min_model_calls is not None:
            where.append("model_calls >= %s")
            params.append(query.min_model_calls)
        if query.tool_error is True:
            where.append("tool_errors > 0")
        elif query.tool_error is False:
            where.append("tool_errors = 0")
        if query.since is not None:
            where.append("started_at >= %s")
            params.append(query.since)
        if query.until is not None:
            where.append("started_at < %s")
            params.append(query.until)
        sql = f"SELECT {_RUN_SELECT} FROM trace_runs"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY started_at DESC, run_id DESC LIMIT %s"
        params.append(query.limit)
        with self._tx() as conn:
            rows = conn.execute(sql.encode(), params).fetchall()
        return [Run.model_validate(dict(zip(_RUN_FIELDS, row, strict=True))) for row in rows]

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
            where.append("r.session_id = %s")
            params.append(session_id)
        if tenant_id is not None:
            where.append("r.tenant_id = %s")
            params.append(tenant_id)
        if since is not None:
            where.append("r.started_at >= %s")
            params.append(since)
        sql = (
            "SELECT r.session_id, s.run_id, s.kind, s.name, s.started_at, s.attempt, "
            "s.prompt_tokens, s.ttft_ms, s.error_type IS NOT NULL "
            "FROM trace_runs r JOIN trace_steps s ON s.run_id = r.run_id"
        )
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY s.started_at, s.run_id, s.seq"
        with self._tx() as conn:
            rows = conn.execute(sql.encode(), params).fetchall()
        return [
            StepMetric(
                session_id=row[0],
                run_id=row[1],
                kind=row[2],
                name=row[3],
                started_at=row[4],
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
        with self._tx() as conn:
            rows = conn.execute(
                "SELECT run_id FROM trace_runs WHERE run_id LIKE %s ESCAPE '\\' "
                "ORDER BY run_id LIMIT %s",
                (pattern, limit),
            ).fetchall()
        return [str(row[0]) for row in rows]

    def delete_runs(self, *, before: datetime) -> int:
        """Delete runs started before ``before`` with their steps; returns how many runs."""
        self._ensure()
        with self._tx() as conn:
            deleted = conn.execute(
                "DELETE FROM trace_runs WHERE started_at < %s", (before,)
            ).rowcount
        return int(deleted)

    def close(self) -> None:
        """Close the database, unless it was passed in."""
        if self._owns_database:
            self.database.close()

    def __repr__(self) -> str:
        return f"PostgresTraceStore({self.url.split('@')[-1]!r})"
