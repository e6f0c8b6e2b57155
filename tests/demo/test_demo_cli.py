"""``keel demo`` as a user runs it: what it says while it runs, what its figures mean, and
why it stopped when it could not start."""

from __future__ import annotations

import json
import sqlite3
import subprocess
from pathlib import Path

from keel.cli._demo import _summary
from keel.demo._run import DemoReport, run_demo
from tests.cli import keel_process


def _keel_demo(*args: str) -> subprocess.CompletedProcess[str]:
    return keel_process("demo", *args, timeout=300)


def test_piped_demo_reports_progress_on_stderr_against_the_trips_planned(tmp_path: Path) -> None:
    options = ("--trips", "2", "--side-questions", "1", "--no-memory")
    result = _keel_demo(*options, "--workdir", str(tmp_path / "demo"))
    assert result.returncode == 0, result.stderr
    progress = [line for line in result.stderr.splitlines() if line.startswith("demo: ")]
    assert [line.split(" (")[0] for line in progress] == [
        "demo: 1/2 trips booked",
        "demo: worker killed inside a booking; a new worker resumed the turn",
        "demo: 2/2 trips booked",
    ]
    assert "demo:" not in result.stdout and "result" in result.stdout and "passed" in result.stdout
    with_json = _keel_demo(*options, "--workdir", str(tmp_path / "json"), "--json")
    assert "demo: 2/2 trips booked" in with_json.stderr
    assert json.loads(with_json.stdout.strip().splitlines()[-1])["passed"] is True


def test_loops_caught_on_a_passing_run_are_explained_not_flagged() -> None:
    report = DemoReport(
        turns=10,
        trips_planned=1,
        bookings=1,
        resumed_after_kill=True,
        repeated_questions_after_resume=0,
        double_bookings=0,
        max_prompt_tokens=100,
        prompt_budget=1000,
        loops_caught=12,
        failed_turns=0,
        seconds=1.0,
        model="scripted",
        workdir="/tmp/demo",
    )
    lines = dict(_summary(report, None, throwaway=False))
    assert lines["loops caught"].startswith("12 (expected: the scripted model retries")
    assert "loop guard stops it" in lines["loops caught"]
    assert "warning" not in " ".join(str(value) for value in lines.values()).lower()
    assert lines["result"] == "passed"


def test_an_unknown_model_is_named_with_the_worker_log(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    result = _keel_demo("--model", "foo:bar", "--workdir", str(workdir), "--no-memory")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert "UnknownModelError: unknown model 'foo:bar'" in line
    assert f"its log is {workdir / 'worker.stderr'}" in line


def test_the_same_demo_sends_the_same_prompts_every_run(tmp_path: Path) -> None:
    """The figures the demo prints (max prompt tokens) are the same in every run: no clock
    in a tool call id or a booking reference changes a prompt's token count, and what memory
    recalls does not depend on how far its embedder got."""
    first, second = (
        run_demo(trips=3, side_questions=2, workdir=tmp_path / name) for name in ("first", "second")
    )
    assert first.passed and second.passed
    assert first.prompt_tokens_per_turn == second.prompt_tokens_per_turn
    assert first.max_prompt_tokens == second.max_prompt_tokens
    # What the prompts hold that used to come from the clock: tool call ids, references.
    made = [_ids_and_references(tmp_path / name) for name in ("first", "second")]
    assert made[0] == made[1] and len(made[0][0]) > 10 and len(made[0][1]) == 3


def _ids_and_references(workdir: Path) -> tuple[list[str], list[str]]:
    with sqlite3.connect(workdir / "keel.db") as traces:
        ids = [
            row[0]
            for row in traces.execute(
                "SELECT s.tool_call_id FROM trace_steps s JOIN trace_runs r USING (run_id) "
                "WHERE s.kind = 'tool' ORDER BY r.started_at, s.seq"
            )
        ]
    with sqlite3.connect(workdir / "airline.db") as airline:
        references = [row[0] for row in airline.execute("SELECT reference FROM bookings")]
    return ids, references
