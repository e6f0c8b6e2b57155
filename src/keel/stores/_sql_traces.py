"""Run traces: one class over a SQL database, SQLite or PostgreSQL alike (component
``traces``).

Two tables: ``trace_runs`` (one row per run, with running totals so listing and filtering
never scans steps) and ``trace_steps`` (one row per step, keyed by run and step id, ordered by
``seq``). Indexes serve each ``keel runs list`` filter. Times and JSON are stored the
dialect's way (SQLite: exact integer Unix microseconds and text; PostgreSQL: ``timestamptz``
and ``jsonb``).

A run's ``heartbeat_at`` is refreshed by every write of the run (start, resume, each step);
reads report a ``running`` run whose heartbeat is older than ``abandon_after_s`` of its time
limit as ``abandoned`` (``keel.tracing.RunStatus``).

Every operation is a plan (``_sql_plan.py``) run by the database. A batch of steps updates its
run's totals first, which locks the run's row (PostgreSQL; SQLite's write transaction holds the
whole file), so concurrent writers of one run take turns and each step's difference moves the
run's totals exactly once; a batch that ends the run ends it in that same statement.
[`PostgresTraceStore`][keel.stores.PostgresTraceStore] sends a batch in one pipeline instead
(one round trip).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection, Sequence
from datetime import UTC, datetime
from functools import cache
from typing import Any, TypeVar, cast

from pydantic_core import to_json

from keel.errors import StoreError
from keel.stores._dialect import SqlDialect, _json_text
from keel.stores._erase_sql import count_deleted
from keel.stores._migrations import Migration, MigrationSet
from keel.stores._sql_plan import Plan, Rider, SQLDatabase, Statement
from keel.tracing._models import (
    ABANDON_SLACK_CAP_S,
    DEFAULT_RUN_TIME_LIMIT_S,
    Run,
    RunDetail,
    RunQuery,
    RunStatus,
    Step,
    StepMetric,
)
from keel.tracing._store import RunEnding, TraceStore

__all__ = ["STEP_FIELDS", "SQLTraceStore", "TraceSQL", "trace_migrations", "trace_sql"]

_T = TypeVar("_T")


# Column types are the dialect's ({time}: a timestamp, {json}, {real}, {big}: a BIGINT).
_RUNS_AND_STEPS = """
    CREATE TABLE IF NOT EXISTS trace_runs (
        run_id TEXT PRIMARY KEY,
        session_id TEXT NOT NULL,
        user_id TEXT,
        tenant_id TEXT,
        agent TEXT NOT NULL,
        status TEXT NOT NULL,
        started_at {time} NOT NULL,
        ended_at {time},
        input TEXT,
        output TEXT,
        error_type TEXT,
        error_message TEXT,
        step_count INTEGER NOT NULL DEFAULT 0,
        model_calls INTEGER NOT NULL DEFAULT 0,
        tool_calls INTEGER NOT NULL DEFAULT 0,
        tool_errors INTEGER NOT NULL DEFAULT 0,
        prompt_tokens {big} NOT NULL DEFAULT 0,
        completion_tokens {big} NOT NULL DEFAULT 0,
        attributes {json} NOT NULL DEFAULT '{{}}'
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
        started_at {time} NOT NULL,
        ended_at {time},
        latency_ms {real},
        ttft_ms {real},
        attempt INTEGER NOT NULL DEFAULT 1,
        prompt_tokens INTEGER NOT NULL DEFAULT 0,
        completion_tokens INTEGER NOT NULL DEFAULT 0,
        model TEXT,
        finish_reason TEXT,
        budget {json},
        state_version {big},
        raw_output TEXT,
        parsed_action {json},
        tool_name TEXT,
        tool_call_id TEXT,
        tool_arguments TEXT,
        tool_result TEXT,
        error_type TEXT,
        error_message TEXT,
        attributes {json} NOT NULL DEFAULT '{{}}',
        PRIMARY KEY (run_id, step_id)
    );
    CREATE INDEX IF NOT EXISTS trace_steps_order ON trace_steps (run_id, seq);
