from __future__ import annotations

from collections.abc import Iterator

import pytest

from keel.errors import BackendUnavailableError
from keel.settings import load_settings
from keel.stores._postgres_traces import PostgresTraceStore
from keel.testing.trace_conformance import TraceStoreConformance
from keel.tracing import TraceStore, open_trace_store

pytestmark = pytest.mark.postgres


class TestPostgresTraceStore(TraceStoreConformance):
    @pytest.fixture
    def trace_store(self, postgres_url: str) -> Iterator[TraceStore]:
        store = PostgresTraceStore(postgres_url)
        store.setup()
        yield store
        store.close()


def test_settings_with_a_postgres_url_open_the_postgres_store(postgres_url: str) -> None:
    store = open_trace_store(load_settings(database=postgres_url))
    try:
        assert isinstance(store, PostgresTraceStore)
        store.setup()  # idempotent
        assert store.list_runs() == []
    finally:
        store.close()


def test_an_unreachable_server_is_backend_unavailable() -> None:
    with pytest.raises(BackendUnavailableError):
        PostgresTraceStore("postgresql://nobody@127.0.0.1:1/none", connect_timeout=1)
