"""``keel demo``: the flight-booking agent, killed inside a booking and resumed; exits 1 when a
trip is booked twice or not at all, or a question is asked again."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from keel.cli._app import app, emit_json, err_console, out_console


def _traces_hint(workdir: str, database: str | None, *, throwaway: bool) -> str:
    from keel._urls import redact_url

    if throwaway:
        return "dropped with the throwaway PostgreSQL (pass a postgresql:// URL to keep them)"
    url = database or f"sqlite:///{workdir}/keel.db"
    return f"KEEL_DATABASE={redact_url(url)} keel runs list"


@app.command("demo")
def demo_command(
    model: Annotated[
        str,
        typer.Option(
            "--model",
            "-m",
            help="scripted (deterministic policy, default), local:smollm2, or a model spec "
            "(openai-compatible endpoints come from the settings).",
        ),
    ] = "scripted",
    trips: Annotated[int, typer.Option(min=1, help="Trips the customer books.")] = 20,
    side_questions: Annotated[
        int, typer.Option(min=0, help="Side questions per trip (long tool outputs).")
    ] = 10,
    kill: Annotated[
        bool, typer.Option(help="SIGKILL the worker inside a booking, then resume.")
    ] = True,
    memory: Annotated[bool, typer.Option(help="Give the agent long-term memory.")] = True,
    journal: Annotated[
        bool,
        typer.Option(
            help="Keep the durable tool journal; --no-journal is the control run, which must "
            "fail (the resumed turn books again)."
        ),
    ] = True,
    workdir: Annotated[
        Path | None, typer.Option(help="Keep the demo's database here (default: a temp dir).")
    ] = None,
    database: Annotated[
        str | None,
        typer.Option(
            "--database",
            help="The agent's database URL (sqlite:///PATH or postgresql://...; default: "
            "keel.db in the workdir), or 'postgres': a throwaway embedded PostgreSQL, with a "
            "throwaway Redis for state when redis-server is on PATH.",
        ),
    ] = None,
    redis_url: Annotated[
        str | None,
        typer.Option("--redis-url", help="Keep the agent's state on this Redis (redis://...)."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object last.")] = False,
) -> None:
    """Book trips over a long conversation, crash, resume, report (SQLite by default)."""
    with _servers(database, redis_url) as (database_url, redis):
        _demo(
            model,
            trips,
            side_questions,
            kill,
            memory,
            journal,
            workdir,
            database_url,
            redis,
            as_json,
            throwaway=database == "postgres",
        )


@contextlib.contextmanager
def _servers(
    database: str | None, redis_url: str | None
) -> Iterator[tuple[str | None, str | None]]:
    """``--database postgres``: a throwaway PostgreSQL (and Redis, if redis-server is on
    PATH and no --redis-url is given), stopped and deleted afterwards."""
    from keel._urls import parse_database_url

    if database != "postgres":
        if database is not None:  # ConfigError: one error line, exit code 2
            parse_database_url(database, kinds=("sqlite", "postgres"))
        if redis_url is not None:
            parse_database_url(redis_url, kinds=("redis",))
        yield database, redis_url
        return
    from keel.testing.servers import postgres_server, redis_server

    with contextlib.ExitStack() as stack:
        server = stack.enter_context(postgres_server())
        url = stack.enter_context(server.throwaway_database())
        if redis_url is None and shutil.which("redis-server"):
            redis_url = stack.enter_context(redis_server())
        yield url, redis_url


def _demo(
    model: str,
    trips: int,
    side_questions: int,
    kill: bool,
    memory: bool,
    journal: bool,
    workdir: Path | None,
    database: str | None,
    redis_url: str | None,
    as_json: bool,
    *,
    throwaway: bool,
) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from keel.demo._run import run_demo, sparkline_chart

    console = err_console if as_json else out_console
    with Progress(
        TextColumn("[bold]demo[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        console=console,
        transient=as_json,
    ) as progress:
        task = progress.add_task("turns", total=trips * (side_questions + 7), status="")

        def on_turn(turn: int, planned: int, reply: dict[str, Any]) -> None:
            status = (
                f"{reply.get('workflow_state') or ''} {'(resumed)' if reply.get('resumed') else ''}"
            )
            progress.update(task, completed=turn, total=max(planned, turn), status=status)

        report = run_demo(
            model=model,
            trips=trips,
            side_questions=side_questions,
            kill=kill,
            memory=memory,
            journal=journal,
            workdir=workdir,
            database=database,
            redis_url=redis_url,
            on_turn=on_turn,
        )
        progress.update(task, total=report.turns, completed=report.turns)
    console.print("\n[bold]Prompt tokens per turn[/]")
    console.print(
        sparkline_chart(report.prompt_tokens_per_turn, limit=report.prompt_budget),
        markup=False,
        highlight=False,
    )
    lines = [
        ("turns", report.turns),
        ("bookings made", f"{report.bookings} of {report.trips_planned} trips"),
        ("worker SIGKILLed inside a booking and resumed", report.resumed_after_kill),
        ("in-doubt bookings settled from airline records", report.in_doubt_settled),
        ("questions repeated after resume", report.repeated_questions_after_resume),
        ("double bookings", report.double_bookings),
        ("max prompt tokens / budget", f"{report.max_prompt_tokens:,} / {report.prompt_budget:,}"),
        ("loops caught", report.loops_caught),
        ("turns that failed", report.failed_turns),
    ]
    if report.memory_audit is not None:
        audit = report.memory_audit
        lines.append(("junk memories stored", f"{audit.junk} of {audit.stored}"))
    lines += [
        ("time", f"{report.seconds:.1f} s"),
        ("database", report.database),
        ("traces", _traces_hint(report.workdir, database, throwaway=throwaway)),
    ]
    for label, value in lines:
        console.print(f"  {label:<44} {value}", markup=False, highlight=False)
    verdict = "passed" if report.passed else "FAILED: " + "; ".join(report.problems)
    console.print(f"  {'result':<44} {verdict}", markup=False, highlight=False)
    if as_json:
        emit_json(report.model_dump(mode="json"))
    if not report.passed:
        raise typer.Exit(1)
