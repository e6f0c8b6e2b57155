"""``keel bench turns``: the runtime's own cost per turn over one long session."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from keel.cli._app import (
    JsonLastOption,
    bench_app,
    emit_or_show,
    err_console,
    out_console,
)


@bench_app.command("turns")
def bench_turns_command(
    turns: Annotated[int, typer.Option(help="Turns in the session.")] = 1000,
    bucket: Annotated[int, typer.Option(help="Turns per reported bucket.")] = 100,
    memory: Annotated[bool, typer.Option(help="Also run with long-term memory on.")] = True,
    langgraph: Annotated[
        bool, typer.Option(help="Also run LangGraph's ReAct agent + SqliteSaver.")
    ] = True,
    database: Annotated[
        str,
        typer.Option(
            help="'sqlite' (one file, the embedded default) or 'postgres' (a throwaway "
            "embedded PostgreSQL holding state, journal, traces and memory)."
        ),
    ] = "sqlite",
    repeat: Annotated[
        int,
        typer.Option(
            help="Sessions of keel (memory off) to run, each on a fresh database; per bucket "
            "the median of their medians is reported, and each run's flatness."
        ),
    ] = 1,
    memory_history: Annotated[
        int,
        typer.Option(
            help="Also run memory on for a user whose earlier session of this many turns "
            "memory already holds (memory_with_history); the figures above are unchanged."
        ),
    ] = 0,
    as_json: JsonLastOption = False,
) -> None:
    """Per-turn cost (median, p95 per bucket), flatness, turns/s and bytes, versus LangGraph."""
    from keel.bench.turns import run_turns_bench
    from keel.errors import UsageError

    if turns < 1 or bucket < 1 or repeat < 1:
        raise UsageError("turns, bucket and repeat must be >= 1")
    if memory_history < 0:
        raise UsageError("--memory-history must be >= 0")
    if database not in ("sqlite", "postgres"):
        raise UsageError(f"--database must be 'sqlite' or 'postgres', not {database!r}")
    result = run_turns_bench(
        turns=turns,
        bucket=bucket,
        memory=memory,
        langgraph=langgraph,
        database=database,
        repeat=repeat,
        memory_history=memory_history if memory else 0,
        progress=err_console.print,
    )
    emit_or_show(result, as_json, _show)


def _show(result: dict[str, Any]) -> None:
    rows = [("keel", result)]
    if "memory_on" in result:
        rows.append(("keel+memory", result["memory_on"]))
    if "memory_with_history" in result:
        rows.append(("+history", result["memory_with_history"]))
    if "langgraph" in result:
        rows.append(("langgraph", result["langgraph"]))
    for name, figures in rows:
        out_console.print(
            f"{name:<12} p50 {figures['p50_ms']:>7.2f} ms  p95 {figures['p95_ms']:>7.2f} ms  "
            f"flatness {figures['flatness']}  {figures['turns_per_s']:>7.1f} turns/s  "
            f"{figures['db_bytes']:>11} bytes"
        )
        out_console.print(f"{'':<12} p50 per {result['bucket']} turns: {figures['buckets_ms_p50']}")
