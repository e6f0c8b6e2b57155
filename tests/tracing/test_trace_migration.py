"""A trace database of schema 2 (counter indexes over every run, a second index of steps in
order) upgrades to schema 3 with its runs and steps kept: the filters and a run's steps read
as before, running runs and ended ones alike, and the indexes a turn no longer writes are
gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from keel.stores import PostgresDatabase, SQLiteDatabase
from keel.stores._migrations import MigrationSet
from keel.stores._sql_plan import SQLDatabase
from keel.stores._sql_traces import SQLTraceStore, trace_migrations
from keel.testing.trace_conformance import T0, _run, _step
from keel.tracing import RunQuery


class _SchemaTwo(SQLTraceStore):
    """The trace store as it wrote at schema 2: the same statements, the first two
    migrations applied."""

    def setup(self) -> None:
        self.db.migrate(MigrationSet("traces", trace_migrations(self.db.dialect).migrations[:2]))


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SQLDatabase]:
    if request.param == "postgres":
        with PostgresDatabase(request.getfixturevalue("postgres_url"), max_size=2) as db:
            yield db
    else:
        with SQLiteDatabase(tmp_path / "keel.db") as db:
            yield db


def _indexes(db: SQLDatabase) -> set[str]:
    if isinstance(db, SQLiteDatabase):
        rows = db.connection().execute(
            "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name LIKE 'trace_%'"
        )
        return {str(row[0]) for row in rows}
    assert isinstance(db, PostgresDatabase)
    with db.connection() as conn:
        rows = conn.execute("SELECT indexname FROM pg_indexes WHERE tablename LIKE 'trace_%'")
        return {str(row[0]) for row in rows}


def _version(db: SQLDatabase) -> int:
    if isinstance(db, SQLiteDatabase):
        return db.schema_versions()["traces"]
    assert isinstance(db, PostgresDatabase)
    with db.connection() as conn:
        found = conn.execute("SELECT version FROM keel_schema WHERE component = 'traces'")
        return int(found.fetchone()[0])


def _reads(store: SQLTraceStore) -> dict[str, object]:
    def ids(**filters: object) -> list[str]:
        return [run.run_id for run in store.list_runs(RunQuery(**filters))]

    detail = store.get_run_detail("live")
    assert detail is not None
    return {
        "min_steps 3": ids(min_steps=3),
        "min_steps 5": ids(min_steps=5),
        "min_model_calls 2": ids(min_model_calls=2),
        "running, min_steps 3": ids(min_steps=3, status="running"),
        "live's steps": [step.step_id for step in detail.steps],
    }


def test_a_schema_two_trace_database_upgrades_with_its_runs_kept(database: SQLDatabase) -> None:
    old = _SchemaTwo(database)
    old.start_run(_run("ended", minutes=0))
    for seq in range(6):
        old.write_step(_step("ended", seq, "model" if seq % 2 == 0 else "tool"))
    old.end_run("ended", status="succeeded", ended_at=T0 + timedelta(minutes=1))
    old.start_run(_run("live", minutes=5))  # still running when the upgrade comes
    for seq in (2, 0, 1):  # written out of order: read back in order
        old.write_step(_step("live", seq, "model" if seq != 1 else "tool"))
    old.start_run(_run("short", minutes=9))
    old.write_step(_step("short", 0))
    old.end_run("short", status="failed", ended_at=T0 + timedelta(minutes=10))
    assert _version(database) == 2
    before = _reads(old)
    assert before == {
        "min_steps 3": ["live", "ended"],
        "min_steps 5": ["ended"],
        "min_model_calls 2": ["live", "ended"],
        "running, min_steps 3": ["live"],
        "live's steps": ["live-0", "live-1", "live-2"],
    }

    store = SQLTraceStore(database)  # migrates
    assert _version(database) == 3
    assert _reads(store) == before
    indexes = _indexes(database)
    assert {"trace_runs_ended_steps", "trace_runs_ended_model_calls"} <= indexes, indexes
    assert not indexes & {"trace_runs_steps", "trace_runs_model_calls", "trace_steps_order"}
    # The upgraded store goes on writing: the live run's next steps and its end.
    store.write_step(_step("live", 3, "model"))
    store.end_run("live", status="succeeded", ended_at=T0 + timedelta(minutes=6))
    assert [run.run_id for run in store.list_runs(RunQuery(min_steps=4))] == ["live", "ended"]
    assert [run.run_id for run in store.list_runs(RunQuery(min_steps=4, status="running"))] == []


_CRASHING_UPGRADE = """
import os, signal, sys
from keel.stores import PostgresDatabase, SQLiteDatabase
from keel.stores._migrations import Migration, MigrationSet
from keel.stores._sql_traces import trace_migrations

target = sys.argv[1]
db = PostgresDatabase(target) if "://" in target else SQLiteDatabase(target)
migrations = trace_migrations(db.dialect).migrations
# Schema 3's statements run, then the process dies before the upgrade's transaction commits.
die = Migration("killed", lambda conn: os.kill(os.getpid(), signal.SIGKILL))
db.migrate(MigrationSet("traces", (*migrations, die)))
"""


def test_a_process_killed_during_the_upgrade_leaves_schema_two_whole(
    database: SQLDatabase,
) -> None:
    old = _SchemaTwo(database)
    old.start_run(_run("ended", minutes=0))
    for seq in range(6):
        old.write_step(_step("ended", seq))
    old.end_run("ended", status="succeeded", ended_at=T0 + timedelta(minutes=1))
    old.start_run(_run("live", minutes=5))
    for seq in (2, 0, 1):
        old.write_step(_step("live", seq))
    before = _reads(old)
    indexes = _indexes(database)
    if isinstance(database, SQLiteDatabase):
        target = str(database.path)
    else:
        assert isinstance(database, PostgresDatabase)
        target = database.url
    killed = subprocess.run(
        [sys.executable, "-c", _CRASHING_UPGRADE, target], env=os.environ, check=False
    )
    assert killed.returncode == -signal.SIGKILL
    assert _version(database) == 2
    assert _indexes(database) == indexes
    assert _reads(old) == before
    SQLTraceStore(database)  # the next process upgrades it
    assert _version(database) == 3
    assert _reads(old) == before
