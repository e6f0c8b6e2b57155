"""What the SQLite and PostgreSQL trace stores share: SQL written once (placeholders by
dialect), and every write made a batch."""

from __future__ import annotations

from datetime import datetime

from keel.tracing._models import Run, RunStatus, Step
from keel.tracing._store import RunEnding, TraceStore

__all__ = ["RUN_HEADER_FIELDS", "BatchedTraceStore", "step_contribution", "upsert_run_sql"]


class BatchedTraceStore(TraceStore):
    """A trace store whose one write is :meth:`write_batch` (and :meth:`awrite_batch`): a
    run's start, a step and a run's end are each a batch of one, sync and async alike."""

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
        """Async twin of :meth:`start_run`."""
        await self.awrite_batch(run=run, steps=(), end=None)

    async def awrite_step(self, step: Step) -> None:
        """Async twin of :meth:`write_step`."""
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
        """Async twin of :meth:`end_run`."""
        ending = RunEnding(run_id, status, ended_at, output, error_type, error_message)
        await self.awrite_batch(run=None, steps=(), end=ending)


RUN_HEADER_FIELDS = (
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
"""The columns a run's header writes, in the order of ``upsert_run_sql``'s values."""


def upsert_run_sql(placeholder: str) -> str:
    """Insert a run's header, or replace it and keep the run's steps and totals."""
    return (
        f"INSERT INTO trace_runs ({', '.join(RUN_HEADER_FIELDS)}) "
        f"VALUES ({', '.join(placeholder for _ in RUN_HEADER_FIELDS)}) "
        "ON CONFLICT (run_id) DO UPDATE SET "
        + ", ".join(f"{name} = excluded.{name}" for name in RUN_HEADER_FIELDS[1:])
    )


def step_contribution(kind: str, failed: bool, prompt: int, completion: int) -> tuple[int, ...]:
    """What one step adds to its run's totals: steps, model calls, tool calls, tool errors,
    prompt tokens, completion tokens (the order of the stores' totals UPDATE)."""
    return (
        1,
        int(kind == "model"),
        int(kind == "tool"),
        int(kind == "tool" and failed),
        prompt,
        completion,
    )
