"""Death-spiral indicators computed from stored step metrics (shared by every backend)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from keel.tracing._models import SessionStats, StatsThresholds, StepMetric

__all__ = ["CallFigures", "call_figures", "percentile", "session_stats"]

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


@dataclass(frozen=True)
class CallFigures:
    """The figures of a set of steps, defined once for ``keel runs stats``, the viewer's
    health page and its charts: a model call is a step of kind ``model``, a tool call one of
    kind ``tool``, a retry a model or tool call on its second or later attempt."""

    model_calls: int
    tool_calls: int
    retries: int
    state_resets: int
    loops_caught: int
    prompt_tokens: tuple[float, ...]
    """Prompt tokens of each model call, in the order given."""
    ttfts_ms: tuple[float, ...]
    """Measured times to first token of the model calls."""

    @property
    def calls(self) -> int:
        """Model and tool calls: what the retry rate is a share of."""
        return self.model_calls + self.tool_calls

    @property
    def retry_rate(self) -> float:
        """Retries over calls (0 without calls)."""
        return self.retries / self.calls if self.calls else 0.0

    @property
    def avg_prompt_tokens(self) -> float:
        """Prompt tokens per model call (0 without model calls)."""
        return sum(self.prompt_tokens) / len(self.prompt_tokens) if self.prompt_tokens else 0.0


def is_retry(metric: StepMetric) -> bool:
    """A model or tool call on its second or later attempt."""
    return metric.kind in ("model", "tool") and metric.attempt > 1


def call_figures(metrics: Iterable[StepMetric]) -> CallFigures:
    """The figures of ``metrics`` (see [`CallFigures`][])."""
    rows = list(metrics)
    model = [m for m in rows if m.kind == "model"]
    return CallFigures(
        model_calls=len(model),
        tool_calls=sum(1 for m in rows if m.kind == "tool"),
        retries=sum(1 for m in rows if is_retry(m)),
        state_resets=sum(1 for m in rows if m.kind == "reset"),
        loops_caught=sum(1 for m in rows if m.kind == "guard" and m.name == LOOP_GUARD_NAME),
        prompt_tokens=tuple(float(m.prompt_tokens) for m in model),
        ttfts_ms=tuple(m.ttft_ms for m in model if m.ttft_ms is not None),
    )


def _retries_by_half(model: Sequence[StepMetric]) -> tuple[int, int]:
    """Retried model calls in the earlier and in the later half of ``model``."""
    half = len(model) // 2
    if half == 0:
        return 0, 0
    return sum(map(is_retry, model[:half])), sum(map(is_retry, model[-half:]))


def _one(
    session_id: str, metrics: list[StepMetric], limits: StatsThresholds, abandoned: int = 0
) -> SessionStats:
    figures = call_figures(metrics)
    model = [m for m in metrics if m.kind == "model"]
    prompts = figures.prompt_tokens
    growth = _growth(prompts) if len(prompts) >= limits.min_calls_for_trend else 1.0
    # A session's prompts grow while its window fills; that alone is not a spiral. Growth
    # counts when it comes with retries climbing: more retried model calls in the later half
    # of the calls than in the earlier half (retries as the retry rate counts them).
    earlier, later = _retries_by_half(model)
    creeping = growth > limits.max_prompt_growth and later > earlier
    p50 = percentile(figures.ttfts_ms, 50)
    p95 = percentile(figures.ttfts_ms, 95)
    warnings: list[str] = []
    if figures.retry_rate > limits.max_retry_rate:
        warnings.append(
            f"retry rate {figures.retry_rate:.0%} is over {limits.max_retry_rate:.0%} "
            f"({figures.retries} of {figures.calls} calls)"
        )
    if creeping:
        warnings.append(
            f"prompt tokens per call are creeping up: x{growth:.2f} from the earlier to the "
            f"later half of {len(prompts)} calls (threshold x{limits.max_prompt_growth:.2f}) "
            f"while retries climb ({earlier} retried model calls in the earlier half, "
            f"{later} in the later)"
        )
    warnings += _threshold_warnings(figures, p95, abandoned, limits)
    return SessionStats(
        session_id=session_id,
        runs=len({m.run_id for m in metrics}),
        abandoned_runs=abandoned,
        steps=len(metrics),
        model_calls=figures.model_calls,
        tool_calls=figures.tool_calls,
        tool_errors=sum(1 for m in metrics if m.kind == "tool" and m.failed),
        retries=figures.retries,
        retry_rate=figures.retry_rate,
        avg_prompt_tokens=figures.avg_prompt_tokens,
        prompt_tokens_slope=_slope(prompts),
        prompt_growth=growth,
        prompt_creeping=creeping,
        state_resets=figures.state_resets,
        ttft_p50_ms=p50,
        ttft_p95_ms=p95,
        loops_caught=figures.loops_caught,
        first_at=metrics[0].started_at if metrics else None,
        last_at=metrics[-1].started_at if metrics else None,
        warnings=tuple(warnings),
    )


def _threshold_warnings(
    figures: CallFigures, p95: float | None, abandoned: int, limits: StatsThresholds
) -> list[str]:
    warnings = []
    if figures.state_resets > limits.max_state_resets:
        warnings.append(
            f"{figures.state_resets} state resets (threshold {limits.max_state_resets})"
        )
    if p95 is not None and p95 > limits.max_ttft_p95_ms:
        warnings.append(
            f"time to first token p95 {p95:.0f} ms is over {limits.max_ttft_p95_ms:.0f} ms"
        )
    if figures.loops_caught > limits.max_loops:
        warnings.append(f"{figures.loops_caught} loops caught (threshold {limits.max_loops})")
    if abandoned > limits.max_abandoned_runs:
        warnings.append(
            f"{abandoned} run(s) abandoned: their worker died mid-run "
            "(keel runs list --status abandoned)"
        )
    return warnings


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
