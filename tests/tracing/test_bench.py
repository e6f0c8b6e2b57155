from __future__ import annotations

import json

import pytest

from keel.bench.traces import run_trace_bench
from keel.cli import main


def test_trace_bench_writes_what_it_reports() -> None:
    figures = run_trace_bench(runs=4, steps=11, sessions=2)
    assert figures["steps_written"] == 44 and figures["write_failures"] == 0
    assert figures["runs_found"] == 4 and figures["show_run_steps"] == 11
    # 20 tool steps carry ~8 kB results each, stored whole.
    assert figures["stats_sessions"] == 2 and figures["database_bytes"] > 20 * 8000


def test_bench_traces_command_prints_one_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "traces", "--runs", "2", "--steps", "3", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert payload["steps_written"] == 6 and payload["runs"] == 2
