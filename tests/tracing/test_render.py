from __future__ import annotations

from datetime import UTC, datetime, timedelta

from rich.console import Console

from keel.tracing import Run, RunDetail, Step, render_run
from keel.tracing._render import format_ms

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_render_run_draws_nested_steps_with_tokens_and_errors() -> None:
    run = Run(
        run_id="r1",
        session_id="s1",
        status="failed",
        started_at=T0,
        ended_at=T0 + timedelta(seconds=2),
        error_type="ToolExecutionError",
        error_message="down [red]",
    )
    steps = (
        Step(
            run_id="r1",
            step_id="m",
            seq=0,
            kind="model",
            name="gpt",
            started_at=T0,
            prompt_tokens=1200,
            completion_tokens=30,
            latency_ms=850.0,
            ttft_ms=120.0,
        ),
        Step(
            run_id="r1",
            step_id="t",
            parent_id="m",
            seq=1,
            kind="tool",
            name="pay",
            started_at=T0,
            tool_arguments='{"amount": 3}',
            tool_result="x" * 500,
            error_type="ToolExecutionError",
            error_message="down [red]",
            attempt=2,
        ),
    )
    console = Console(record=True, width=200)
    console.print(render_run(RunDetail(run=run, steps=steps), width=40))
    text = console.export_text()
    assert "run r1" in text and "failed" in text and "2000 ms" in text
    assert "1200→30 tok" in text and "ttft 120 ms" in text and "850 ms" in text
    assert "└── tool pay" in text and "attempt 2" in text
    assert "down [red]" in text  # markup in data is escaped, not interpreted
    assert "result (500 chars)" in text and "x" * 40 not in text


def test_format_ms() -> None:
    assert [format_ms(v) for v in (None, 0.42, 85.2, 12_345.0)] == [
        "-",
        "0.4 ms",
        "85 ms",
        "12.3 s",
    ]