"""
_HEARTBEATS = """
    ALTER TABLE trace_runs {add_column} heartbeat_at {time};
    ALTER TABLE trace_runs {add_column} time_limit_s {real};
    UPDATE trace_runs SET heartbeat_at = COALESCE(ended_at, started_at);
    CREATE INDEX IF NOT EXISTS trace_runs_model_calls ON trace_runs (model_calls);
"""
# Pages a turn writes for indexes it does not need to write (a turn's run: its start, two
# batches of steps, its end):
# - The counter indexes hold the runs that are not running: a running run's totals move with
#   every batch of its steps, and each move rewrote a page of both indexes (three a turn
#   each); now only the run's end (its totals and status in one statement) enters them. The
#   filters read them for those runs, and `trace_runs_status` for the running ones
#   (`TraceSQL.list_runs`).
# - A run's steps are found by the key's index (run, step) and sorted by ``seq`` when read (a
#   run's steps are few, and all of them are read): a second index in that order cost a page
#   a batch.
_FEWER_INDEXES = """
    DROP INDEX IF EXISTS trace_steps_order;
    DROP INDEX IF EXISTS trace_runs_steps;
    DROP INDEX IF EXISTS trace_runs_model_calls;
    CREATE INDEX IF NOT EXISTS trace_runs_ended_steps
        ON trace_runs (step_count) WHERE status <> 'running';
    CREATE INDEX IF NOT EXISTS trace_runs_ended_model_calls
        ON trace_runs (model_calls) WHERE status <> 'running';
"""


def trace_migrations(dialect: SqlDialect) -> MigrationSet:
    """The ``traces`` component's migrations in ``dialect``'s column types."""
    types = {
        "time": dialect.time_type,
        "json": dialect.json_type,
        "real": dialect.real_type,
        "big": dialect.big_int_type,
        "add_column": dialect.add_column,
    }
    return MigrationSet(
        "traces",
        (
            Migration("runs and steps", _RUNS_AND_STEPS.format(**types)),
            Migration(
                "run heartbeats and time limits (abandoned runs); model-call filter",
                _HEARTBEATS.format(**types),
            ),
            Migration(
                "counter indexes of the runs that are not running (a running run's totals "
                "move without rewriting them); steps found by their key's index alone",
                _FEWER_INDEXES,
            ),
        ),
    )


_RUN_FIELDS = tuple(Run.model_fields)
STEP_FIELDS = tuple(Step.model_fields)
"""A step's columns, in the order of `TraceSQL.step_values`."""
_RUN_HEADER_FIELDS = (
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
    "attributes",
    "time_limit_s",
    "heartbeat_at",
)
_JSON = frozenset({"budget", "parsed_action", "attributes"})
_TIMES = frozenset({"started_at", "ended_at"})
_step_fields = operator.attrgetter(*STEP_FIELDS)
_STEP_JSON = tuple(index for index, name in enumerate(STEP_FIELDS) if name in _JSON)
_STEP_TIMES = tuple(index for index, name in enumerate(STEP_FIELDS) if name in _TIMES)
_LIST_FILTERS = ("session_id", "user_id", "tenant_id", "agent")


def _upsert(
    table: str, fields: Sequence[str], key: str, action: str, as_text: Collection[str] = ()
) -> str:
    """``as_text``: fields whose value is bound as UTF-8 bytes and stored as the text they spell."""
    values = ", ".join("CAST(? AS TEXT)" if name in as_text else "?" for name in fields)
    return (
        f"INSERT INTO {table} ({', '.join(fields)}) VALUES ({values}) ON CONFLICT ({key}) {action}"
    )


def _replace(fields: Sequence[str]) -> str:
    return "DO UPDATE SET " + ", ".join(f"{name} = excluded.{name}" for name in fields)


