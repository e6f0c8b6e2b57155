"""``keel bench turns`` as a user runs it (a small workload)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_bench_turns_json_contract() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "keel",
            "bench",
            "turns",
            "--turns",
            "20",
            "--bucket",
            "10",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ.copy(),
    )
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["turns"] == 20 and figures["tool_executions"] == 20
    assert len(figures["buckets_ms_p50"]) == 2 and figures["flatness"] > 0
    assert figures["p50_ms"] > 0 and figures["turns_per_s"] > 0 and figures["db_bytes"] > 0
    assert figures["memory_on"]["tool_executions"] == 20
    assert figures["langgraph"]["db_bytes"] > 0 and figures["speedup_vs_langgraph"] > 0


def test_bench_turns_on_a_throwaway_postgres() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "keel",
            "bench",
            "turns",
            "--turns",
            "10",
            "--bucket",
            "5",
            "--no-memory",
            "--no-langgraph",
            "--database",
            "postgres",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ.copy(),
    )
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["database"] == "postgres" and figures["tool_executions"] == 10
    # Counted by the server: the session's rows, not an empty database's size.
    assert 0 < figures["db_bytes"] < 50_000_000
