"""What every benchmark reports its latencies and database sizes with."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from pathlib import Path

__all__ = ["nearest_rank", "sqlite_file_bytes"]


def sqlite_file_bytes(path: Path) -> int:
    """A SQLite database's bytes on disk: the file and its write-ahead log, once the log has
    been folded into the file (so a run is not measured by when SQLite last checkpointed)."""
    conn = sqlite3.connect(path)
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()
    return sum(p.stat().st_size for p in (path, Path(f"{path}-wal")) if p.exists())


def nearest_rank(values: Sequence[float], fraction: float) -> float:
    """The ``fraction`` (0-1) quantile of ``values`` by nearest rank: always one of the
    measured values, never an interpolation between two; 0.0 when there are none."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))]
