"""``keel bench state``: the durable-state benchmark."""

from __future__ import annotations

from typing import Annotated

import typer

from keel.cli._app import bench_app, emit_json, err_console, out_console


@bench_app.command("state")
def bench_state_command(
    steps: Annotated[int, typer.Option(help="Steps (one message and one checkpoint each).")] = 1000,
    writers: Annotated[int, typer.Option(help="Concurrent writers in the conflict phase.")] = 16,
    increments: Annotated[int, typer.Option(help="Increments per concurrent writer.")] = 5,
    backend: Annotated[
        list[str] | None,
        typer.Option("--backend", "-b", help="sqlite, postgres, redis (repeat; default all)."),
    ] = None,
    postgres_url: Annotated[
        str | None, typer.Option(help="PostgreSQL URL; default: start a local server.")
    ] = None,
    redis_url: Annotated[
        str | None, typer.Option(help="Redis URL; default: start a local redis-server.")
    ] = None,
    langgraph: Annotated[
        bool, typer.Option(help="Also run LangGraph's SqliteSaver on the same workload.")
    ] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object last.")] = False,
) -> None:
    """Checkpoints/s, read latency, bytes and lost updates per backend, versus LangGraph."""
    from keel.bench.state import run_state_bench
    from keel.errors import UsageError

    chosen = tuple(backend or ("sqlite", "postgres", "redis"))
    unknown = sorted(set(chosen) - {"sqlite", "postgres", "redis"})
    if unknown:
        raise UsageError(f"unknown backend(s) {', '.join(unknown)}: use sqlite, postgres, redis")
    if steps < 1 or writers < 1 or increments < 1:
        raise UsageError("steps, writers and increments must be >= 1")
    results = run_state_bench(
        steps=steps,
        writers=writers,
        increments=increments,
        backends=chosen,
        postgres_url=postgres_url,
        redis_url=redis_url,
        langgraph=langgraph,
        progress=lambda text: err_console.print(text),
    )
    if as_json:
        emit_json(results)
        return
    for name, figures in results["backends"].items():
        out_console.print(
            f"{name:<9} {figures['checkpoints_per_s']:>9.1f} checkpoints/s  "
            f"read p50 {figures['read_ms_p50']:.2f} ms  {figures['bytes_total']:>10} bytes  "
            f"conflicts {figures['conflicts_detected']}  lost updates {figures['lost_updates']}"
        )
    lang = results.get("langgraph_sqlite")
    if lang:
        out_console.print(
            f"{'langgraph':<9} {lang['checkpoints_per_s']:>9.1f} checkpoints/s  "
            f"read p50 {lang['read_ms_p50']:.2f} ms  {lang['bytes_total']:>10} bytes"
        )
