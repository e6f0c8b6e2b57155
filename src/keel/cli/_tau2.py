"""``keel bench tau2``: τ²-bench's retail domain through keel, clean and under faults."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from keel.cli._app import JsonLastOption, bench_app, emit_or_show, err_console, out_console

_MODES = "clean,kill,timeout,duplicate"


@bench_app.command("tau2")
def bench_tau2_command(
    split: Annotated[str, typer.Option("--split", help="train, test or all.")] = "train",
    domain: Annotated[str, typer.Option("--domain", help="The τ² domain.")] = "retail",
    mode: Annotated[
        str, typer.Option("--mode", help=f"Modes, comma-separated, of {_MODES}.")
    ] = _MODES,
    tasks: Annotated[
        int | None, typer.Option("--tasks", min=1, help="Only the split's first N tasks.")
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the kill points.")] = 0,
    as_json: JsonLastOption = False,
) -> None:
    """Run τ²-bench tasks through a keel Agent (a grounded oracle as its model, the τ² MCP
    server's tools) and score each as τ² does; count doubled and missing writes and
    placeholders that reached a tool, from the server's own call log."""
    from keel.bench.tau2 import TaskOutcome, run_tau2_bench

    def progress(mode_name: str, outcome: TaskOutcome) -> None:
        mark = "ok" if outcome.db_match and not outcome.error else "MISS"
        fault = f" ({outcome.fault})" if outcome.fault else ""
        err_console.print(f"{mode_name} task {outcome.task}{fault}: {mark}")

    report = run_tau2_bench(
        domain=domain,
        split=split,
        modes=[m.strip() for m in mode.split(",") if m.strip()],
        tasks=tasks,
        seed=seed,
        progress=progress,
    )
    emit_or_show(report, as_json, _show)


def _show(report: dict[str, Any]) -> None:
    out_console.print(f"τ² {report['domain']}, {report['split']} split (seed {report['seed']})")
    for name, row in report["modes"].items():
        out_console.print(
            f"  {name:<10} {row['db_match']}/{row['tasks']} db match, "
            f"{row['doubled_writes']} doubled, {row['missing_writes']} missing, "
            f"{row['placeholder_args']} placeholder args, {row['seconds']} s"
        )
    for failure in report["failures"]:
        out_console.print(f"  [red]miss[/] {failure['mode']} task {failure['task']}", markup=True)
