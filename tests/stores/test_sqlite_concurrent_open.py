"""Several processes opening one new SQLite file at the same moment (workers starting together):
the switch to WAL can answer "database is locked" at once, without SQLite's busy handler, and
must be waited out like any other lock."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

_OPEN = """
import sys, time
from pathlib import Path
from keel.stores import SQLiteDatabase, SQLStateBackend, SQLToolJournal
from keel.stores._sql_traces import SQLTraceStore
start = float(sys.argv[2])
while time.time() < start:
    time.sleep(0.001)
db = SQLiteDatabase(Path(sys.argv[1]))
SQLStateBackend(db)
SQLToolJournal(db)
SQLTraceStore(db).setup()
db.close()
"""


def test_processes_opening_a_new_database_together_all_succeed(tmp_path: Path) -> None:
    for attempt in range(3):
        path = tmp_path / f"keel-{attempt}.db"
        start = time.time() + 1.5  # every process is up and waiting by then
        workers = [
            subprocess.Popen(
                [sys.executable, "-c", _OPEN, str(path), str(start)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(6)
        ]
        for worker in workers:
            _, stderr = worker.communicate(timeout=120)
            assert worker.returncode == 0, stderr


def test_a_wal_switch_that_answers_locked_at_once_is_retried(tmp_path: Path) -> None:
    """SQLite returns that "locked" without its busy handler and only in a race between
    processes, so a stand-in connection produces it on demand."""
    import sqlite3

    from keel.stores import SQLiteDatabase

    class LockedTwice:
        def __init__(self) -> None:
            self.calls = 0

        def execute(self, sql: str) -> sqlite3.Cursor:
            self.calls += 1
            if self.calls <= 2:
                raise sqlite3.OperationalError("database is locked")
            return sqlite3.connect(":memory:").execute("SELECT 'wal'")

    db = SQLiteDatabase(tmp_path / "keel.db")
    stand_in = LockedTwice()
    assert db._enable_wal(stand_in) == "wal"  # type: ignore[arg-type]
    assert stand_in.calls == 3
    db.close()
