"""``keel bench state`` as a user runs it (a small workload)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_bench_state_json_contract() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "keel",
            "bench",
            "state",
            "--steps",
            "30",
            "--writers",
            "4",
            "--increments",
            "2",
            "--backend",
            "sqlite",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ.copy(),
    )
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    sqlite = figures["backends"]["sqlite"]
    assert sqlite["lost_updates"] == 0 and sqlite["checkpoints_per_s"] > 0
    assert sqlite["bytes_total"] > 0 and sqlite["read_ms_p50"] > 0
    lang = figures["langgraph_sqlite"]
    assert lang["checkpoints_per_s"] > 0 and lang["bytes_total"] > 0


def test_bench_state_rejects_unknown_backend() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "keel", "bench", "state", "--backend", "mongo"],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ.copy(),
    )
    assert result.returncode == 2 and "unknown backend" in result.stderr
