"""``keel bench stream``: streaming latency against a real server, and its invariants."""

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


@bench_app.command("stream")
def bench_stream_command(
    latency_turns: Annotated[
        int, typer.Option(min=1, help="Prompts timed three ways (SDK, agent.stream, agent.run).")
    ] = 30,
    turns: Annotated[
        int, typer.Option(min=1, help="Streamed turns with random cancellations and cuts.")
    ] = 200,
    max_tokens: Annotated[int, typer.Option(min=4, help="Tokens per answer.")] = 24,
    seed: Annotated[int, typer.Option(help="Seed of the cancellations and cuts.")] = 7,
    as_json: JsonLastOption = False,
) -> None:
    """Time to first token (raw SDK vs agent.stream), keel's added latency, tokens/s, and 0
    invariant violations over streamed turns cut and cancelled at random (llama.cpp server)."""
    from keel.bench.stream import run_stream_bench

    report = run_stream_bench(
        latency_turns=latency_turns,
        chaos_turns=turns,
        max_tokens=max_tokens,
        seed=seed,
        progress=err_console.print,
    )
    emit_or_show(report, as_json, _show)


def _show(report: dict[str, Any]) -> None:
    ttft = report["ttft_ms_p50"]
    out_console.print(
        f"ttft p50: sdk {ttft['sdk']:.0f} ms, agent.stream {ttft['agent_stream']:.0f} ms "
        f"(added p50 {report['added_ttft_ms_p50']:.1f} ms, p95 {report['added_ttft_ms_p95']:.1f}"
        f" ms; unmasked added p50 {report['added_ttft_ms_unmasked_p50']:.1f} ms; against the "
        f"SDK masking the same way p50 {report['added_ttft_ms_vs_masked_sdk_p50']:.1f} ms); "
        f"{report['tokens_per_s']:.1f} tokens/s"
    )
    out_console.print(
        f"{report['turns']} streamed turns: {report['cancellations']} cancelled, "
        f"{report['cuts']} cut by the server, {report['violations']} invariant violations"
    )
