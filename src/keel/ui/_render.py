"""What the pages draw, computed on the server: token bars, the workflow graph, state diffs and
indicator charts, as plain data and inline SVG (no script, no CDN, readable without JS)."""

from __future__ import annotations

import difflib
import itertools
import json
import math
import re
import shutil
import subprocess
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


_DOT_TIMEOUT_S = 10.0
"""Longest a graph layout may take (a workflow of hundreds of states lays out in well under a
second)."""


def _dot_id(name: str) -> str:
    return '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'


def machine_graph(
    states: Sequence[str],
    edges: Sequence[tuple[str, str, str]],
    initial: str,
    path: Sequence[str],
    current: str | None,
) -> str:
    """The workflow as an SVG laid out by Graphviz's ``dot`` (installed by ``setup.sh``), top
    to bottom so that it fits the page's width: every allowed move an arrow (back edges routed
    around the states, never clipped), the moves the session took drawn bold, its state
    filled. Blocking (a subprocess): call it through ``run_blocking``. Without ``dot`` on the
    PATH, a simpler grid layout."""
    dot = shutil.which("dot")
    if dot is None:
        return _grid_graph(states, edges, initial, path, current)
    taken = set(itertools.pairwise(path))
    visited = set(path)
    lines = [
        "digraph workflow {",
        'graph [rankdir=TB, bgcolor="transparent", nodesep=0.35, ranksep=0.45, '
        'fontname="sans-serif"];',
        'node [shape=box, style="rounded,filled", fontname="sans-serif", fontsize=12, '
        'height=0.4, color="#8a96a3", fillcolor="#ffffff", fontcolor="#1d232b"];',
        'edge [color="#8a96a3", arrowsize=0.7];',
    ]
    for state in dict.fromkeys([initial, *states]):
        if state == current:
            style = 'class="current", fillcolor="#174a99", color="#174a99", fontcolor="#ffffff"'
        elif state in visited:
            style = 'class="visited", fillcolor="#e7effb"'
        else:
            style = 'class="state"'
        lines.append(f"{_dot_id(state)} [{style}];")
    for source, target in dict.fromkeys((source, target) for source, target, _ in edges):
        style = (
            'class="taken", color="#174a99", penwidth=2.5'
            if (source, target) in taken
            else 'class="move"'
        )
        lines.append(f"{_dot_id(source)} -> {_dot_id(target)} [{style}];")
    lines.append("}")
    done = subprocess.run(
        [dot, "-Tsvg"],
        input="\n".join(lines),
        capture_output=True,
        text=True,
        timeout=_DOT_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        return _grid_graph(states, edges, initial, path, current)
    svg = done.stdout[done.stdout.index("<svg") :]
    svg = re.sub(r"<!--.*?-->\n?", "", svg, flags=re.DOTALL)
    # Drawn at its natural size, never wider than its box (scaled down, not cut).
    width = re.search(r'<svg width="([\d.]+)pt" height="([\d.]+)pt"', svg)
    natural = f"{float(width.group(1)) * 4 / 3:.0f}px" if width else "100%"
    svg = re.sub(
        r'<svg width="[\d.]+pt" height="[\d.]+pt"',
        f'<svg class="graph" role="img" aria-label="workflow graph" style="max-width: {natural}"',
        svg,
        count=1,
    )
    return svg.replace("<title>workflow</title>", "", 1)


def _grid_graph(
    states: Sequence[str],
    edges: Sequence[tuple[str, str, str]],
    initial: str,
    path: Sequence[str],
    current: str | None,
) -> str:
    """The workflow as an SVG grid: states in columns by their distance from ``initial``."""
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
        f'style="max-width: {total_w}px" aria-label="workflow graph">',
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
    shown_as: str | None = None
    """The unit the chart's axis reads, when not ``unit`` (a share shown in percent)."""
    scale: float = 1.0
    """What the chart multiplies the values by to show them in ``shown_as``."""

    @property
    def axis_unit(self) -> str:
        """The unit the chart's axis reads."""
        return self.shown_as or self.unit


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
        Series("retry rate", "share of calls", tuple(retry), shown_as="% of calls", scale=100),
        Series("prompt tokens per call", "tokens", tuple(tokens)),
        Series("machine resets", "resets", tuple(resets)),
        Series("time to first token", "ms", tuple(ttft)),
    ]


