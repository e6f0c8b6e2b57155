from __future__ import annotations

from collections.abc import Iterator

import pytest

from keel.errors import BackendUnavailableError
from keel.settings import load_settings
from keel.stores import Backends, PostgresDatabase, SQLTraceStore
from keel.stores._postgres_traces import PostgresTraceStore
from keel.testing.trace_conformance import TraceStoreConformance
from keel.tracing import RunQuery, TraceStore

pytestmark = pytest.mark.postgres


class TestPostgresTraceStore(TraceStoreConformance):
    @pytest.fixture
    def trace_store(self, postgres_url: str) -> Iterator[TraceStore]:
        with PostgresDatabase(postgres_url, max_size=4) as database:
            store = PostgresTraceStore(database)
            store.setup()
            yield store
            store.close()


class TestSQLTraceStoreOnPostgres(TraceStoreConformance):
    """The one trace store's own batch (a plan: the run locked, each step's difference
    added), without the pipeline PostgresTraceStore sends instead: correct on PostgreSQL too."""

    @pytest.fixture
    def trace_store(self, postgres_url: str) -> Iterator[TraceStore]:
        with PostgresDatabase(postgres_url, max_size=4) as database:
            store = SQLTraceStore(database)
            yield store
            store.close()


def test_settings_with_a_postgres_url_open_the_postgres_store(postgres_url: str) -> None:
    with Backends.open(load_settings(database=postgres_url), memory=False) as backends:
        store = backends.traces
        assert isinstance(store, PostgresTraceStore)
        store.setup()  # idempotent
        assert store.list_runs() == []


def test_an_unreachable_server_is_backend_unavailable() -> None:
    database = PostgresDatabase("postgresql://nobody@127.0.0.1:1/none", timeout=1)
    with pytest.raises(BackendUnavailableError):
        PostgresTraceStore(database)
    database.close()


def test_a_shared_database_is_used_and_left_open(postgres_url: str) -> None:
    with PostgresDatabase(postgres_url, max_size=2) as database:
        store = PostgresTraceStore(database)
        store.setup()
        assert store.list_runs() == []
        store.close()
        with database.connection() as conn:  # still open after the store closed
            assert conn.execute("SELECT count(*) FROM trace_runs").fetchone() == (0,)


def test_keel_runs_reads_a_postgres_database_from_settings(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from keel.cli import main
    from keel.tracing import Tracer

    with PostgresDatabase(postgres_url, max_size=4) as database:
        tracer = Tracer(PostgresTraceStore(database))
        with tracer.start_run("pg-session") as run:
            for index in range(10):
                run.record("model", "m", prompt_tokens=100 + index)
    monkeypatch.setenv("KEEL_DATABASE", postgres_url)
    assert main(["runs", "list", "--min-steps", "10", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["run_id"] for r in payload["runs"]] == [run.run_id]
    assert main(["runs", "stats", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert stats["sessions"][0]["model_calls"] == 10


def test_a_batch_whose_end_names_no_run_writes_nothing(postgres_url: str) -> None:
    from datetime import UTC, datetime

    from keel.errors import StoreError
    from keel.tracing import Run, Step
    from keel.tracing._store import RunEnding

    now = datetime(2026, 1, 1, tzinfo=UTC)
    with PostgresDatabase(postgres_url, max_size=2) as database:
        store = PostgresTraceStore(database)
        store.start_run(Run(run_id="r1", session_id="s", agent="a", started_at=now))
        step = Step(run_id="r1", step_id="s0", seq=0, kind="model", started_at=now, ended_at=now)
        with pytest.raises(StoreError, match="no such run"):
            # The step and its run are fine, the end is not: the whole pipeline rolls back.
            store.write_batch(run=None, steps=[step], end=RunEnding("other", "failed", now))
        assert store.get_steps("r1") == []
        assert store.get_run("r1").step_count == 0  # type: ignore[union-attr]


async def test_an_async_batch_whose_end_names_no_run_writes_nothing(postgres_url: str) -> None:
    from datetime import UTC, datetime

    from keel.errors import StoreError
    from keel.tracing import Run, Step
    from keel.tracing._store import RunEnding

    now = datetime(2026, 1, 1, tzinfo=UTC)
    database = PostgresDatabase(postgres_url, max_size=2)
    try:
        store = PostgresTraceStore(database)
        await store.astart_run(Run(run_id="r1", session_id="s", agent="a", started_at=now))
        step = Step(run_id="r1", step_id="s0", seq=0, kind="model", started_at=now, ended_at=now)
        with pytest.raises(StoreError, match="no such run"):
            await store.awrite_batch(run=None, steps=[step], end=RunEnding("other", "failed", now))
        assert await store.aget_run_detail("r1") == store.get_run_detail("r1")
        assert store.get_steps("r1") == []
    finally:
        await database.aclose()


def test_a_selective_counter_filter_reads_the_ended_runs_counter_index(postgres_url: str) -> None:
    """50,000 runs, 50 of them with 60 steps, 500 still running: ``--min-steps 55`` finds the
    ended ones by the partial counter index and the running ones by the status index, as the
    counter index over every run served it before (schema 3)."""
    with PostgresDatabase(postgres_url, max_size=2) as database:
        store = SQLTraceStore(database)
        with database.connection() as conn:
            conn.execute(
                "INSERT INTO trace_runs (run_id, session_id, agent, status, started_at, "
                "step_count, model_calls) SELECT 'r' || g, 's', 'a', CASE WHEN g % 100 = 0 "
                "THEN 'running' ELSE 'succeeded' END, now() - g * interval '1 second', "
                "CASE WHEN g % 1000 = 7 THEN 60 ELSE g % 50 END, "
                "CASE WHEN g % 1000 = 7 THEN 60 ELSE g % 50 END "
                "FROM generate_series(1, 50000) g"
            )
            conn.execute("ANALYZE trace_runs")
            for query, index in (
                (RunQuery(min_steps=55), "trace_runs_ended_steps"),
                (RunQuery(min_model_calls=55), "trace_runs_ended_model_calls"),
            ):
                sql, params = store.statements.list_runs(query)
                plan = "\n".join(
                    str(row[0])
                    for row in conn.execute("EXPLAIN " + database.dialect.sql(sql), params)
                )
                assert f"Bitmap Index Scan on {index}" in plan, plan
                assert "Bitmap Index Scan on trace_runs_status" in plan, plan
        assert len(store.list_runs(RunQuery(min_steps=55))) == 50
        store.close()
