"""``keel bench mcp``: workers SIGKILLed (with their MCP server) at each seeded point (mid-write,
after the model's call arrived, after a write's result was recorded, before the commit) are
finished by a new process that runs no write twice and loses none, counted from the server's
own effects; the JSON line has the figures the issue asks for, per point too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from keel.bench.mcp import KILL_POINTS

SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_kills_at_every_point_neither_double_nor_lose_a_write() -> None:
    command = [sys.executable, "-m", "keel", "bench", "mcp", "--calls", "30", "--kills", "4"]
    result = subprocess.run(
        [*command, "--seed", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])},
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert {"added_ms_p50", "added_ms_p95", "calls", "kills", "doubled", "missing"} <= set(report)
    assert report["calls"] == 30 and report["kills"] == 4 and report["seed"] == 1
    points = report["points"]
    # Four rounds: each point once, in the seed's order (seed 1 kills mid-write on the second
    # write, after the first was checkpointed: the resumed turn's revert must keep it).
    assert set(points) == set(KILL_POINTS)
    assert all(point["kills"] == 1 for point in points.values()), points
    # Only a kill mid-write leaves a write in doubt; it is settled, never run again.
    assert report["in_doubt_after_resume"] == 1
    assert all(point["doubled"] == 0 and point["missing"] == 0 for point in points.values())
    assert report["doubled"] == 0 and report["missing"] == 0
