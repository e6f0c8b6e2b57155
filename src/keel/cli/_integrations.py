"""``keel bench integrations``: keel inside other frameworks, next to their own parts."""

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


@bench_app.command("integrations")
def bench_integrations_command(
    turns: Annotated[
        int, typer.Option(min=0, help="Agents SDK turns on one session (0: skip that half).")
    ] = 1000,
    window: Annotated[int, typer.Option(min=1000, help="The model's window, in tokens.")] = 16_000,
    sdk_limit: Annotated[
        int, typer.Option(min=1, help="Items the SDK's SQLiteSession returns (its limit).")
    ] = 50,
    seed: Annotated[int, typer.Option(help="Seed of the tool outputs' sizes.")] = 7,
    langgraph_steps: Annotated[
        int,
        typer.Option(min=0, help="LangGraph graph invocations on one thread (0: skip that half)."),
    ] = 1000,
    conformance: Annotated[
        bool, typer.Option(help="Run LangGraph's conformance suite on SQLite and PostgreSQL.")
    ] = True,
    as_json: JsonLastOption = False,
) -> None:
    """LangGraph's ReAct agent on SqliteSaver and on keel's checkpointer (steps/s, bytes,
    conformance); the OpenAI Agents SDK's Runner on the SDK's SQLiteSession (with a limit) and
    on keel's session (orphaned tool items, window overflows, prompt tokens, counted from the
    inputs the model received)."""
    from keel.bench.integrations import run_integrations_bench

    report = run_integrations_bench(
        turns=turns,
        window=window,
        sdk_limit=sdk_limit,
        seed=seed,
        langgraph_steps=langgraph_steps,
        conformance=conformance,
        progress=err_console.print,
    )
    emit_or_show(report, as_json, _show)


def _show(report: dict[str, Any]) -> None:
    graph = report["langgraph"]
    if graph is not None:
        out_console.print(
            f"LangGraph, {graph['steps']} steps: keel {graph['keel_steps_per_s']} steps/s, "
            f"{graph['keel_bytes']:,} bytes; SqliteSaver {graph['sqlite_saver_steps_per_s']} "
            f"steps/s, {graph['sqlite_saver_bytes']:,} bytes ({graph['speedup']}x the speed, "
            f"1/{graph['bytes_ratio']} of the bytes); conformance {graph['conformance']}",
            markup=False,
        )
    figures = report["openai_agents"]
    if figures is None:
        return
    for name in ("keel", "sqlite_session"):
        row = figures[name]
        out_console.print(
            f"{name}: {row['orphans']} orphaned outputs in {row['calls_with_orphans']} calls, "
            f"{row['overflows']} overflows of {figures['prompt_limit']} tokens, prompt tokens "
            f"t100 {row['prompt_tokens_t100']} / last {row['prompt_tokens_t1000']}, "
            f"{row['turns_per_s']} turns/s",
            markup=False,
        )
