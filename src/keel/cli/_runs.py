"""``keel runs``: list, inspect and judge stored run traces."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated, Any

import typer

from keel.cli._app import JsonOption, app, bench_app, emit_json, out_console
from keel.cli._database import DatabaseOption
from keel.errors import UsageError
from keel.tracing._render import STATUS_STYLE, format_ms

if TYPE_CHECKING:
    from rich.console import Console

    from keel.tracing import Run, RunQuery, SessionStats, StepNode, TraceStore

runs_app = typer.Typer(
    help="Run traces: list runs, show one as a tree of steps, death-spiral indicators.",
    no_args_is_help=True,
)
app.add_typer(runs_app, name="runs")

SinceOption = Annotated[
    str | None,
    typer.Option("--since", help="Only runs started since: an ISO time or an age (1h, 2d)."),
]


@contextlib.contextmanager
def _store(database: str | None) -> Iterator[TraceStore]:
    from keel.cli._database import database_settings
    from keel.stores import Backends

    with Backends.open(database_settings(database), memory=False, redis_url="") as backends:
        yield backends.traces


def _console() -> Console:
    """The terminal console; piped output gets a wide one so rows and tree lines stay whole."""
    from rich.console import Console

    if out_console.is_terminal:
        return out_console
    return Console(highlight=False, width=200)


@runs_app.command("list")
def list_command(
    session: Annotated[str | None, typer.Option("--session", help="Only this session.")] = None,
    min_steps: Annotated[
        int | None,
        typer.Option("--min-steps", min=0, help="Only runs with at least N steps (model calls)."),
    ] = None,
    status: Annotated[
        str | None,
        typer.Option(
            "--status",
            help="Only runs with this status: running, succeeded, failed, limited, escalated, "
            "interrupted (stopped before its turn ended: cancelled, or its process died and "
            "a later run took the turn over), abandoned (never ended and never taken over: "
            "its worker died).",
        ),
    ] = None,
    tool_error: Annotated[
        bool, typer.Option("--tool-error", help="Only runs where a tool call failed.")
    ] = False,
    since: SinceOption = None,
    user: Annotated[str | None, typer.Option("--user", help="Only this user.")] = None,
    tenant: Annotated[str | None, typer.Option("--tenant", help="Only this tenant.")] = None,
    agent: Annotated[str | None, typer.Option("--agent", help="Only this agent.")] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, help="At most N runs.")] = 50,
    database: DatabaseOption = None,
    as_json: JsonOption = False,
) -> None:
    """List runs, newest first."""
    query = _run_query(
        {
            "session_id": session,
            "user_id": user,
            "tenant_id": tenant,
            "agent": agent,
            "status": status,
            "min_model_calls": min_steps,
            "tool_error": True if tool_error else None,
            "since": since,
            "limit": limit,
        }
    )
    with _store(database) as store:
        runs = store.list_runs(query)
    if as_json:
        emit_json(
            {
                "count": len(runs),
                "filters": query.model_dump(mode="json", exclude_none=True),
                "runs": [run.model_dump(mode="json") for run in runs],
            }
        )
        return
    if not runs:
        _console().print("no runs match")
        return
    _console().print(_runs_table(runs))
    _console().print(f"{len(runs)} run(s); `keel runs show RUN` for details")


def _run_query(filters: dict[str, Any]) -> RunQuery:
    """The query the list's options ask for (``since``: an ISO time or an age)."""
    from pydantic import ValidationError

    from keel.tracing import RUN_STATUSES, RunQuery, parse_since

    status = filters["status"]
    if status is not None and status not in RUN_STATUSES:
        raise UsageError(f"unknown status {status!r}; use one of {', '.join(RUN_STATUSES)}")
    since = filters["since"]
    try:
        return RunQuery.model_validate({**filters, "since": parse_since(since) if since else None})
    except ValidationError as exc:
        raise UsageError(f"invalid filter: {exc.errors()[0]['msg']}") from exc


def _runs_table(runs: list[Run]) -> Any:
    from rich.table import Table

    table = Table(box=None, header_style="bold")
    table.add_column("run", no_wrap=True)
    table.add_column("session")
    table.add_column("agent")
    table.add_column("status", no_wrap=True)
    table.add_column("started (UTC)", no_wrap=True)
    table.add_column("time", justify="right", no_wrap=True)
    # A run's steps are its model calls, as the reply counts them; the tool calls made in
    # them are their own column (the trace also holds guard, checkpoint, ... records).
    table.add_column("steps", justify="right")
    table.add_column("tools", justify="right")
    table.add_column("tokens in/out", justify="right")
    table.add_column("tool errors", justify="right")
    for run in runs:
        style = STATUS_STYLE.get(run.status, "")
        table.add_row(
            run.run_id[:12],
            run.session_id,
            run.agent,
            f"[{style}]{run.status}[/]",
            run.started_at.strftime("%Y-%m-%d %H:%M:%S"),
            format_ms(run.duration_ms),
            str(run.model_calls),
            str(run.tool_calls),
            f"{run.prompt_tokens}/{run.completion_tokens}",
            str(run.tool_errors) if run.tool_errors else "",
        )
    return table


def _tree_json(nodes: list[StepNode]) -> list[dict[str, Any]]:
    return [{"step_id": node.step.step_id, "children": _tree_json(node.children)} for node in nodes]


