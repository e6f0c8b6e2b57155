"""Seeded randomized faulty runs: every run ends, within limits, nothing runs twice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from keel.bench.faults import FAULTS, run_fault_bench


def test_randomized_faulty_runs_all_end_cleanly() -> None:
    report = run_fault_bench(160, seed=7, kills=0)
    assert report.runs == 160
    assert report.unhandled_exceptions == 0, report.failures
    assert report.ended_within_limits == 160
    assert report.double_executions == 0
    assert set(report.by_fault) == set(FAULTS)
    assert report.loops_detected > 0 and report.repairs > 0
    assert report.state_reverted_on_limit == report.limit_hits > 0
    assert report.resumed_after_crash > 0
    assert (
        report.by_fault["endless_loop"]["loop_detected"] == report.by_fault["endless_loop"]["runs"]
    )
    assert (
        report.by_fault["never_finishes"]["step_limit"] == report.by_fault["never_finishes"]["runs"]
    )
    assert report.by_fault["slow_run"].get("time_limit", 0) > 0


def test_the_same_seed_gives_the_same_runs() -> None:
    first = run_fault_bench(48, seed=3, kills=0)
    second = run_fault_bench(48, seed=3, kills=0)
    assert first.by_fault == second.by_fault
    assert (first.loops_detected, first.repairs) == (second.loops_detected, second.repairs)


def test_cli_prints_the_contract_on_the_last_line() -> None:
    src = str(Path(__file__).resolve().parents[2] / "src")
    result = subprocess.run(
        [sys.executable, "-m", "keel", "bench", "faults", "--runs", "20", "--kills", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])},
    )
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout.strip().splitlines()[-1])
    assert payload["runs"] == 20 and payload["killed_subprocesses"] == 1
    assert payload["unhandled_exceptions"] == 0 and payload["double_executions"] == 0
    assert payload["ended_within_limits"] == 20
    for key in ("loops_detected", "repairs", "state_reverted_on_limit", "by_fault"):
        assert key in payload
