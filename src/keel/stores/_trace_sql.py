"""SQL the SQLite and PostgreSQL trace stores share: written once, placeholders by dialect."""

from __future__ import annotations

__all__ = ["RUN_HEADER_FIELDS", "step_contribution", "upsert_run_sql"]

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
