"""What every benchmark reports its latencies with."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["nearest_rank"]


def nearest_rank(values: Sequence[float], fraction: float) -> float:
    """The ``fraction`` (0-1) quantile of ``values`` by nearest rank: always one of the
    measured values, never an interpolation between two; 0.0 when there are none."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))]
