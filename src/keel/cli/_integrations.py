"""``keel bench integrations``: keel inside other frameworks, next to their own parts."""

from __future__ import annotations

from typing import Annotated

import typer

from keel.cli._app import bench_app, emit_json, err_console, out_console


@bench_app.command("integrations")
def bench_integrations_command(
    turns: Annotated[int, typer.Option(min=1, help="Turns on one session.")] = 1000,
    window: Annotated[int, typer.Option(min=1000, help="The model's window, in tokens.")] = 16_000,
    sdk_limit: Annotated[
        int, typer.Option(min=1, help="Items the SDK's SQLiteSession returns (its limit).")
    ] = 50,
    seed: Annotated[int, typer.Option(help="Seed of the tool outputs' sizes.")] = 7,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object last.")] = False,
) -> None:
    """The OpenAI Agents SDK's Runner on the SDK's SQLiteSession (with a limit) and on keel's
    session: orphaned tool items, window overflows, prompt tokens, counted from the inputs the
    model received."""
    from keel.bench.integrations import run_integrations_bench

    report = run_integrations_bench(
        turns=turns, window=window, sdk_limit=sdk_limit, seed=seed, progress=err_console.print
    )
    if as_json:
        emit_json(report)
        return
    figures = report["openai_agents"]
    for name in ("keel", "sqlite_session"):
        row = figures[name]
        out_console.print(
            f"{name}: {row['orphans']} orphaned outputs in {row['calls_with_orphans']} calls, "
            f"{row['overflows']} overflows of {figures['prompt_limit']} tokens, prompt tokens "
            f"t100 {row['prompt_tokens_t100']} / last {row['prompt_tokens_t1000']}, "
            f"{row['turns_per_s']} turns/s",
            markup=False,
        )
