"""What the pages draw, computed on the server: token bars, the workflow graph, state diffs and
indicator charts, as plain data and inline SVG (no script, no CDN, readable without JS)."""

from __future__ import annotations

import difflib
import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from html import escape
from typing import Any

from keel.tracing import StepMetric, call_figures

__all__ = [
    "SECTIONS",
    "Bar",
    "Series",
    "indicator_series",
    "line_chart",
    "machine_graph",
    "state_diff",
    "token_bar",
]

SECTIONS = ("system", "summary", "memories", "turns", "rules", "tools", "reply_priming")
"""The prompt's sections, in the order the stacked bar draws them; the reserve comes last."""


@dataclass(frozen=True)
class Bar:
    """One segment of a step's token bar."""

    section: str
    tokens: int
    percent: float


def token_bar(budget: dict[str, Any] | None) -> list[Bar]:
    """A model step's prompt tokens per section, then the reserve, as shares of the window."""
    if not budget:
        return []
    sections = budget.get("sections") or {}
    window = int(budget.get("effective_window") or budget.get("window") or 0)
    if window <= 0:
        return []
    bars = [
        Bar(name, int(sections.get(name, 0)), 100 * int(sections.get(name, 0)) / window)
        for name in SECTIONS
        if int(sections.get(name, 0)) > 0
    ]
    reserve = int(budget.get("reserve") or 0)
    if reserve:
        bars.append(Bar("reserve", reserve, 100 * reserve / window))
    return bars


def state_diff(older: Any, newer: Any, older_label: str, newer_label: str) -> list[str]:
    """A unified diff of two states' JSON (keys sorted, indented): one line per entry."""

    def lines(value: Any) -> list[str]:
        return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False).splitlines()

    return list(
        difflib.unified_diff(lines(older), lines(newer), older_label, newer_label, n=2, lineterm="")
    )


