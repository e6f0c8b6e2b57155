"""``keel demo`` in small: a real worker process, a real SIGKILL mid tool call, a resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from keel.demo._run import run_demo, sparkline_chart


def _keel(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "keel", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


def test_demo_resumes_after_sigkill_without_repeats_or_double_bookings(tmp_path: Path) -> None:
    report = run_demo(trips=4, side_questions=3, memory=False, workdir=tmp_path / "demo")
    assert report.resumed_after_kill
    assert report.repeated_questions_after_resume == 0
    assert report.double_bookings == 0
    assert report.bookings == 4
    assert report.failed_turns == 0
    assert 0 < report.max_prompt_tokens <= report.prompt_budget
    # The traces are in the same database and the CLI finds the long runs.
    env = {"KEEL_DATABASE": f"sqlite:///{tmp_path / 'demo' / 'keel.db'}"}
    listed = _keel("runs", "list", "--min-steps", "5", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    runs = json.loads(listed.stdout.strip().splitlines()[-1])
    rows = runs["runs"] if isinstance(runs, dict) else runs
    assert rows, "booking turns take at least 5 steps (model calls)"
    assert all(row["model_calls"] >= 5 for row in rows)
    shown = _keel("runs", "show", rows[0]["run_id"], env=env)
    assert shown.returncode == 0 and "book_flight" in shown.stdout


def test_chart_shape() -> None:
    chart = sparkline_chart([100, 200, 400, 800], limit=1000, width=4, height=4)
    lines = chart.splitlines()
    assert len(lines) == 6
    assert "budget 1,000" in lines[-1]