@runs_app.command("show")
def show_command(
    run: Annotated[str, typer.Argument(help="Run id, or a unique prefix of it.")],
    full: Annotated[
        bool, typer.Option("--full", help="Do not shorten outputs, arguments and results.")
    ] = False,
    database: DatabaseOption = None,
    as_json: JsonOption = False,
) -> None:
    """Show one run as a tree of its steps, with tokens and timings."""
    from keel.tracing import render_run

    with _store(database) as store:
        run_id = store.resolve_run_id(run)
        detail = store.get_run_detail(run_id) if run_id else None
    if detail is None:
        raise UsageError(f"no run {run!r}; `keel runs list` shows the stored runs")
    if as_json:
        payload = detail.model_dump(mode="json")
        payload["tree"] = _tree_json(detail.tree())
        emit_json(payload)
        return
    _console().print(render_run(detail, width=1_000_000 if full else 120))


def _stats_table(stats: list[SessionStats]) -> Any:
    from rich.table import Table

    table = Table(box=None, header_style="bold")
    table.add_column("session")
    # The figures and their names are the viewer's (keel.tracing.call_figures defines them).
    for column in ("runs", "model calls", "tool calls", "retry rate", "avg prompt", "trend"):
        table.add_column(column, justify="right")
    for column in ("resets", "ttft p50", "ttft p95", "loops", "abandoned"):
        table.add_column(column, justify="right")
    for item in stats:
        trend = f"x{item.prompt_growth:.2f} {item.prompt_tokens_slope:+.0f}/call"
        table.add_row(
            item.session_id,
            str(item.runs),
            str(item.model_calls),
            str(item.tool_calls),
            f"{item.retry_rate:.0%}",
            f"{item.avg_prompt_tokens:.0f}",
            f"[yellow]{trend} ↑[/]" if item.prompt_creeping else trend,
            str(item.state_resets),
            format_ms(item.ttft_p50_ms),
            format_ms(item.ttft_p95_ms),
            str(item.loops_caught),
            f"[red]{item.abandoned_runs}[/]" if item.abandoned_runs else "0",
        )
    return table


@runs_app.command("stats")
def stats_command(
    session: Annotated[str | None, typer.Option("--session", help="Only this session.")] = None,
    since: SinceOption = None,
    tenant: Annotated[str | None, typer.Option("--tenant", help="Only this tenant.")] = None,
    max_retry_rate: Annotated[
        float, typer.Option("--max-retry-rate", min=0, help="Warn above this retry rate.")
    ] = 0.2,
    max_prompt_growth: Annotated[
        float,
        typer.Option(
            "--max-prompt-growth",
            min=0,
            help="Warn when prompts grow more than this factor while retries climb.",
        ),
    ] = 1.5,
    max_ttft_p95_ms: Annotated[
        float, typer.Option("--max-ttft-p95-ms", min=0, help="Warn above this p95 TTFT.")
    ] = 5000.0,
    max_state_resets: Annotated[
        int, typer.Option("--max-state-resets", min=0, help="Warn above this many resets.")
    ] = 0,
    max_loops: Annotated[
        int, typer.Option("--max-loops", min=0, help="Warn above this many loops caught.")
    ] = 0,
    database: DatabaseOption = None,
    as_json: JsonOption = False,
) -> None:
    """Death-spiral indicators per session: retries, prompt growth, resets, TTFT, loops."""
    from rich.markup import escape

    from keel.tracing import StatsThresholds, parse_since

    thresholds = StatsThresholds(
        max_retry_rate=max_retry_rate,
        max_prompt_growth=max_prompt_growth or 1e-9,
        max_ttft_p95_ms=max_ttft_p95_ms or 1e-9,
        max_state_resets=max_state_resets,
        max_loops=max_loops,
    )
    with _store(database) as store:
        stats = store.session_stats(
            session_id=session,
            since=parse_since(since) if since else None,
            tenant_id=tenant,
            thresholds=thresholds,
        )
    warnings = sum(len(item.warnings) for item in stats)
    if as_json:
        emit_json(
            {
                "sessions": [item.model_dump(mode="json") for item in stats],
                "thresholds": thresholds.model_dump(mode="json"),
                "warnings": warnings,
            }
        )
        return
    if not stats:
        _console().print("no traced steps match")
        return
    _console().print(_stats_table(stats))
    for item in stats:
        for warning in item.warnings:
            _console().print(f"[yellow]warning[/] {escape(item.session_id)}: {escape(warning)}")
    if not warnings:
        _console().print("[green]no indicator over its threshold[/]")


@runs_app.command("prune")
def prune_command(
    older_than: Annotated[
        str,
        typer.Option(
            "--older-than", help="Delete runs started before this: an age (30d) or ISO time."
        ),
    ],
    database: DatabaseOption = None,
    as_json: JsonOption = False,
) -> None:
    """Delete old runs and their steps (trace retention)."""
    from keel.tracing import parse_since

    cutoff = parse_since(older_than)
    with _store(database) as store:
        deleted = store.delete_runs(before=cutoff)
    if as_json:
        emit_json({"deleted_runs": deleted, "before": cutoff.isoformat()})
        return
    _console().print(f"deleted {deleted} run(s) started before {cutoff:%Y-%m-%d %H:%M:%S} UTC")


@bench_app.command("traces")
def bench_traces_command(
    runs: Annotated[int, typer.Option("--runs", min=1, help="Runs to write.")] = 200,
    steps: Annotated[int, typer.Option("--steps", min=1, help="Steps per run.")] = 20,
    sessions: Annotated[int, typer.Option("--sessions", min=1, help="Sessions.")] = 10,
    as_json: JsonOption = False,
) -> None:
    """What tracing costs per step on the embedded SQLite file, and query times."""
    from keel.bench.traces import run_trace_bench

    figures = run_trace_bench(runs=runs, steps=steps, sessions=sessions)
    if as_json:
        emit_json(figures)
        return
    console = _console()
    for key, value in figures.items():
        console.print(f"{key:>22}  {value}")
