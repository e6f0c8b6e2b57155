"""``keel demo``: the flight-booking agent, killed inside a booking and resumed; exits 1 when a
trip is booked twice or not at all, or a question is asked again."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from keel.cli._app import app, emit_json, err_console, out_console


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
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object last.")] = False,
) -> None:
    """Book trips over a long conversation on the embedded default, crash, resume, report."""
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
        ("time", f"{report.seconds:.1f} s"),
        ("traces", f"KEEL_DATABASE=sqlite:///{report.workdir}/keel.db keel runs list"),
    ]
    for label, value in lines:
        console.print(f"  {label:<44} {value}", markup=False, highlight=False)
    verdict = "passed" if report.passed else "FAILED: " + "; ".join(report.problems)
    console.print(f"  {'result':<44} {verdict}", markup=False, highlight=False)
    if as_json:
        emit_json(report.model_dump(mode="json"))
    if not report.passed:
        raise typer.Exit(1)
