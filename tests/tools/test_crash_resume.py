"""Exactly-once across a real crash: a process SIGKILLed mid-tool-call, then resumed."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from keel.bench.faults import kill_and_resume, resume_after_kill
from keel.stores import SQLiteDatabase, SQLiteToolJournal


@pytest.mark.slow
def test_killed_inside_the_tool_the_call_is_in_doubt_and_nobody_is_booked_twice(
    tmp_path: Path,
) -> None:
    outcome = kill_and_resume(tmp_path, number=0, seed=1)
    assert outcome.mode == "in_tool" and outcome.error is None
    # The booking happened before the kill; the resumed run did not book again.
    assert outcome.bookings == 1 and outcome.doubles == 0
    assert outcome.status == "tool_in_doubt"
    db = SQLiteDatabase(tmp_path / "journal.db")
    doubtful = SQLiteToolJournal(db).in_doubt("kill-1-0")
    assert [entry.tool for entry in doubtful] == ["book_flight"]
    db.close()


@pytest.mark.slow
def test_killed_after_the_result_was_journalled_the_result_is_replayed(tmp_path: Path) -> None:
    outcome = kill_and_resume(tmp_path, number=1, seed=1)
    assert outcome.mode == "after_result" and outcome.error is None
    assert outcome.status == "completed"
    assert outcome.bookings == 1 and outcome.doubles == 0
    with sqlite3.connect(tmp_path / "bookings.db") as conn:
        keys = conn.execute("SELECT DISTINCT key FROM bookings").fetchall()
    db = SQLiteDatabase(tmp_path / "journal.db")
    entry = SQLiteToolJournal(db).get(keys[0][0])
    db.close()
    assert entry is not None and entry.status == "succeeded" and entry.attempts == 1


@pytest.mark.slow
def test_without_the_journal_the_same_crash_books_twice(tmp_path: Path) -> None:
    """The control: the check above can fail. Lose the journal and the resumed run re-books."""
    outcome = kill_and_resume(tmp_path, number=0, seed=2)
    assert outcome.bookings == 1
    for leftover in tmp_path.glob("journal.db*"):
        leftover.unlink()
    again = resume_after_kill(tmp_path, "kill-2-0", "in_tool")
    assert again.bookings == 2 and again.doubles == 1
