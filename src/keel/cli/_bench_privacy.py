"""``keel bench privacy``: the PII vault's cost per tool call and per turn, and 0 placeholders
reaching tools."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from keel.cli._app import JsonLastOption, bench_app, emit_or_show, err_console, out_console


@bench_app.command("privacy")
def bench_privacy_command(
    turns: Annotated[int, typer.Option(min=1, help="Turns, each with --values PII values.")] = 1000,
    values: Annotated[int, typer.Option(min=1, help="PII values per turn.")] = 10,
    users: Annotated[int, typer.Option(min=1, help="Users the turns are spread over.")] = 100,
    flows: Annotated[
        int, typer.Option(min=1, help="Customer flows (email, phone, card, then tools).")
    ] = 50,
    forget_values: Annotated[
        int, typer.Option(min=1, help="Values of the user whose forget is timed.")
    ] = 10_000,
    rotation_users: Annotated[
        int, typer.Option(min=1, help="Users of the vault whose key rotation is killed.")
    ] = 3000,
    rotation_kills: Annotated[
        int, typer.Option(min=0, help="SIGKILLs of the rotation, at seeded points.")
    ] = 5,
    seed: Annotated[int, typer.Option(help="Seed of the values and their mix.")] = 36,
    as_json: JsonLastOption = False,
) -> None:
    """Resolution time per tool call (p50/p95), added time per turn (vault vs masking without
    it), vault rows and bytes per value, forget time, the tool calls that got a placeholder
    (0), the placeholders a prompt injection named that a tool got the values of (0), over
    seeded turns carrying every PII kind (embedded SQLite), and a key rotation SIGKILLed at
    seeded points after which every value must still resolve."""
    from keel.bench.privacy import run_privacy_bench

    report = run_privacy_bench(
        turns=turns,
        values_per_turn=values,
        users=users,
        flows=flows,
        forget_values=forget_values,
        rotation_users=rotation_users,
        rotation_kills=rotation_kills,
        seed=seed,
        progress=err_console.print,
    )
    emit_or_show(report, as_json, _show)


def _show(report: dict[str, Any]) -> None:
    out_console.print(
        f"seed {report['seed']}: resolve p50 {report['resolve_ms_p50']} ms, p95 "
        f"{report['resolve_ms_p95']} ms per tool call; turn added p50 "
        f"{report['turn_added_ms_p50']} ms; {report['vault_rows_per_value']} rows and "
        f"{report['vault_bytes_per_value']} bytes per value; forget of "
        f"{report['forget_values']} values {report['forget_seconds']} s; "
        f"{report['placeholders_reaching_tools']} of {report['flow_tool_calls']} tool calls "
        f"got a placeholder; {report['injected_placeholders_resolved']} of "
        f"{report['injected_placeholders']} injected placeholders resolved; "
        f"{report['rotation_kills_survived']} of "
        f"{report['rotation_kills']} key-rotation kills survived",
        markup=False,
    )
