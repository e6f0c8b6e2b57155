"""The checks every user-erasure test makes, whatever carried the erasure (CLI, HTTP) and
whatever the database (SQLite, PostgreSQL)."""

from __future__ import annotations

from typing import Any

from tests.privacy._erasure_world import (
    ERASED,
    EXPECTED_BEFORE,
    NEIGHBOURLY,
    SAME_ID_ELSEWHERE,
    Person,
    Scan,
    left_of,
)


def tables_of(person: Person, found: Scan) -> set[str]:
    return {table for tables in left_of(person, found).values() for table in tables}


def assert_found_before(before: Scan) -> None:
    """The world holds the erased user where it should (else the scan could not fail)."""
    missing = EXPECTED_BEFORE - tables_of(ERASED, before)
    assert not missing, f"the erased user was never in {sorted(missing)}"


def _kept(person: Person, found: Scan) -> dict[str, dict[str, int]]:
    # SQLite's full-text index is merged by the erasure: its segments hold other words after.
    return {
        needle: {t: n for t, n in tables.items() if not t.startswith("memory_fts")}
        for needle, tables in left_of(person, found).items()
    }


def assert_erased_only(before: Scan, after: Scan, report: dict[str, Any]) -> None:
    """Nothing of the erased user is left in any table; everyone else is as they were; the
    report counts what went."""
    assert left_of(ERASED, after) == {}, "the erased user is still in the database"
    for kept in (SAME_ID_ELSEWHERE, NEIGHBOURLY):
        assert _kept(kept, after) == _kept(kept, before), f"{kept.tenant}/{kept.user} changed"
    assert "keel_erasures" in after.tables
    removed = report["removed"]
    assert removed["state"]["sessions"] == 1 and removed["state"]["checkpoints"] >= 2
    assert removed["journal"]["tool_journal"] == 2
    assert removed["approvals"]["approvals"] >= 1
    assert removed["traces"]["trace_runs"] >= 2 and removed["traces"]["trace_steps"] >= 2
    assert removed["memory"]["memory_records"] >= 2
    assert removed["vault"]["pii_keys"] == 1
    assert report["total"] == sum(sum(tables.values()) for tables in removed.values())
