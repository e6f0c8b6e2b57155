"""Exactly-once across a real crash: an Agent's worker SIGKILLed mid-turn, then resumed by a
fresh Agent; bookings counted from the external ledger the tool writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from keel.bench.faults import kill_and_resume
from keel.stores import SQLiteDatabase, SQLToolJournal


@pytest.mark.slow
def test_killed_inside_the_booking_the_call_is_in_doubt_and_nobody_is_booked_twice(
    tmp_path: Path,
) -> None:
    outcome = kill_and_resume(tmp_path, number=0, seed=1)
    assert outcome.mode == "in_tool" and outcome.error is None
    # The booking happened before the kill; the resumed turn did not book again.
    assert outcome.bookings == 1 and outcome.doubles == 0
    assert outcome.status == "tool_in_doubt"
    db = SQLiteDatabase(tmp_path / "keel.db")
    doubtful = SQLToolJournal(db).in_doubt("default/kill-1-0")
    assert [entry.tool for entry in doubtful] == ["book_flight"]
    db.close()


@pytest.mark.slow
def test_killed_after_the_result_was_checkpointed_the_turn_completes_once(
    tmp_path: Path,
) -> None:
    outcome = kill_and_resume(tmp_path, number=1, seed=1)
    assert outcome.mode == "next_model_call" and outcome.error is None
    assert outcome.status == "completed"
    assert outcome.bookings == 1 and outcome.doubles == 0 and outcome.lost_turns == 0
    db = SQLiteDatabase(tmp_path / "keel.db")
    (entry,) = SQLToolJournal(db).entries("default/kill-1-1")
    db.close()
    assert entry.status == "succeeded" and entry.attempts == 1


@pytest.mark.slow
def test_without_the_journal_the_same_crash_books_twice(tmp_path: Path) -> None:
    """The control: the check above can fail. Resume without the journal and it re-books."""
    outcome = kill_and_resume(tmp_path, number=0, seed=2, journal=False)
    assert outcome.error is None
    assert outcome.bookings == 2 and outcome.doubles == 1
