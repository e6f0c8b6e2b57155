"""``keel bench faults``: seeded faulty runs of the real Agent, figures counted from effects.

The assertions are invariants (every run ends, within its limits; nothing books twice in one
process; a guard stop reverts the state, as the store shows), never statuses that depend on
how fast a loaded machine runs 0.1 s timeouts.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from keel.bench.faults import (
    FAULTS,
    FaultBenchReport,
    Ledger,
    _Keel,
    _pair_figures,
    run_fault_bench,
    two_processes_one_session,
)
from keel.messages import Message
from keel.state import AgentState, StateStore
from keel.stores import SQLiteDatabase, SQLStateBackend
from keel.tools import ToolContext

_LIMITS = {"step_limit", "time_limit", "loop_detected"}


def _statuses(row: dict[str, int]) -> set[str]:
    return {status for status in row if status != "runs"}


@pytest.fixture(scope="module")
def report() -> FaultBenchReport:
    return run_fault_bench(160, seed=7, kills=0, pairs=0)


def test_a_bench_run_in_process_gives_the_process_its_logging_back(
    report: FaultBenchReport, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The bench quiets the warnings its faults cause on purpose. It once left "keel.tools" at
    # ERROR for good, and a later test in the same process lost an MCP server's start-up
    # warning (CI, random order).
    monkeypatch.setattr(logging.getLogger("keel"), "propagate", True)
    caplog.set_level(logging.WARNING)
    for name in ("keel.tools.mcp", "keel.guards"):
        logging.getLogger(name).warning("said after the bench by %s", name)
        assert f"said after the bench by {name}" in caplog.text


def test_randomized_faulty_runs_of_the_agent_all_end_cleanly(report: FaultBenchReport) -> None:
    assert report.runs == 160
    assert report.unhandled == 0, report.failures
    assert report.within_limits == 160
    # Counted from the ledger: no business booking happened twice, not even the one that
    # outlived its timeout and that the model asked for again in a second turn.
    assert report.double_executions == 0
    assert report.by_fault["booking_timeout"]["runs"] > 0
    assert _statuses(report.by_fault["booking_timeout"]) <= {"tool_in_doubt", "completed"}
    assert set(report.by_fault) == set(FAULTS)
    assert report.loops_detected > 0 and report.repairs > 0
    # Read back from the store: every guard stop left none of the turn's tool calls behind,
    # and none of them hid a booking the ledger holds.
    assert report.limit_hits > 0
    assert report.state_reverted_on_limit == report.limit_hits
    assert report.effects_hidden_by_revert == 0
    assert report.resumed_after_crash > 0
    assert report.duplicated_user_messages == 0
    for fault in ("endless_loop", "oscillation", "never_finishes", "slow_run"):
        assert _statuses(report.by_fault[fault]) <= _LIMITS, (fault, report.by_fault[fault])
    # On a loaded machine a run may meet its time limit before its loop is detected: the
    # substitution is accepted, never another outcome.
    assert _statuses(report.by_fault["endless_loop"]) <= {"loop_detected", "time_limit"}


def test_no_turn_is_lost_across_crashes(report: FaultBenchReport) -> None:
    assert report.lost_turns == 0


def test_without_the_journal_the_ledger_counts_the_doubles() -> None:
    """The control: the figure can fail. Without the durable journal, a crashed booking is
    run again on resume and a timed-out one again in the next turn; the ledger sees both."""
    report = run_fault_bench(72, seed=7, kills=0, pairs=0, journal=False)
    assert report.double_executions > 0
    assert report.unhandled == 0, report.failures


def test_the_same_seed_gives_the_same_runs() -> None:
    first = run_fault_bench(40, seed=3, kills=0, pairs=0)
    second = run_fault_bench(40, seed=3, kills=0, pairs=0)
    runs = {fault: row["runs"] for fault, row in first.by_fault.items()}
    assert runs == {fault: row["runs"] for fault, row in second.by_fault.items()}
    assert first.repairs == second.repairs


def test_pair_figures_count_business_bookings_and_committed_messages(tmp_path: Path) -> None:
    """The two-process figures, from a ledger and a state written by hand."""
    ledger = Ledger(tmp_path / "ledger.db")
    session = "pair-x"
    stored = _Keel.key(session)  # the Agent keys sessions by tenant in state and journal

    def book(order: str, key: str) -> None:
        context = ToolContext(stored, 0, 0, "c", key)
        ledger.record(context, "book_flight", order, idempotent=False)

    # Order A booked twice under two different idempotency keys: one double, whatever the keys.
    book("A", "keel-1")
    book("A", "keel-2")
    book("B", "keel-3")
    book("D", "keel-4")  # booked by a turn that reported a conflict
    db = SQLiteDatabase(tmp_path / "keel.db")
    store = StateStore(SQLStateBackend(db), AgentState)
    texts = {order: f"Please book order {order}." for order in "ABCDE"}
    messages = [Message.user(texts["A"]), Message.user(texts["B"]), Message.user(texts["B"])]
    messages.append(Message.user(texts["E"]))  # a conflicted turn whose message stayed
    store.create(stored, AgentState(messages=messages))
    db.close()
    turns = [
        {"order": "A", "text": texts["A"], "status": "completed", "seconds": 0.1, "steps": 2},
        {"order": "B", "text": texts["B"], "status": "completed", "seconds": 0.1, "steps": 2},
        {"order": "C", "text": texts["C"], "status": "completed", "seconds": 0.1, "steps": 2},
        {"order": "D", "text": texts["D"], "status": "conflict", "seconds": 0.1},
        {"order": "E", "text": texts["E"], "status": "conflict", "seconds": 0.1},
    ]
    outcome = _pair_figures(tmp_path, session, turns, [], planned=2)
    assert outcome.doubles == 1
    assert outcome.lost_turns == 1  # C was answered and is not in the committed state
    assert outcome.missing_effects == 1  # C completed, and the ledger has no booking for it
    assert outcome.duplicated == 1  # B is there twice
    assert outcome.conflicts == 2 and outcome.conflicts_with_effects == 2
    assert outcome.errors == [] and not outcome.within_limits  # 5 turns of 4 planned


@pytest.mark.slow
def test_two_workers_on_one_session_are_measured_within_bounded_time(tmp_path: Path) -> None:
    outcome = two_processes_one_session(tmp_path, 0, seed=1, turns=4, timeout_s=120)
    assert outcome.errors == [], outcome.errors
    assert len(outcome.statuses) == 8 and outcome.within_limits
    with sqlite3.connect(tmp_path / "ledger.db") as conn:
        (rows,) = conn.execute("SELECT COUNT(*) FROM effects").fetchone()
    # Every booking row is accounted for: once per order, plus one per double.
    orders = {f"pair-1-0-w{w}-t{t}" for w in (0, 1) for t in range(4)}
    with sqlite3.connect(tmp_path / "ledger.db") as conn:
        booked = {key for (key,) in conn.execute("SELECT DISTINCT business_key FROM effects")}
    assert booked <= orders
    assert rows >= len(booked) + outcome.doubles


def test_cli_prints_the_contract_on_the_last_line() -> None:
    src = str(Path(__file__).resolve().parents[2] / "src")
    command = ["bench", "faults", "--runs", "20", "--kills", "1", "--pairs", "1"]
    result = subprocess.run(
        [sys.executable, "-m", "keel", *command, "--pair-turns", "3", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])},
    )
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout.strip().splitlines()[-1])
    assert payload["runs"] == 20
    assert payload["killed_subprocesses"] == 1 and payload["two_process_runs"] == 1
    assert payload["unhandled"] == 0, payload["failures"]
    assert payload["within_limits"] == 20
    for key in (
        "double_executions",
        "lost_turns",
        "state_reverted_on_limit",
        "conflicted_turns_with_effects",
        "by_fault",
    ):
        assert key in payload
    assert payload["by_fault"]["two_process"]["runs"] == 1
    assert payload["by_fault"]["sigkill_in_tool"]["runs"] == 1
