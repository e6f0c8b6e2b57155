"""``keel demo``: the flight-booking agent, killed inside a booking and resumed; exits 1 when a
trip is booked twice or not at all, or a question is asked again."""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from keel.cli._app import app, emit_json, err_console, out_console

if TYPE_CHECKING:
    from keel.demo._run import DemoReport


def _traces_hint(workdir: str, database: str | None, *, throwaway: bool) -> str:
    from keel._urls import redact_url

    if throwaway:
        return "dropped with the throwaway PostgreSQL (pass a postgresql:// URL to keep them)"
    url = database or f"sqlite:///{workdir}/keel.db"
    return f"keel runs list --database {redact_url(url)}"


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
    from keel.demo._run import run_demo, sparkline_chart

    with _progress(trips) as on_turn:
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
    # The summary is what was asked for (stdout); with --json the JSON object is, last.
    console = err_console if as_json else out_console
    console.print("\n[bold]Prompt tokens per turn[/]")
    console.print(
        sparkline_chart(report.prompt_tokens_per_turn, limit=report.prompt_budget),
        markup=False,
        highlight=False,
    )
    for label, value in _summary(report, database, throwaway=throwaway):
        console.print(f"  {label:<44} {value}", markup=False, highlight=False)
    if as_json:
        emit_json(report.model_dump(mode="json"))
    if not report.passed:
        raise typer.Exit(1)


OnTurn = Callable[[int, int, dict[str, Any]], None]


@contextlib.contextmanager
def _progress(trips: int) -> Iterator[OnTurn]:
    """Progress on stderr, whether stdout is a terminal, a pipe or --json: trips booked out of
    the trips planned (a known total; the turns a trip takes depend on the model). A bar on a
    terminal, else a line per trip booked and one for the kill and resume."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if not err_console.is_terminal:
        started = time.monotonic()
        said = {"booked": 0, "resumed": False}

        def report(turn: int, booked: int, reply: dict[str, Any]) -> None:
            if reply.get("resumed") and not said["resumed"]:
                said["resumed"] = True
                _line(
                    f"worker killed inside a booking; a new worker resumed the turn (turn {turn})"
                )
            if booked > said["booked"]:
                said["booked"] = booked
                _line(
                    f"{booked}/{trips} trips booked (turn {turn}, "
                    f"{time.monotonic() - started:.1f} s)"
                )

        yield report
        return
    columns = (TextColumn("[bold]demo[/] trips booked"), BarColumn(), MofNCompleteColumn())
    extra = (TextColumn("turn {task.fields[turn]} {task.fields[status]}"), TimeElapsedColumn())
    with Progress(*columns, *extra, console=err_console, transient=True) as bar:
        task = bar.add_task("trips", total=trips, turn=0, status="")

        def update(turn: int, booked: int, reply: dict[str, Any]) -> None:
            status = f"{reply.get('workflow_state') or ''}"
            if reply.get("resumed"):
                status += " (resumed after the kill)"
            bar.update(task, completed=booked, turn=turn, status=status)

        yield update


def _line(text: str) -> None:
    err_console.print(f"demo: {text}", markup=False, highlight=False)


def _summary(report: DemoReport, database: str | None, *, throwaway: bool) -> list[tuple[str, Any]]:
    loops = (
        f"{report.loops_caught} (expected: the scripted model retries a failing look-up the "
        "way a naive model does, and keel's loop guard stops it each time)"
        if report.model == "scripted"
        else f"{report.loops_caught} (the model repeated a failing call; keel's loop guard "
        "stopped it each time)"
    )
    lines: list[tuple[str, Any]] = [
        ("turns", report.turns),
        ("bookings made", f"{report.bookings} of {report.trips_planned} trips"),
        ("worker SIGKILLed inside a booking and resumed", report.resumed_after_kill),
        ("in-doubt bookings settled from airline records", report.in_doubt_settled),
        ("questions repeated after resume", report.repeated_questions_after_resume),
        ("double bookings", report.double_bookings),
        ("max prompt tokens / budget", f"{report.max_prompt_tokens:,} / {report.prompt_budget:,}"),
        ("loops caught", loops if report.loops_caught else 0),
        ("turns that failed", report.failed_turns),
    ]
    if report.memory_audit is not None:
        audit = report.memory_audit
        lines.append(("junk memories stored", f"{audit.junk} of {audit.stored}"))
    verdict = "passed" if report.passed else "FAILED: " + "; ".join(report.problems)
    return [
        *lines,
        ("time", f"{report.seconds:.1f} s"),
        ("database", report.database),
        ("traces", _traces_hint(report.workdir, database, throwaway=throwaway)),
        ("result", verdict),
    ]
