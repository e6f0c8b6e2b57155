"""Death-spiral indicators computed from stored step metrics (shared by every backend)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from keel.tracing._models import SessionStats, StatsThresholds, StepMetric

__all__ = ["percentile", "session_stats"]

LOOP_GUARD_NAME = "loop"
"""Name of the guard step that records a loop caught."""


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` percentile (0-100) of ``values`` by linear interpolation; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    if len(ordered) == 1:
        return float(ordered[0])
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = math.ceil(position)
    fraction = position - low
    return float(ordered[low] + (ordered[high] - ordered[low]) * fraction)


def _slope(values: Sequence[float]) -> float:
    n = len(values)
    if n < 2:
        return 0.0
    mean_x = (n - 1) / 2
    mean_y = sum(values) / n
    num = sum((index - mean_x) * (value - mean_y) for index, value in enumerate(values))
    den = sum((index - mean_x) ** 2 for index in range(n))
    return num / den


def _growth(values: Sequence[float]) -> float:
    half = len(values) // 2
    if half == 0:
        return 1.0
    early = sum(values[:half]) / half
    late = sum(values[-half:]) / half
    # An empty early half would make the ratio infinite (and not JSON); one token stands in.
    return late / max(early, 1.0)


def _retries_climbing(model: Sequence[StepMetric]) -> bool:
    half = len(model) // 2
    if half == 0:
        return False

    def troubled(steps: Sequence[StepMetric]) -> int:
        return sum(1 for m in steps if m.attempt > 1 or m.failed)

    return troubled(model[-half:]) > troubled(model[:half])


def _one(
    session_id: str, metrics: list[StepMetric], limits: StatsThresholds, abandoned: int = 0
) -> SessionStats:
    model = [m for m in metrics if m.kind == "model"]
    tools = [m for m in metrics if m.kind == "tool"]
    calls = len(model) + len(tools)
    retries = sum(1 for m in (*model, *tools) if m.attempt > 1)
    prompts = [float(m.prompt_tokens) for m in model]
    ttfts = [m.ttft_ms for m in model if m.ttft_ms is not None]
    resets = sum(1 for m in metrics if m.kind == "reset")
    loops = sum(1 for m in metrics if m.kind == "guard" and m.name == LOOP_GUARD_NAME)
    retry_rate = retries / calls if calls else 0.0
    growth = _growth(prompts) if len(prompts) >= limits.min_calls_for_trend else 1.0
    # A session's prompts grow while its window fills; that alone is not a spiral. Growth
    # counts when it comes with retries climbing: more retried or failed model calls in the
    # later half of the calls than in the earlier half (see keel.guards' SpiralMonitor).
    creeping = growth > limits.max_prompt_growth and _retries_climbing(model)
    p50 = percentile(ttfts, 50)
    p95 = percentile(ttfts, 95)
    warnings: list[str] = []
    if retry_rate > limits.max_retry_rate:
        warnings.append(
            f"retry rate {retry_rate:.0%} is over {limits.max_retry_rate:.0%} "
            f"({retries} of {calls} calls)"
        )
    if creeping:
        warnings.append(
            f"prompt tokens per call are creeping up: x{growth:.2f} from the earlier to the "
            f"later half of {len(prompts)} calls (threshold x{limits.max_prompt_growth:.2f}) "
            "while retries climb"
        )
    if resets > limits.max_state_resets:
        warnings.append(f"{resets} state resets (threshold {limits.max_state_resets})")
    if p95 is not None and p95 > limits.max_ttft_p95_ms:
        warnings.append(
            f"time to first token p95 {p95:.0f} ms is over {limits.max_ttft_p95_ms:.0f} ms"
        )
    if loops > limits.max_loops:
        warnings.append(f"{loops} loops caught (threshold {limits.max_loops})")
    if abandoned > limits.max_abandoned_runs:
        warnings.append(
            f"{abandoned} run(s) abandoned: their worker died mid-run "
            "(keel runs list --status abandoned)"
        )
    return SessionStats(
        session_id=session_id,
        runs=len({m.run_id for m in metrics}),
        abandoned_runs=abandoned,
        steps=len(metrics),
        model_calls=len(model),
        tool_calls=len(tools),
        tool_errors=sum(1 for m in tools if m.failed),
        retries=retries,
        retry_rate=retry_rate,
        avg_prompt_tokens=sum(prompts) / len(prompts) if prompts else 0.0,
        prompt_tokens_slope=_slope(prompts),
        prompt_growth=growth,
        prompt_creeping=creeping,
        state_resets=resets,
        ttft_p50_ms=p50,
        ttft_p95_ms=p95,
        loops_caught=loops,
        first_at=metrics[0].started_at if metrics else None,
        last_at=metrics[-1].started_at if metrics else None,
        warnings=tuple(warnings),
    )


def session_stats(
    metrics: Iterable[StepMetric],
    thresholds: StatsThresholds,
    abandoned: Mapping[str, int] | None = None,
) -> list[SessionStats]:
    """Indicators per session from ``metrics`` (any order), sessions sorted by id.

    ``abandoned`` counts the abandoned runs per session; a session with abandoned runs and no
    steps (killed before its first step was written) still gets an entry.
    """
    by_session: dict[str, list[StepMetric]] = defaultdict(list)
    for metric in metrics:
        by_session[metric.session_id].append(metric)
    killed = dict(abandoned or {})
    result = []
    for session_id in sorted(by_session.keys() | killed.keys()):
        rows = sorted(by_session.get(session_id, []), key=lambda m: (m.started_at, m.run_id))
        result.append(_one(session_id, rows, thresholds, killed.get(session_id, 0)))
    return result
