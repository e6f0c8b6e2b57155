"""``keel bench faults``: the tool loop against thousands of seeded faulty runs."""

from __future__ import annotations

from typing import Annotated

import typer

from keel.cli._app import bench_app, emit_json, out_console


@bench_app.command("faults")
def bench_faults_command(
    runs: Annotated[int, typer.Option("--runs", min=1, help="Randomized faulty runs.")] = 1000,
    seed: Annotated[int, typer.Option("--seed", help="Seed; the same seed, the same runs.")] = 0,
    kills: Annotated[
        int,
        typer.Option(
            "--kills", min=0, help="How many of the runs are a subprocess SIGKILLed mid-call."
        ),
    ] = 4,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Run seeded faulty runs through the tool loop and count what went wrong."""
    from keel.bench.faults import run_fault_bench

    report = run_fault_bench(runs, seed=seed, kills=kills)
    payload = report.model_dump()
    if as_json:
        emit_json(payload)
        return
    out_console.print(f"{report.runs} runs in {report.seconds:.1f} s (seed {seed})")
    for name in (
        "unhandled_exceptions",
        "ended_within_limits",
        "loops_detected",
        "repairs",
        "double_executions",
        "state_reverted_on_limit",
        "limit_hits",
        "resumed_after_crash",
        "killed_subprocesses",
        "idempotent_reruns",
    ):
        out_console.print(f"  {name:<24} {payload[name]}")
    out_console.print("by fault:")
    for fault, row in report.by_fault.items():
        detail = ", ".join(f"{status} {count}" for status, count in row.items() if status != "runs")
        out_console.print(f"  {fault:<22} {row['runs']:>4} runs: {detail}")
    for failure in report.failures:
        out_console.print(f"  [red]failure[/] {failure}", markup=True)