def _nice_ticks(high: float, count: int = 4) -> list[float]:
    """Round tick values from 0 to at least ``high``: steps of 1, 2, 2.5 or 5 times a power of
    ten."""
    if high <= 0:
        return [0.0, 1.0]
    raw = high / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    ticks = [0.0]
    while ticks[-1] < high - 1e-9:
        ticks.append(ticks[-1] + step)
    return ticks


def _tick_label(value: float) -> str:
    if value == int(value):
        return f"{int(value):,}"
    return f"{value:,.2f}".rstrip("0").rstrip(".")


def line_chart(series: Series, width: int = 560, height: int = 220) -> str:
    """One series as an SVG line chart: a y axis with round ticks in the series' unit, a time
    axis with a few ticks, and a point (with its value as a tooltip) per time slice."""
    if not series.points:
        return '<p class="empty">no data</p>'
    unit = series.axis_unit
    series = Series(series.name, unit, tuple((at, v * series.scale) for at, v in series.points))
    values = [value for _, value in series.points]
    ticks = _nice_ticks(max(max(values), 0.0))
    low, high = 0.0, ticks[-1]
    left, right, top, bottom = 64, 16, 14, 40
    count = len(series.points)
    start, end = series.points[0][0], series.points[-1][0]
    span = max((end - start).total_seconds(), 1e-9)

    def x_of(at: datetime) -> float:
        if count == 1:
            return round(left + (width - left - right) / 2, 1)
        return round(left + (width - left - right) * (at - start).total_seconds() / span, 1)

    def y_of(value: float) -> float:
        return round(height - bottom - (height - top - bottom) * (value - low) / (high - low), 1)

    parts = [
        f'<svg class="chart" role="img" viewBox="0 0 {width} {height}" '
        f'aria-label="{escape(series.name)} over time, in {escape(series.unit)}">'
    ]
    for tick in ticks:
        y = y_of(tick)
        parts.append(
            f'<line class="grid" x1="{left}" y1="{y}" x2="{width - right}" y2="{y}"/>'
            f'<text x="{left - 6}" y="{y + 4}" text-anchor="end">{_tick_label(tick)}</text>'
        )
    parts.append(
        f'<text class="unit" x="12" y="{(top + height - bottom) / 2}" text-anchor="middle" '
        f'transform="rotate(-90 12 {(top + height - bottom) / 2})">{escape(series.unit)}</text>'
        f'<line class="axis" x1="{left}" y1="{height - bottom}" x2="{width - right}" '
        f'y2="{height - bottom}"/>'
    )
    daily = span > 86_400
    shown = [start] if count == 1 else [start + (end - start) * i / 3 for i in range(4)]
    for index, at in enumerate(shown):
        anchor = "start" if index == 0 else "end" if index == len(shown) - 1 else "middle"
        label = at.strftime("%m-%d %H:%M" if daily else "%H:%M:%S")
        parts.append(
            f'<text x="{x_of(at)}" y="{height - bottom + 18}" text-anchor="{anchor}">{label}</text>'
        )
    parts.append(
        f'<text class="unit" x="{(left + width - right) / 2}" y="{height - 4}" '
        f'text-anchor="middle">time (UTC)</text>'
    )
    points = [(x_of(at), y_of(value)) for at, value in series.points]
    parts.append(f'<polyline points="{" ".join(f"{x},{y}" for x, y in points)}"/>')
    parts.extend(
        f'<circle cx="{x}" cy="{y}" r="3.5"><title>{at:%Y-%m-%d %H:%M:%S}: '
        f"{_tick_label(round(value, 2))} {escape(series.unit)}</title></circle>"
        for (x, y), (at, value) in zip(points, series.points, strict=True)
    )
    parts.append("</svg>")
    return "".join(parts)
