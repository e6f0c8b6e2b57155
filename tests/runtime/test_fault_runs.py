"""Seeded randomized faulty runs: every run ends, within limits, nothing runs twice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from keel.bench.faults import FAULTS, FaultBenchReport, run_fault_bench

# The bench runs under tight time limits (0.1 s per model or tool call, 2 s per run) so that
# hangs end quickly. On a loaded machine a run may meet its time limit before the limit or
# guard it would meet on an idle one: assertions accept that substitution, never more.


def _stopped(row: dict[str, int], *statuses: str) -> int:
    return sum(row.get(status, 0) for status in (*statuses, "time_limit"))


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
    endless = report.by_fault["endless_loop"]
    assert _stopped(endless, "loop_detected") == endless["runs"]
    never = report.by_fault["never_finishes"]
    assert _stopped(never, "step_limit") == never["runs"]
    # slow_run's calls take 8 x 30 ms against a 150 ms run limit: the time limit, always.
    assert report.by_fault["slow_run"].get("time_limit", 0) > 0


def _timing_free(report: FaultBenchReport) -> dict[str, dict[str, int]]:
    """The outcomes that no time limit touched: faults whose runs never met one."""
    return {fault: dict(row) for fault, row in report.by_fault.items() if not row.get("time_limit")}


def test_the_same_seed_gives_the_same_runs() -> None:
    first = run_fault_bench(48, seed=3, kills=0)
    second = run_fault_bench(48, seed=3, kills=0)
    # The seed decides every run's plan, so the same faults are drawn the same number of times.
    assert {f: row["runs"] for f, row in first.by_fault.items()} == {
        f: row["runs"] for f, row in second.by_fault.items()
    }
    # Where no time limit interfered, the outcomes are the same too.
    free = _timing_free(first).keys() & _timing_free(second).keys()
    assert free, "every fault met a time limit: the machine is far too loaded"
    assert {f: first.by_fault[f] for f in free} == {f: second.by_fault[f] for f in free}


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
