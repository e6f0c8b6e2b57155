"""``keel demo`` in small: a real worker process, a real SIGKILL mid tool call, a resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from keel.demo import Airline, plans
from keel.demo._junk import PROMPTED_FILE, read_prompted
from keel.demo._run import run_demo, sparkline_chart

SRC = str(Path(__file__).resolve().parents[2] / "src")


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
    assert report.passed, report.problems
    assert report.resumed_after_kill
    assert report.repeated_questions_after_resume == 0
    assert report.double_bookings == 0
    assert report.bookings == 4
    assert report.failed_turns == 0
    # The kill came inside the booking, after the airline booked: the journal held it in
    # doubt, and it was settled from the airline's records (by its request key).
    assert report.in_doubt_settled == 1
    airline = Airline(tmp_path / "demo" / "airline.db")
    assert sorted(airline.bookings_per_trip().values()) == [1, 1, 1, 1]
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
    # The run the SIGKILL stopped says what happened to it: neither running for ever nor,
    # later, abandoned; the resumed run that took its turn over finished it.
    statuses = {}
    for status in ("running", "abandoned", "interrupted"):
        found = _keel("runs", "list", "--status", status, "--json", env=env)
        statuses[status] = json.loads(found.stdout.strip().splitlines()[-1])["runs"]
    assert statuses["running"] == [] and statuses["abandoned"] == []
    (killed,) = statuses["interrupted"]
    assert "took its turn over" in killed["error_message"]
    assert "its process was killed or crashed" in killed["error_message"]


def test_a_demo_with_memory_stores_no_junk_memories(tmp_path: Path) -> None:
    """No stored memory restates the system prompt, the rules, a resume prompt or a retrieved
    memory (mem0#4573), and identical turns stay one record, across the kill and the resume."""
    report = run_demo(trips=4, side_questions=3, workdir=tmp_path / "demo")
    assert report.passed, report.problems
    audit = report.memory_audit
    assert audit is not None and report.junk_memories == audit.junk == 0, audit
    assert (
        audit.system_prompt,
        audit.rules,
        audit.resume_prompt,
        audit.retrieved_memories,
        audit.restated_memories,
        audit.profiles,
        audit.duplicates,
    ) == (0, 0, 0, 0, 0, 0, 0)
    # The audit had something to check: turns, runs and summaries stored, memories retrieved,
    # and every kind of prompt text recorded (the worker killed mid-booking included).
    assert audit.by_type == {"turn": audit.by_type["turn"], "run": 4, "summary": 1}
    assert audit.retrieved > 10
    kinds = {item.kind for item in read_prompted(tmp_path / "demo" / PROMPTED_FILE)}
    assert kinds == {"system", "rules", "resume", "memory"}
    # The demo says some turns word for word more than once: each is one record (a turn is
    # two: the user's words and the model's).
    assert audit.by_type["turn"] < 2 * report.turns


def test_without_the_journal_the_demo_books_twice_and_fails(tmp_path: Path) -> None:
    """The control: switch the journal off and the same kill makes the demo fail."""
    workdir = tmp_path / "demo"
    options = ["--trips", "2", "--side-questions", "0", "--no-memory", "--no-journal"]
    result = subprocess.run(
        [sys.executable, "-m", "keel", "demo", *options, "--workdir", str(workdir), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])},
    )
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["journal"] is False and report["resumed_after_kill"]
    assert report["passed"] is False and report["double_bookings"] == 1
    assert any("booked more than once" in problem for problem in report["problems"])
    per_trip = Airline(workdir / "airline.db").bookings_per_trip()
    assert sorted(per_trip.values()) == [1, 2]


def test_every_planned_trip_is_a_different_journey() -> None:
    """The airline counts bookings per journey (route and day): a plan that repeated one after
    36 trips made a long demo report double bookings it never made."""
    trips = plans(400, 0)
    booked = {(t.origin, t.destination, (t.new_dates or t.dates).split(" ")[0]) for t in trips}
    assert len(booked) == len(trips)
    assert [t.dates for t in trips[:2]] == ["2027-01-01 to 2027-01-02", "2027-01-04 to 2027-01-05"]


def test_chart_shape() -> None:
    chart = sparkline_chart([100, 200, 400, 800], limit=1000, width=4, height=4)
    lines = chart.splitlines()
    assert len(lines) == 6
    assert "budget 1,000" in lines[-1]


@pytest.mark.postgres
@pytest.mark.redis
def test_demo_on_postgres_and_redis_reports_what_sqlite_does(
    tmp_path: Path, postgres_url: str, redis_url: str
) -> None:
    """Every worker, the one started after the SIGKILL too, opens its agent from the URLs."""
    import psycopg
    import redis

    options: dict[str, Any] = {"trips": 4, "side_questions": 3, "memory": False}
    on_sqlite = run_demo(**options, workdir=tmp_path / "sqlite")
    on_servers = run_demo(
        **options, workdir=tmp_path / "pg", database=postgres_url, redis_url=redis_url
    )
    assert on_servers.passed, on_servers.problems
    figures = ("turns", "bookings", "double_bookings", "in_doubt_settled", "failed_turns")
    assert {f: getattr(on_servers, f) for f in figures} == {
        f: getattr(on_sqlite, f) for f in figures
    }
    assert on_servers.resumed_after_kill and "state on redis" in on_servers.database
    assert not (tmp_path / "pg" / "keel.db").exists()
    with psycopg.connect(postgres_url) as conn:
        journal = conn.execute(
            "SELECT count(*) FROM keel_tool_journal WHERE tool = 'book_flight'"
        ).fetchone()
        runs = conn.execute("SELECT count(*) FROM trace_runs").fetchone()
    assert journal is not None and journal[0] == 4
    assert runs is not None and runs[0] >= on_servers.turns
    client = redis.Redis.from_url(redis_url)
    assert client.keys("keel:state:*")
    client.close()


@pytest.mark.postgres
@pytest.mark.redis
def test_demo_cli_starts_a_throwaway_postgres(tmp_path: Path) -> None:
    options = ["--trips", "2", "--side-questions", "1", "--no-memory", "--json"]
    result = subprocess.run(
        [sys.executable, "-m", "keel", "demo", "--database", "postgres", *options],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])},
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["passed"] and report["resumed_after_kill"] and report["double_bookings"] == 0
    assert report["database"].startswith("postgres (postgresql://")


def test_demo_cli_rejects_a_bad_database_url() -> None:
    result = _keel("demo", "--database", "mysql://db/keel", env={})
    assert result.returncode == 2 and "mysql://" in result.stderr