class TraceSQL:
    """The trace statements and row conversions in one dialect (built once per dialect by
    `trace_sql`). Statements keep ``?`` markers: the plan runner spells them for the driver.
    """

    def __init__(self, dialect: SqlDialect) -> None:
        self.dialect = dialect
        # JSON kept as text (SQLite) is written by pydantic-core, several times faster than
        # ``json.dumps`` (the same JSON without its spaces); PostgreSQL's jsonb as the dialect does.
        self.to_json = _compact_json if dialect.to_json is _json_text else dialect.to_json
        # A step's JSON as text (SQLite) is bound as pydantic-core's UTF-8 and cast to TEXT by
        # SQLite: the same stored text, without decoding it into a ``str`` that the driver
        # then encodes back (a model step's summary block, 4,000 characters, is not ASCII).
        text_json = dialect.to_json is _json_text
        self.step_json = _json_bytes if text_json else dialect.to_json
        as_text = _JSON if text_json else frozenset()
        # The status as read: a run still 'running' with no sign of life for longer than
        # abandon_after_s(time_limit_s) is 'abandoned' (its worker died). One parameter: now.
        limit = f"COALESCE(time_limit_s, {DEFAULT_RUN_TIME_LIMIT_S!r})"
        silent_until = dialect.plus_seconds.format(
            "COALESCE(heartbeat_at, started_at)",
            f"{limit} + {dialect.least}({limit}, {ABANDON_SLACK_CAP_S!r})",
        )
        self.status = (
            f"CASE WHEN status = 'running' AND {silent_until} < ? THEN 'abandoned' ELSE status END"
        )
        self.run_columns = ", ".join(
            self.status if name == "status" else name for name in _RUN_FIELDS
        )
        self.upsert_run = _upsert(
            "trace_runs", _RUN_HEADER_FIELDS, "run_id", _replace(_RUN_HEADER_FIELDS[1:])
        )
        self.upsert_step = _upsert(
            "trace_steps", STEP_FIELDS, "run_id, step_id", _replace(STEP_FIELDS[2:]), as_text
        )
        self.insert_new_step = _upsert(
            "trace_steps", STEP_FIELDS, "run_id, step_id", "DO NOTHING", as_text
        )
        self.end_run = (
            "UPDATE trace_runs SET status = ?, ended_at = ?, output = ?, "
            "error_type = ?, error_message = ? WHERE run_id = ?"
        )
        # Locks the run's row (PostgreSQL): concurrent writers of one run's steps take turns
        # here, and each later statement (READ COMMITTED) sees the steps of the writer before.
        self.lock_run = f"SELECT 1 FROM trace_runs WHERE run_id = ?{dialect.row_lock}"

    def run_values(self, run: Run) -> tuple[Any, ...]:
        """The parameters of `upsert_run` (the heartbeat is now)."""
        to_time = self.dialect.to_time
        return (
            run.run_id,
            run.session_id,
            run.user_id,
            run.tenant_id,
            run.agent,
            run.status,
            to_time(run.started_at),
            to_time(run.ended_at),
            run.input,
            run.output,
            run.error_type,
            run.error_message,
            self.to_json(run.attributes),
            run.time_limit_s,
            to_time(datetime.now(UTC)),
        )

    def step_values(self, step: Step) -> tuple[Any, ...]:
        """The parameters of `upsert_step` and `insert_new_step`."""
        # The fields read in one C call, then the five that are converted: three steps a
        # turn, twenty-six fields each.
        values = list(_step_fields(step))
        to_json, to_time = self.step_json, self.dialect.to_time
        for index in _STEP_JSON:
            values[index] = to_json(values[index])
        for index in _STEP_TIMES:
            values[index] = to_time(values[index])
        return tuple(values)

    def end_values(self, end: RunEnding) -> tuple[Any, ...]:
        """The parameters of `end_run`."""
        ended_at = self.dialect.to_time(end.ended_at)
        return (end.status, ended_at, end.output, end.error_type, end.error_message, end.run_id)

    def run_from_row(self, row: Sequence[Any]) -> Run:
        data = dict(zip(_RUN_FIELDS, row, strict=True))
        data["started_at"] = self.dialect.from_time(data["started_at"])
        data["ended_at"] = self.dialect.from_time(data["ended_at"])
        data["attributes"] = self.dialect.from_json(data["attributes"])
        return Run.model_validate(data)

    def step_from_row(self, row: Sequence[Any]) -> Step:
        from_json, from_time = self.dialect.from_json, self.dialect.from_time
        data: dict[str, Any] = {}
        for name, value in zip(STEP_FIELDS, row, strict=True):
            if name in _JSON:
                data[name] = from_json(value)
            elif name in _TIMES:
                data[name] = from_time(value)
            else:
                data[name] = value
        if data["attributes"] is None:
            data["attributes"] = {}
        return Step.model_validate(data)

    def list_runs(self, query: RunQuery) -> tuple[str, list[Any]]:
        """The statement and parameters of `SQLTraceStore.list_runs`."""
        now = self.dialect.to_time(datetime.now(UTC))
        where: list[str] = []
        params: list[Any] = [now]
        for column in _LIST_FILTERS:
            value = getattr(query, column)
            if value is not None:
                where.append(f"{column} = ?")
                params.append(value)
        if query.status is not None:
            where.append(f"({self.status}) = ?")
            params.extend((now, query.status))
        for column, least in (
            ("step_count", query.min_steps),
            ("model_calls", query.min_model_calls),
        ):
            if least is not None:
                # Two branches, each with its index: the partial one of the runs that are
                # not running (its condition spelled as the index's), and the status index.
                where.append(
                    f"(status <> 'running' AND {column} >= ? "
                    f"OR status = 'running' AND {column} >= ?)"
                )
                params.extend((least, least))
        if query.tool_error is not None:
            where.append("tool_errors > 0" if query.tool_error else "tool_errors = 0")
        for condition, moment in (
            ("started_at >= ?", query.since),
            ("started_at < ?", query.until),
        ):
            if moment is not None:
                where.append(condition)
                params.append(self.dialect.to_time(moment))
        params.append(query.limit)
        return (
            f"SELECT {self.run_columns} FROM trace_runs{_where(where)} "
            "ORDER BY started_at DESC, run_id DESC LIMIT ?",
            params,
        )

    def step_metrics(
        self, session_id: str | None, since: datetime | None, tenant_id: str | None
    ) -> tuple[str, list[Any]]:
        """The statement and parameters of `SQLTraceStore.step_metrics`."""
        where: list[str] = []
        params: list[Any] = []
        for condition, value in (
            ("r.session_id = ?", session_id),
            ("r.tenant_id = ?", tenant_id),
            ("r.started_at >= ?", self.dialect.to_time(since)),
        ):
            if value is not None:
                where.append(condition)
                params.append(value)
        return (
            "SELECT r.session_id, s.run_id, s.kind, s.name, s.started_at, s.attempt, "
            "s.prompt_tokens, s.ttft_ms, s.error_type IS NOT NULL "
            f"FROM trace_runs r JOIN trace_steps s ON s.run_id = r.run_id{_where(where)} "
            "ORDER BY s.started_at, s.run_id, s.seq",
            params,
        )

    def metric_from_row(self, row: Sequence[Any]) -> StepMetric:
        return StepMetric(
            session_id=row[0],
            run_id=row[1],
            kind=row[2],
            name=row[3],
            started_at=cast("datetime", self.dialect.from_time(row[4])),
            attempt=row[5],
            prompt_tokens=row[6],
            ttft_ms=row[7],
            failed=bool(row[8]),
        )