def machine_graph(
    states: Sequence[str],
    edges: Sequence[tuple[str, str, str]],
    initial: str,
    path: Sequence[str],
    current: str | None,
) -> str:
    """The workflow as an SVG: states in columns by their distance from ``initial``, every
    allowed move an arrow, the moves the session took drawn bold, its state filled."""
    depth = {initial: 0}
    frontier = [initial]
    while frontier:
        following = []
        for state in frontier:
            for source, target, _ in edges:
                if source == state and target not in depth:
                    depth[target] = depth[state] + 1
                    following.append(target)
        frontier = following
    unreachable = max(depth.values(), default=0) + 1
    columns: dict[int, list[str]] = {}
    for state in states:
        columns.setdefault(depth.get(state, unreachable), []).append(state)
    width, height, gap_x, gap_y = 150, 34, 60, 22
    position: dict[str, tuple[int, int]] = {}
    for column, members in sorted(columns.items()):
        for row, state in enumerate(members):
            position[state] = (20 + column * (width + gap_x), 20 + row * (height + gap_y))
    taken = set(itertools.pairwise(path))
    total_w = max((x for x, _ in position.values()), default=0) + width + 20
    total_h = max((y for _, y in position.values()), default=0) + height + 20
    parts = [
        f'<svg class="graph" role="img" viewBox="0 0 {total_w} {total_h}" '
        f'width="{total_w}" height="{total_h}" aria-label="workflow graph">',
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
        'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z"/></marker>'
        "</defs>",
    ]
    for source, target, label in edges:
        if source not in position or target not in position:
            continue
        (x1, y1), (x2, y2) = position[source], position[target]
        start = (x1 + width, y1 + height // 2) if x2 > x1 else (x1 + width // 2, y1 + height)
        end = (x2, y2 + height // 2) if x2 > x1 else (x2 + width // 2, y2)
        if source == target:
            continue
        css = "edge taken" if (source, target) in taken else "edge"
        parts.append(
            f'<line class="{css}" x1="{start[0]}" y1="{start[1]}" x2="{end[0]}" y2="{end[1]}" '
            f'marker-end="url(#arrow)"><title>{escape(label)}</title></line>'
        )
    visited = set(path)
    for state, (x, y) in position.items():
        css = "node current" if state == current else "node visited" if state in visited else "node"
        parts.append(
            f'<g class="{css}"><rect x="{x}" y="{y}" width="{width}" height="{height}" rx="6"/>'
            f'<text x="{x + width // 2}" y="{y + height // 2 + 5}" text-anchor="middle">'
            f"{escape(state)}</text></g>"
        )
    parts.append("</svg>")
    return "".join(parts)


@dataclass(frozen=True)
class Series:
    """One indicator over time: (bucket start, value) points."""

    name: str
    unit: str
    points: tuple[tuple[datetime, float], ...]


def indicator_series(metrics: Sequence[StepMetric], buckets: int = 24) -> list[Series]:
    """The death-spiral indicators over time, from the steps' metrics, in ``buckets`` equal
    time slices: retry rate, prompt tokens per model call, state resets, time to first token."""
    if not metrics:
        return []
    first, last = metrics[0].started_at, metrics[-1].started_at
    span = max((last - first).total_seconds(), 1.0)
    slices: list[list[StepMetric]] = [[] for _ in range(buckets)]
    for metric in metrics:
        index = min(buckets - 1, int((metric.started_at - first).total_seconds() / span * buckets))
        slices[index].append(metric)
    retry, tokens, resets, ttft = [], [], [], []
    for part in slices:
        if not part:
            continue
        at = part[0].started_at
        # The figures as keel runs stats defines them (one definition, in keel.tracing).
        figures = call_figures(part)
        if figures.calls:
            retry.append((at, figures.retry_rate))
        if figures.model_calls:
            tokens.append((at, figures.avg_prompt_tokens))
        resets.append((at, float(figures.state_resets)))
        if figures.ttfts_ms:
            ttft.append((at, sum(figures.ttfts_ms) / len(figures.ttfts_ms)))
    return [
        Series("retry rate", "share of calls", tuple(retry)),
        Series("prompt tokens per call", "tokens", tuple(tokens)),
        Series("machine resets", "resets", tuple(resets)),
        Series("time to first token", "ms", tuple(ttft)),
    ]


def line_chart(series: Series, width: int = 560, height: int = 160) -> str:
    """One series as an SVG line chart with its axis range and a point per time slice."""
    if not series.points:
        return '<p class="empty">no data</p>'
    values = [value for _, value in series.points]
    low, high = min(0.0, min(values)), max(values)
    high = high if high > low else low + 1
    pad = 28
    count = len(series.points)

    def xy(index: int, value: float) -> tuple[float, float]:
        x = pad + (width - 2 * pad) * (index / max(count - 1, 1))
        y = height - pad - (height - 2 * pad) * ((value - low) / (high - low))
        return round(x, 1), round(y, 1)

    points = [xy(i, value) for i, (_, value) in enumerate(series.points)]
    polyline = " ".join(f"{x},{y}" for x, y in points)
    dots = "".join(
        f'<circle cx="{x}" cy="{y}" r="3"><title>{at:%Y-%m-%d %H:%M:%S}: {value:.3g}</title>'
        "</circle>"
        for (x, y), (at, value) in zip(points, series.points, strict=True)
    )
    start, end = series.points[0][0], series.points[-1][0]
    return (
        f'<svg class="chart" role="img" viewBox="0 0 {width} {height}" '
        f'aria-label="{escape(series.name)} over time">'
        f'<line class="axis" x1="{pad}" y1="{height - pad}" x2="{width - pad}" '
        f'y2="{height - pad}"/>'
        f'<text x="{pad}" y="{pad - 10}">{high:.3g} {escape(series.unit)}</text>'
        f'<text x="{pad}" y="{height - 8}">{start:%H:%M:%S}</text>'
        f'<text x="{width - pad}" y="{height - 8}" text-anchor="end">{end:%H:%M:%S}</text>'
        f'<polyline points="{polyline}"/>{dots}</svg>'
    )
