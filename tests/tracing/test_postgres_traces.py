from __future__ import annotations

from collections.abc import Iterator

import pytest

from keel.errors import BackendUnavailableError
from keel.settings import load_settings
from keel.stores import Backends
from keel.stores._postgres_traces import PostgresTraceStore
from keel.testing.trace_conformance import TraceStoreConformance
from keel.tracing import TraceStore

pytestmark = pytest.mark.postgres


class TestPostgresTraceStore(TraceStoreConformance):
    @pytest.fixture
    def trace_store(self, postgres_url: str) -> Iterator[TraceStore]:
        store = PostgresTraceStore(postgres_url)
        store.setup()
        yield store
        store.close()


def test_settings_with_a_postgres_url_open_the_postgres_store(postgres_url: str) -> None:
    with Backends.open(load_settings(database=postgres_url), memory=False) as backends:
        store = backends.traces
        assert isinstance(store, PostgresTraceStore)
        store.setup()  # idempotent
        assert store.list_runs() == []


def test_an_unreachable_server_is_backend_unavailable() -> None:
    with pytest.raises(BackendUnavailableError):
        PostgresTraceStore("postgresql://nobody@127.0.0.1:1/none", connect_timeout=1)


def test_a_shared_database_is_used_and_left_open(postgres_url: str) -> None:
    from keel.stores import PostgresDatabase

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

    store = PostgresTraceStore(postgres_url)
    tracer = Tracer(store)
    with tracer.start_run("pg-session") as run:
        for index in range(10):
            run.record("model", "m", prompt_tokens=100 + index)
    store.close()
    monkeypatch.setenv("KEEL_DATABASE", postgres_url)
    assert main(["runs", "list", "--min-steps", "10", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["run_id"] for r in payload["runs"]] == [run.run_id]
    assert main(["runs", "stats", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert stats["sessions"][0]["model_calls"] == 10