def _compact_json(value: Any) -> str | None:
    if value is None:
        return None
    try:
        return to_json(value, inf_nan_mode="constants").decode()
    except Exception:  # what pydantic-core will not write, json.dumps writes as it did
        return _json_text(value)


def _json_bytes(value: Any) -> bytes | str | None:
    """``value`` as JSON for a ``CAST(? AS TEXT)`` marker: pydantic-core's UTF-8 bytes (it
    refuses a text it cannot encode, a lone surrogate), else `_compact_json`'s text."""
    if value is None:
        return None
    try:
        return to_json(value, inf_nan_mode="constants")
    except Exception:  # what pydantic-core will not write, json.dumps writes as it did
        return _json_text(value)


def _where(conditions: list[str]) -> str:
    return f" WHERE {' AND '.join(conditions)}" if conditions else ""


@cache
def trace_sql(dialect: SqlDialect) -> TraceSQL:
    """The trace statements in ``dialect`` (one per dialect)."""
    return TraceSQL(dialect)


_OLD_STEP = (
    "SELECT kind, error_type, prompt_tokens, completion_tokens FROM trace_steps "
    "WHERE run_id = ? AND step_id = ?"
)
# The heartbeat only moves forward (a NULL one, of a run from before heartbeats, is set).
_ADD_TOTALS = (
    "UPDATE trace_runs SET step_count = step_count + ?, "
    "model_calls = model_calls + ?, tool_calls = tool_calls + ?, "
    "tool_errors = tool_errors + ?, prompt_tokens = prompt_tokens + ?, "
    "completion_tokens = completion_tokens + ?, heartbeat_at = CASE "
    "WHEN heartbeat_at IS NULL OR heartbeat_at < ? THEN ? ELSE heartbeat_at END"
)
_ADD_TOTALS_OF_RUN = f"{_ADD_TOTALS} WHERE run_id = ?"
# A batch that ends the run its steps belong to (a turn's last flush) ends it in the same
# statement: the end's columns, as `TraceSQL.end_run` sets them.
_ADD_TOTALS_AND_END = (
    f"{_ADD_TOTALS}, status = ?, ended_at = ?, output = ?, error_type = ?, error_message = ? "
    "WHERE run_id = ?"
)
_DELETE_STEPS = (
    "DELETE FROM trace_steps WHERE run_id IN (SELECT run_id FROM trace_runs WHERE started_at < ?)"
)
_DELETE_RUNS = "DELETE FROM trace_runs WHERE started_at < ?"
_RUN_IDS_LIKE = (
    "SELECT run_id FROM trace_runs WHERE run_id LIKE ? ESCAPE '\\' ORDER BY run_id LIMIT ?"
)


