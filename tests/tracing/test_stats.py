from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

from keel.tracing import StatsThresholds, StepMetric, call_figures, percentile, session_stats

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _metric(
    index: int,
    prompt: int,
    *,
    kind: str = "model",
    session: str = "s",
    attempt: int = 1,
    failed: bool = False,
) -> StepMetric:
    return StepMetric(
        session_id=session,
        run_id=f"r{index // 5}",
        kind=kind,
        name=kind,
        started_at=T0 + timedelta(seconds=index),
        attempt=attempt,
        prompt_tokens=prompt,
        ttft_ms=None,
        failed=failed,
    )


def test_percentile_interpolates() -> None:
    assert percentile([], 50) is None
    assert percentile([7.0], 95) == 7.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([4.0, 1.0, 3.0, 2.0], 100) == 4.0


def test_prompt_trend_needs_enough_calls_and_respects_thresholds() -> None:
    short = session_stats([_metric(0, 100), _metric(1, 900)], StatsThresholds())
    assert short[0].prompt_growth == 1.0 and not short[0].prompt_creeping
    growing = [_metric(i, 1000 + 100 * i, attempt=2 if i == 8 else 1) for i in range(10)]
    (default,) = session_stats(growing, StatsThresholds())
    assert not default.prompt_creeping and 1.3 < default.prompt_growth < 1.5
    (strict,) = session_stats(growing, StatsThresholds(max_prompt_growth=1.2))
    assert strict.prompt_creeping and any("creeping" in w for w in strict.warnings)
    assert strict.prompt_tokens_slope == 100


def test_a_window_filling_without_retries_is_not_creeping() -> None:
    """Every fresh session grows its prompt from nothing to the window: not a death spiral."""
    filling = [_metric(i, 300 + 400 * i) for i in range(12)]
    (stats,) = session_stats(filling, StatsThresholds())
    assert stats.prompt_growth > 2 and not stats.prompt_creeping and stats.warnings == ()
    # The same growth with retries piling up in the later calls is.
    failing = [_metric(i, 300 + 400 * i, attempt=2 if i >= 8 else 1) for i in range(12)]
    (spiral,) = session_stats(failing, StatsThresholds(max_retry_rate=1.0))
    assert spiral.prompt_creeping and any("while retries climb" in w for w in spiral.warnings)


def test_sessions_are_separate_and_output_is_json_safe() -> None:
    metrics = [_metric(i, 0 if i < 3 else 500, session="a") for i in range(6)]
    metrics += [_metric(i, 10, session="b", kind="tool") for i in range(3)]
    stats = session_stats(reversed(metrics), StatsThresholds())
    assert [s.session_id for s in stats] == ["a", "b"]
    a, b = stats
    assert a.prompt_growth == 500.0  # an empty early half counts as one token, never infinity
    assert b.model_calls == 0 and b.tool_calls == 3 and b.avg_prompt_tokens == 0.0
    assert a.first_at == T0 and a.last_at == T0 + timedelta(seconds=5)
    json.loads(json.dumps([s.model_dump(mode="json") for s in stats], allow_nan=False))


def test_failed_calls_that_were_not_retried_are_no_retries_climbing() -> None:
    """No "while retries climb" next to a retry rate of 0%: climbing counts retries as the
    retry rate does."""
    failing = [_metric(i, 300 + 400 * i, failed=i >= 8) for i in range(12)]
    (stats,) = session_stats(failing, StatsThresholds())
    assert stats.retry_rate == 0.0 and stats.prompt_growth > 2
    assert not stats.prompt_creeping and stats.warnings == ()


def test_the_viewer_charts_the_figures_keel_runs_stats_reports() -> None:
    from keel.ui._render import indicator_series

    metrics = [_metric(i, 100 * i, attempt=2 if i % 3 == 0 else 1) for i in range(9)]
    metrics += [_metric(9 + i, 0, kind="tool", attempt=2 if i == 0 else 1) for i in range(4)]
    metrics += [_metric(13, 0, kind="reset")]
    (stats,) = session_stats(metrics, StatsThresholds())
    figures = call_figures(metrics)
    assert (stats.model_calls, stats.tool_calls, stats.retries) == (9, 4, 4)
    assert (figures.model_calls, figures.tool_calls, figures.retries) == (9, 4, 4)
    charted = {series.name: series.points for series in indicator_series(metrics, buckets=1)}
    assert charted["retry rate"][0][1] == stats.retry_rate == 4 / 13
    assert charted["prompt tokens per call"][0][1] == stats.avg_prompt_tokens == 400
    assert charted["machine resets"][0][1] == stats.state_resets == 1