class SQLTraceStore(TraceStore):
    """Traces in a SQL database ([`SQLiteDatabase`][keel.stores.SQLiteDatabase] or
    [`PostgresDatabase`][keel.stores.PostgresDatabase]), next to state, memory and the
    journal; applies its migrations on construction. Every write is a batch
    ([`write_batch`][]), one transaction; the async twins run the same plans through the
    database's ``arun``.

    Args:
        db: the database to share (left open by [`close`][]).

    Raises:
        BackendUnavailableError: a server database cannot be reached.
    """

    def __init__(self, db: SQLDatabase) -> None:
        self.db = db
        self.statements = trace_sql(db.dialect)
        self.setup()

    def setup(self) -> None:
        """Create or migrate the ``traces`` tables; idempotent (and safe to run concurrently)."""
        self.db.migrate(trace_migrations(self.db.dialect))

    async def acall(self, call: Callable[[], _T]) -> _T:
        # The database's own rule (a composed read, the setup): on SQLite inline unless it
        # would wait, on PostgreSQL on keel's blocking pool.
        return await self.db.acall(call)

    def _fetch(self, sql: str, params: Sequence[Any]) -> list[Any]:
        return self.db.run(lambda: _rows(Statement(sql, params)), write=False)

    async def _afetch(self, sql: str, params: Sequence[Any]) -> list[Any]:
        return await self.db.arun(lambda: _rows(Statement(sql, params)), write=False)

    # --- writes -------------------------------------------------------------------------------

    def write_batch(self, *, run: Run | None, steps: Sequence[Step], end: RunEnding | None) -> None:
        """One transaction for the whole batch, one totals update per run."""
        self.db.run(lambda: _write_batch(self.statements, run, steps, end))

    async def awrite_batch(
        self, *, run: Run | None, steps: Sequence[Step], end: RunEnding | None
    ) -> None:
        """Async twin of [`write_batch`][]."""
        await self.db.arun(lambda: _write_batch(self.statements, run, steps, end))

    def rider(self, run: Run | None, steps: Sequence[Step], end: RunEnding | None) -> Rider:
        """[`awrite_batch`][] as a rider (``keel.stores._sql_plan.Rider``): written by the next
        write on this store's database in the rider's context (a turn's checkpoint), in the
        same transaction."""
        return Rider(self.db, lambda: _write_batch(self.statements, run, steps, end))

    def start_run(self, run: Run) -> None:
        """Insert the run (or replace its header, keeping steps and totals)."""
        self.write_batch(run=run, steps=(), end=None)

    def write_step(self, step: Step) -> None:
        """Insert or replace the step and keep its run's totals exact."""
        self.write_batch(run=None, steps=(step,), end=None)

    def end_run(
        self,
        run_id: str,
        *,
        status: RunStatus,
        ended_at: datetime,
        output: str | None = None,
        error_type: str | None = None,
        error_message: str | None = None,
    ) -> None:
        """Set the run's final status, end time, output and error."""
        ending = RunEnding(run_id, status, ended_at, output, error_type, error_message)
        self.write_batch(run=None, steps=(), end=ending)

    async def astart_run(self, run: Run) -> None:
        """Async twin of `start_run`."""
        await self.awrite_batch(run=run, steps=(), end=None)

    async def awrite_step(self, step: Step) -> None:
        """Async twin of `write_step`."""
        await self.awrite_batch(run=None, steps=(step,), end=None)

    async def aend_run(
        self,
        run_id: str,
        *,
        status: RunStatus,
        ended_at: datetime,
        output: str | None = None,
        error_type: str | None = None,
        error_message: str | None = None,
    ) -> None:
        """Async twin of `end_run`."""
        ending = RunEnding(run_id, status, ended_at, output, error_type, error_message)
        await self.awrite_batch(run=None, steps=(), end=ending)

    def delete_runs(self, *, before: datetime) -> int:
        """Delete runs started before ``before`` with their steps; returns how many runs."""
        cutoff = (self.db.dialect.to_time(before),)
        return self.db.run(lambda: _delete_runs(cutoff))

    def user_sessions(self, tenant_id: str, user_id: str) -> list[str]:
        rows = self._fetch(_USER_SESSIONS, (tenant_id, user_id))
        return sorted(str(session_id) for (session_id,) in rows)

    def erase_user(self, tenant_id: str, user_id: str) -> dict[str, int]:
        return self.db.run(lambda: _erase_user(tenant_id, user_id))

    # --- reads --------------------------------------------------------------------------------

    def _run_query(self, run_id: str) -> tuple[str, tuple[Any, ...]]:
        now = self.db.dialect.to_time(datetime.now(UTC))
        return f"SELECT {self.statements.run_columns} FROM trace_runs WHERE run_id = ?", (
            now,
            run_id,
        )

    def get_run(self, run_id: str) -> Run | None:
        """The run with this id, or None."""
        rows = self._fetch(*self._run_query(run_id))
        return self.statements.run_from_row(rows[0]) if rows else None

    async def aget_run(self, run_id: str) -> Run | None:
        rows = await self._afetch(*self._run_query(run_id))
        return self.statements.run_from_row(rows[0]) if rows else None

    def get_steps(self, run_id: str) -> list[Step]:
        """The run's steps in start order."""
        return [self.statements.step_from_row(row) for row in self._fetch(_STEPS, (run_id,))]

    async def aget_run_detail(self, run_id: str) -> RunDetail | None:
        return await self.db.acall(lambda: self.get_run_detail(run_id))

    def list_runs(self, query: RunQuery | None = None) -> list[Run]:
        """Runs matching ``query``, newest first."""
        rows = self._fetch(*self.statements.list_runs(query or RunQuery()))
        return [self.statements.run_from_row(row) for row in rows]

    async def alist_runs(self, query: RunQuery | None = None) -> list[Run]:
        rows = await self._afetch(*self.statements.list_runs(query or RunQuery()))
        return [self.statements.run_from_row(row) for row in rows]

    def step_metrics(
        self,
        *,
        session_id: str | None = None,
        since: datetime | None = None,
        tenant_id: str | None = None,
    ) -> list[StepMetric]:
        """Indicator columns of matching steps, oldest first."""
        rows = self._fetch(*self.statements.step_metrics(session_id, since, tenant_id))
        return [self.statements.metric_from_row(row) for row in rows]

    def run_ids_starting_with(self, prefix: str, *, limit: int = 2) -> list[str]:
        """Up to ``limit`` run ids that start with ``prefix``."""
        pattern = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        return [str(row[0]) for row in self._fetch(_RUN_IDS_LIKE, (pattern, limit))]

    def close(self) -> None:
        """Nothing to release: the database is the caller's to close."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.db!r})"


_STEPS = (
    f"SELECT {', '.join(STEP_FIELDS)} FROM trace_steps WHERE run_id = ? ORDER BY seq, started_at"
)


def _rows(statement: Statement) -> Plan[list[Any]]:
    return (yield statement).rows


def _delete_runs(cutoff: tuple[Any, ...]) -> Plan[int]:
    yield Statement(_DELETE_STEPS, cutoff)
    return (yield Statement(_DELETE_RUNS, cutoff)).rowcount


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


def _write_batch(
    sql: TraceSQL, run: Run | None, steps: Sequence[Step], end: RunEnding | None
) -> Plan[None]:
    if run is not None:
        yield Statement(sql.upsert_run, sql.run_values(run))
    if steps:
        end = yield from _write_steps(sql, steps, end)
    if end is not None and (yield Statement(sql.end_run, sql.end_values(end))).rowcount == 0:
        raise StoreError(f"cannot end run {end.run_id!r}: no such run")


def _write_steps(
    sql: TraceSQL, steps: Sequence[Step], end: RunEnding | None
) -> Plan[RunEnding | None]:
    """Insert or replace each step; each run's totals move by the difference, exactly.

    Per run, its totals move first, by what its steps add if all are new: one UPDATE that
    also finds the run (none: the batch fails, nothing written) and, on PostgreSQL, locks its
    row, so concurrent writers of one run take turns and each (READ COMMITTED) sees the steps
    of the writer before. It ends the run too when ``end`` is this run's (a turn's last
    flush). A step written again then takes back what its old row added. Returns ``end``
    when no run of the steps took it."""
    by_run: dict[str, list[Step]] = {}
    for step in steps:
        by_run.setdefault(step.run_id, []).append(step)
    now = sql.dialect.to_time(datetime.now(UTC))
    for run_id, written in by_run.items():
        added = [0] * 6
        for step in written:
            contribution = _contribution(
                step.kind, step.failed, step.prompt_tokens, step.completion_tokens
            )
            added = [a + b for a, b in zip(added, contribution, strict=True)]
        if end is not None and end.run_id == run_id:
            ending = sql.end_values(end)[:-1]
            totals = Statement(_ADD_TOTALS_AND_END, (*added, now, now, *ending, run_id))
            end = None
        else:
            totals = Statement(_ADD_TOTALS_OF_RUN, (*added, now, now, run_id))
        if (yield totals).rowcount == 0:
            raise StoreError(f"cannot write step {written[0].step_id}: no run {run_id!r}")
        taken_back: list[int] | None = None
        for step in written:
            values = sql.step_values(step)
            if (yield Statement(sql.insert_new_step, values)).rowcount == 0:
                # A step written again: replace it, and take back what its old row added.
                old_row = (yield Statement(_OLD_STEP, (step.run_id, step.step_id))).rows[0]
                old = _contribution(old_row[0], old_row[1] is not None, old_row[2], old_row[3])
                taken_back = [t - o for t, o in zip(taken_back or [0] * 6, old, strict=True)]
                yield Statement(sql.upsert_step, values)
        if taken_back is not None:
            yield Statement(_ADD_TOTALS_OF_RUN, (*taken_back, now, now, run_id))
    return end


_OF_USER = "FROM trace_runs WHERE tenant_id = ? AND user_id = ?"
_USER_SESSIONS = f"SELECT DISTINCT session_id {_OF_USER}"


def _erase_user(tenant_id: str, user_id: str) -> Plan[dict[str, int]]:
    """The user's runs and their steps, in one transaction."""
    counts: dict[str, int] = {}
    params = (tenant_id, user_id)
    steps = f"DELETE FROM trace_steps WHERE run_id IN (SELECT run_id {_OF_USER})"
    yield from count_deleted(counts, "trace_steps", steps, params)
    yield from count_deleted(counts, "trace_runs", f"DELETE {_OF_USER}", params)
    return counts
